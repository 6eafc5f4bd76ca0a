"""One exception base for everything autobalance raises on purpose."""

from __future__ import annotations

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "AutobalanceError",
    "ConfigError",
    "HardwareMismatchError",
    "LaunchError",
    "SchemaVersionError",
    "StorageError",
    "StorageURLError",
    "StudyNotFoundError",
    "TrialScriptError",
    "UsageError",
    "VerificationError",
    "exit_code",
]

EXIT_FAILURE = 1
"""The run went wrong: a trial script error, a storage that cannot be reached or written, a failed
verification, a launch failure."""
EXIT_USAGE = 2
"""The command was wrong: a bad flag value, an unknown study, a malformed storage URL (as click's own
usage errors: an unknown option, a missing argument)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C or SIGTERM (128 + SIGINT, as a shell reports it)."""


class AutobalanceError(Exception):
    """Base class of every error autobalance raises deliberately."""


class UsageError(AutobalanceError):
    """Bad input on the command line or to an API call (exit code 2)."""


class ConfigError(UsageError):
    """A balance configuration that does not validate."""


class StorageError(AutobalanceError):
    """The storage URL is wrong, unreachable or read-only."""


class StorageURLError(StorageError):
    """The storage URL itself is wrong: not a URL, an unknown scheme or driver, a SQLite file in a
    directory that does not exist (a usage error: exit code 2)."""


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


_USAGE_ERRORS: tuple[type[BaseException], ...] = (UsageError, StudyNotFoundError, StorageURLError)


def exit_code(exc: BaseException) -> int:
    """The exit code of a command that ended with ``exc``: the one mapping from classes of error to
    codes (README, "Exit codes"): usage 2, run failure 1, interrupted 130."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, _USAGE_ERRORS):
        return EXIT_USAGE
    return EXIT_FAILURE
