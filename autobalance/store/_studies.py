"""The Optuna storage of the studies: opening it (busy timeouts for SQLite, heartbeats, clear
errors), listing and loading studies. Optuna is imported when a storage is opened."""

from __future__ import annotations

import os
import time
import warnings
from typing import TYPE_CHECKING, Any

from autobalance._errors import StorageError, StudyNotFoundError, UsageError
from autobalance.store._url import mask_url, scrub

if TYPE_CHECKING:
    import optuna

__all__ = ["HEARTBEAT_ENV", "HEARTBEAT_INTERVAL_S", "heartbeat_interval_s", "list_studies", "load_study",
           "open_storage"]

HEARTBEAT_INTERVAL_S = 10
"""A RUNNING trial whose heartbeat is older than 3 intervals is failed on the next start."""
HEARTBEAT_ENV = "AUTOBALANCE_HEARTBEAT_S"
"""Overrides the heartbeat interval in whole seconds (tests use 1 so a killed tuner's trial goes stale fast)."""


def heartbeat_interval_s() -> int:
    """The heartbeat interval: ``AUTOBALANCE_HEARTBEAT_S`` or :data:`HEARTBEAT_INTERVAL_S`."""
    raw = os.environ.get(HEARTBEAT_ENV, "").strip()
    if not raw:
        return HEARTBEAT_INTERVAL_S
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"{HEARTBEAT_ENV}={raw!r} is not a whole number of seconds >= 1; unset it or use e.g. 10.")
    return value


def open_storage(url: str, *, heartbeat: bool = True) -> optuna.storages.RDBStorage:
    """An RDB storage for ``url``; raises StorageError (password masked) when it cannot be used."""
    import optuna

    if "://" not in url:
        raise StorageError(
            f"--storage={url!r} is not a database URL; use e.g. sqlite:///autobalance.db or "
            "postgresql+psycopg://user@host/db."
        )
    interval = heartbeat_interval_s()
    engine_kwargs: dict[str, Any] = (
        {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    )
    try:
        for attempt in range(4):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return optuna.storages.RDBStorage(
                        url,
                        engine_kwargs=engine_kwargs,
                        heartbeat_interval=interval if heartbeat else None,
                        grace_period=3 * interval if heartbeat else None,
                    )
            except Exception as exc:
                # several workers creating Optuna's tables (and its alembic version row) in a new
                # database at once: one wins, the others see "already exists", "duplicate key" or
                # "UNIQUE constraint failed" and find everything in place on the next try
                text = str(exc).lower()
                racing = ("already exists", "duplicate key", "unique constraint")
                if attempt == 3 or not any(word in text for word in racing):
                    raise
                time.sleep(0.5 + attempt)
        raise AssertionError("unreachable")
    except ModuleNotFoundError as exc:
        raise StorageError(
            f"--storage={mask_url(url)} needs the Python driver {exc.name!r}; install it "
            "(PostgreSQL: pip install 'psycopg[binary]', or pip install -e '.[postgres]' in the autobalance clone)."
        ) from None
    except Exception as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        detail = scrub(detail, url)
        raise StorageError(
            f"--storage={mask_url(url)} cannot be used ({type(exc).__name__}: {detail[:200]}); "
            "check the URL, that the server is up and that it is writable."
        ) from None


def list_studies(storage: optuna.storages.BaseStorage) -> list[str]:
    return sorted(s.study_name for s in storage.get_all_studies())


def load_study(*, study_name: str, storage_url: str) -> optuna.Study:
    import optuna

    storage = open_storage(storage_url, heartbeat=False)
    try:
        return optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        names = list_studies(storage)
        listing = ", ".join(names) if names else "none"
        raise StudyNotFoundError(
            f"Study {study_name!r} not found in {mask_url(storage_url)} (available: {listing}). "
            "List studies with `autobalance studies`."
        ) from None
