"""Export files: a saved configuration as JSON that production jobs load without a database."""

from __future__ import annotations

import os

from autobalance._errors import ConfigError, SchemaVersionError
from autobalance._files import write_atomic
from autobalance.store._saved import SavedConfig

__all__ = ["export_file", "read_export_file"]


def export_file(saved: SavedConfig, path: str | os.PathLike[str]) -> str:
    """Write ``saved`` to ``path`` atomically (temporary file + rename); returns the path.

    A reader never sees a half-written file, even when several processes export at once.
    """
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(directory):
        raise ConfigError(
            f"Export path {target!r}: directory {directory} does not exist; create it first."
        )
    text = saved.to_json(indent=2) + "\n"
    return write_atomic(target, text, mode=0o644)


def read_export_file(path: str | os.PathLike[str]) -> SavedConfig:
    """Read and validate a file written by :func:`export_file` (no database involved)."""
    target = os.fspath(path)
    try:
        with open(target, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(
            f"Config file {target!r} does not exist; write one with "
            f"`autobalance export --study-name NAME -o {target}`."
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"Config file {target!r} cannot be read ({exc.strerror}); check its permissions."
        ) from None
    try:
        return SavedConfig.from_json(text)
    except (ConfigError, SchemaVersionError) as exc:
        raise type(exc)(f"Config file {target!r}: {exc}") from None
