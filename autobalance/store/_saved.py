"""A saved best configuration: what the store returns and what an export file contains."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from autobalance._config import BalanceConfig
from autobalance._errors import ConfigError, SchemaVersionError
from autobalance.store._fingerprint import HardwareFingerprint

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_FORMAT_VERSION",
    "SavedConfig",
    "config_from_dict",
    "figures_to_json",
]

EXPORT_FORMAT = "autobalance.saved_config"
"""Value of the ``format`` key of an export file."""

EXPORT_FORMAT_VERSION = 1
"""Value of the ``format_version`` key of an export file written by this code."""

_FIELDS = (
    "study_name",
    "trial_number",
    "config",
    "figures",
    "fingerprint",
    "script_sha256",
    "created_at",
    "saved_by",
)


@dataclass(kw_only=True)
class SavedConfig:
    """The best configuration of a study, with the evidence and the hardware it was tuned on."""

    study_name: str
    """Optuna study the configuration was tuned in."""
    trial_number: int
    """Optuna trial number the configuration comes from."""
    config: BalanceConfig
    """The configuration itself (validated)."""
    figures: dict[str, Any]
    """Measured figures: per-rank peaks, spread, step time, baseline figures (free-form JSON)."""
    fingerprint: HardwareFingerprint
    """Hardware of the tuning job; production jobs compare theirs against it."""
    script_sha256: str = ""
    """SHA-256 of the training script at tuning time ("" when unknown)."""
    created_at: datetime
    """When it was saved (timezone-aware, UTC)."""
    saved_by: str = ""
    """Who and what saved it, e.g. ``alice@node1 (tune)``."""

    def __post_init__(self) -> None:
        if not isinstance(self.study_name, str) or not self.study_name:
            raise ConfigError(
                f"study_name={self.study_name!r} is not a non-empty string; name the study."
            )
        if (
            not isinstance(self.trial_number, int)
            or isinstance(self.trial_number, bool)
            or self.trial_number < 0
        ):
            raise ConfigError(
                f"trial_number={self.trial_number!r} is not a trial number; use the Optuna trial number (>= 0)."
            )
        if not isinstance(self.config, BalanceConfig):
            raise ConfigError(
                f"config={self.config!r} is not a BalanceConfig; pass a BalanceConfig."
            )
        if not isinstance(self.fingerprint, HardwareFingerprint):
            raise ConfigError(
                f"fingerprint={self.fingerprint!r} is not a HardwareFingerprint; pass a HardwareFingerprint."
            )
        figures_to_json(self.figures)
        if not isinstance(self.script_sha256, str):
            raise ConfigError(
                f"script_sha256={self.script_sha256!r} is not a string; pass the hex digest."
            )
        if not isinstance(self.saved_by, str):
            raise ConfigError(
                f"saved_by={self.saved_by!r} is not a string; pass e.g. 'user@host (tune)'."
            )
        if not isinstance(self.created_at, datetime):
            raise ConfigError(
                f"created_at={self.created_at!r} is not a datetime; pass a UTC datetime."
            )
        self.created_at = as_utc(self.created_at)

    def to_dict(self) -> dict[str, Any]:
        """The export file format (JSON-ready). A configuration with any split also carries
        ``split``, each rank's micro-batches as people read them (display only, derived from
        ``config``); an equal split is written exactly as before any split existed."""
        shown = {} if self.config.equal_micro_batches else {"split": self.config.split_lines()}
        return {
            "format": EXPORT_FORMAT,
            "format_version": EXPORT_FORMAT_VERSION,
            "study_name": self.study_name,
            "trial_number": self.trial_number,
            **shown,
            "config": self.config.to_dict(),
            "figures": json.loads(figures_to_json(self.figures)),
            "fingerprint": self.fingerprint.to_dict(),
            "script_sha256": self.script_sha256,
            "created_at": self.created_at.isoformat(),
            "saved_by": self.saved_by,
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Any) -> SavedConfig:
        """Parse and validate the export format; one-line :class:`ConfigError` on anything wrong."""
        if not isinstance(data, dict):
            raise ConfigError(
                f"saved configuration is a {type(data).__name__}, not a JSON object; "
                "use a file written by `autobalance export`."
            )
        if data.get("format") != EXPORT_FORMAT:
            raise ConfigError(
                f"saved configuration has format={data.get('format')!r}, not {EXPORT_FORMAT!r}; "
                "use a file written by `autobalance export`."
            )
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ConfigError(
                f"saved configuration has format_version={version!r}; use a file written by `autobalance export`."
            )
        if version > EXPORT_FORMAT_VERSION:
            raise SchemaVersionError(
                f"saved configuration has format_version {version}, newer than this autobalance's "
                f"({EXPORT_FORMAT_VERSION}); upgrade autobalance (`pip install -U autobalance`)."
            )
        if version < EXPORT_FORMAT_VERSION:
            raise SchemaVersionError(
                f"saved configuration has format_version {version}, older than this autobalance's "
                f"({EXPORT_FORMAT_VERSION}); export it again with `autobalance export`."
            )
        body = {k: v for k, v in data.items() if k not in ("format", "format_version", "split")}
        unknown = sorted(set(body) - set(_FIELDS))
        if unknown:
            raise ConfigError(
                f"saved configuration has unknown field(s) {unknown}; the known fields are {sorted(_FIELDS)}."
            )
        missing = [
            k
            for k in ("study_name", "trial_number", "config", "fingerprint", "created_at")
            if k not in body
        ]
        if missing:
            raise ConfigError(
                f"saved configuration lacks field(s) {missing}; use a file written by `autobalance export`."
            )
        figures = body.get("figures", {})
        if not isinstance(figures, dict):
            raise ConfigError(
                f"saved configuration figures={figures!r} is not a JSON object; fix the figures."
            )
        config = config_from_dict(body["config"])
        if "split" in data and data["split"] != config.split_lines():
            raise ConfigError(
                f"saved configuration has split={data['split']!r}, which is not its config's "
                f"{config.split_lines()!r}; split is display only: drop it or change config instead."
            )
        return cls(
            study_name=body["study_name"],
            trial_number=body["trial_number"],
            config=config,
            figures=figures,
            fingerprint=HardwareFingerprint.from_dict(body["fingerprint"]),
            script_sha256=body.get("script_sha256", ""),
            created_at=parse_datetime(body["created_at"]),
            saved_by=body.get("saved_by", ""),
        )

    @classmethod
    def from_json(cls, text: str) -> SavedConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"saved configuration JSON is malformed ({exc}); pass valid JSON."
            ) from None
        return cls.from_dict(data)


def config_from_dict(data: Any) -> BalanceConfig:
    """:meth:`BalanceConfig.from_dict`, with missing fields reported as a :class:`ConfigError`."""
    try:
        return BalanceConfig.from_dict(data)
    except TypeError as exc:
        raise ConfigError(
            f"configuration is incomplete ({exc}); give every required field of BalanceConfig."
        ) from None


def figures_to_json(figures: Any) -> str:
    """``figures`` as canonical JSON; non-finite numbers become null (JSON has no NaN)."""
    if not isinstance(figures, dict) or not all(isinstance(k, str) for k in figures):
        raise ConfigError(
            f"figures={figures!r} is not a mapping with string keys; pass a JSON object."
        )
    try:
        return json.dumps(_finite(figures), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"figures are not JSON-serializable ({exc}); pass numbers, strings, lists and dicts."
        ) from None


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def as_utc(value: datetime) -> datetime:
    """``value`` as an aware UTC datetime (naive values, as SQLite returns them, are UTC)."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def parse_datetime(value: Any) -> datetime:
    if isinstance(value, datetime):
        return as_utc(value)
    if isinstance(value, str):
        try:
            return as_utc(datetime.fromisoformat(value.replace("Z", "+00:00")))
        except ValueError:
            pass
    raise ConfigError(
        f"created_at={value!r} is not an ISO 8601 time; use e.g. '2025-01-31T12:00:00+00:00'."
    )
