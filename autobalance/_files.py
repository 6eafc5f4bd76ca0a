"""Small helpers every room uses: atomic file writes, a file's SHA-256, JSON value checks."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from typing import Any

__all__ = ["is_int", "is_number", "script_sha256", "write_atomic", "write_json_atomic"]


def write_atomic(path: str, text: str, *, fsync: bool = True, mode: int | None = None) -> str:
    """Write ``text`` to a new temporary file beside ``path`` (unique name: safe for several
    writers, hosts included), optionally fsync it, then rename it into place: a reader sees the old
    file or the whole new one, never a part. Returns ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_json_atomic(path: str, data: Any, *, indent: int | None = None, fsync: bool = True) -> str:
    """:func:`write_atomic` of ``data`` as JSON (values JSON cannot hold are written as ``str``)."""
    return write_atomic(path, json.dumps(data, indent=indent, default=str), fsync=fsync)


def script_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of the file at ``path``: identifies the training script a study tuned."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool`` (JSON and TOML values)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
