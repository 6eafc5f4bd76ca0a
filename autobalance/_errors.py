"""One exception base for everything autobalance raises on purpose."""

from __future__ import annotations

__all__ = [
    "AutobalanceError",
    "ConfigError",
    "HardwareMismatchError",
    "LaunchError",
    "SchemaVersionError",
    "StorageError",
    "StudyNotFoundError",
    "TrialScriptError",
    "UsageError",
    "VerificationError",
]


class AutobalanceError(Exception):
    """Base class of every error autobalance raises deliberately."""


class UsageError(AutobalanceError):
    """Bad input on the command line or to an API call (exit code 2)."""


class ConfigError(UsageError):
    """A balance configuration that does not validate."""


class StorageError(AutobalanceError):
    """The storage URL is wrong, unreachable or read-only."""


class StudyNotFoundError(StorageError):
    """No study (or no saved configuration) with that name in the storage."""


class SchemaVersionError(StorageError):
    """The database was written by an older or newer autobalance."""


class HardwareMismatchError(AutobalanceError):
    """A stored configuration was tuned on different hardware than this job runs on."""


class LaunchError(AutobalanceError):
    """torchrun could not be started or its trial could not be collected."""


class TrialScriptError(AutobalanceError):
    """The user's training script raised an error that is not an out-of-memory error."""

    def __init__(self, message: str, *, traceback_text: str = "", rank: int | None = None) -> None:
        super().__init__(message)
        self.traceback_text = traceback_text
        self.rank = rank


class VerificationError(AutobalanceError):
    """A configuration did not compute the baseline's update (``autobalance verify``): never saved."""
