"""The configuration store: saved best configurations per study, in the study's database."""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import random
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from sqlalchemy import Connection, func, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

from autobalance._config import BalanceConfig
from autobalance._errors import AutobalanceError, ConfigError, StorageError, StudyNotFoundError
from autobalance.store._fingerprint import HardwareFingerprint
from autobalance.store._models import (
    SavedConfigRow,
    ensure_schema,
    read_schema_version,
    verify_schema_version,
)
from autobalance.store._saved import SavedConfig, as_utc, config_from_dict, figures_to_json
from autobalance.store._url import (
    describe_db_error,
    make_engine,
    mask_url,
    normalize_storage_url,
    sqlite_path,
)

__all__ = ["ConfigStore", "make_saved_by"]

_SAVE_ATTEMPTS = 8
_MAX_LISTED = 20


def make_saved_by(action: str) -> str:
    """``user@host (action)``: the ``saved_by`` of a save done by ``action`` (``tune``, ``promote``)."""
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    return f"{user}@{socket.gethostname()} ({action})"


def _lock_key(name: str) -> int:
    """A stable signed 64-bit key for PostgreSQL advisory locks."""
    digest = hashlib.sha256(f"autobalance:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _retryable(exc: SQLAlchemyError) -> bool:
    if isinstance(exc, IntegrityError):
        return True
    if isinstance(exc, OperationalError):
        message = str(exc).lower()
        return any(
            s in message
            for s in ("locked", "busy", "deadlock", "serializ", "could not obtain lock")
        )
    return False


class ConfigStore:
    """Saved best configurations of studies, in ``autobalance_*`` tables of any SQLAlchemy database.

    Every access runs in :meth:`session_scope` (commit on success, rollback on error). Saves are
    idempotent and safe when several processes save at once (SQLite: ``BEGIN IMMEDIATE`` with a
    busy timeout; PostgreSQL: a per-study advisory lock; both: unique indexes and retries).
    Reads never create tables or files.
    """

    def __init__(self, *, url: str) -> None:
        self.url = normalize_storage_url(url)
        """Normalized SQLAlchemy URL (may hold a password: show :attr:`masked_url` instead)."""
        self.masked_url = mask_url(self.url)
        """The URL with its password replaced by ``***``: the only form fit for output."""
        self._engine = make_engine(self.url)
        self._dialect = self._engine.dialect.name
        self._sqlite_file = sqlite_path(make_url(self.url))
        self._schema_ready = False

    def __repr__(self) -> str:
        return f"ConfigStore(url={self.masked_url!r})"

    def __enter__(self) -> ConfigStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Release the connections of this store."""
        self._engine.dispose()

    # -- sessions -----------------------------------------------------------------------------

    @contextmanager
    def _raw_session(self, *, write: bool) -> Iterator[Session]:
        with self._engine.connect() as conn:
            if write:
                conn = conn.execution_options(autobalance_write=True)
            with Session(bind=conn, expire_on_commit=False) as session:
                try:
                    yield session
                    session.commit()
                except BaseException:
                    session.rollback()
                    raise

    @contextmanager
    def session_scope(self, *, write: bool = False) -> Iterator[Session]:
        """A session in one transaction: committed when the block succeeds, rolled back otherwise.

        ``write=True`` takes SQLite's write lock up front (``BEGIN IMMEDIATE``). Database errors
        become a one-line :class:`StorageError` with the URL masked.
        """
        try:
            with self._raw_session(write=write) as session:
                yield session
        except AutobalanceError:
            raise
        except SQLAlchemyError as exc:
            raise self._storage_error(exc) from None

    def _storage_error(self, exc: SQLAlchemyError) -> StorageError:
        detail = describe_db_error(exc, self.url)
        lower = detail.lower()
        if "readonly" in lower or "read-only" in lower or "permission denied" in lower:
            fix = "use a storage this user can write to"
        elif "locked" in lower:
            fix = "another process holds the database too long; use PostgreSQL for many concurrent workers"
        else:
            fix = "check that the database is reachable and the URL is right"
        return StorageError(f"Storage {self.masked_url} failed: {detail}; {fix}.")

    def _lock(self, conn: Connection, name: str) -> None:
        if self._dialect == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _lock_key(name)})

    def _ensure_schema(self) -> None:
        if self._schema_ready:
            return
        for attempt in range(_SAVE_ATTEMPTS):
            try:
                with self._raw_session(write=True) as session:
                    conn = session.connection()
                    self._lock(conn, "schema")
                    ensure_schema(conn, self.masked_url)
                break
            except SQLAlchemyError as exc:
                if attempt + 1 == _SAVE_ATTEMPTS or not (
                    _retryable(exc) or "exists" in str(exc).lower()
                ):
                    raise self._storage_error(exc) from None
                _backoff(attempt)
        self._schema_ready = True

    def _store_exists(self) -> bool:
        """Verify the schema of an existing store; False when there is none (nothing is created)."""
        if self._schema_ready:
            return True
        if self._sqlite_file is not None and not os.path.exists(self._sqlite_file):
            return False
        with self.session_scope() as session:
            version = read_schema_version(session.connection())
        verify_schema_version(version, self.masked_url)
        if version is None:
            return False
        self._schema_ready = True
        return True

    # -- writing ------------------------------------------------------------------------------

    def save(
        self,
        *,
        study_name: str,
        trial_number: int,
        config: BalanceConfig,
        figures: dict[str, Any],
        fingerprint: HardwareFingerprint,
        script_sha256: str = "",
        saved_by: str = "",
    ) -> SavedConfig:
        """Save ``config`` as the current configuration of ``study_name``; returns what is stored.

        Idempotent: saving the same study, trial and configuration again adds no row (if that
        row is in the history it becomes current again, with the new figures and time). Older
        rows stay as history with ``is_current`` False.
        """
        saved = SavedConfig(
            study_name=study_name,
            trial_number=trial_number,
            config=config,
            figures=figures,
            fingerprint=fingerprint,
            script_sha256=script_sha256,
            created_at=datetime.now(UTC),
            saved_by=saved_by,
        )
        config_json = config.to_json()
        values = {
            "figures_json": figures_to_json(figures),
            "fingerprint_json": json.dumps(fingerprint.to_dict(), sort_keys=True),
            "script_sha256": script_sha256,
            "saved_by": saved_by,
        }
        config_sha = hashlib.sha256(config_json.encode()).hexdigest()
        self._ensure_schema()
        for attempt in range(_SAVE_ATTEMPTS):
            try:
                with self._raw_session(write=True) as session:
                    self._lock(session.connection(), f"study:{study_name}")
                    row = session.execute(
                        select(SavedConfigRow).where(
                            SavedConfigRow.study_name == study_name,
                            SavedConfigRow.trial_number == trial_number,
                            SavedConfigRow.config_sha256 == config_sha,
                        )
                    ).scalar_one_or_none()
                    if row is not None and row.is_current:
                        return self._to_saved(row)
                    session.execute(
                        update(SavedConfigRow)
                        .where(
                            SavedConfigRow.study_name == study_name,
                            SavedConfigRow.is_current.is_(True),
                        )
                        .values(is_current=False)
                        .execution_options(synchronize_session=False)
                    )
                    session.flush()
                    if row is None:
                        row = SavedConfigRow(
                            study_name=study_name,
                            trial_number=trial_number,
                            config_json=config_json,
                            config_sha256=config_sha,
                            created_at=saved.created_at,
                            is_current=True,
                            **values,
                        )
                        session.add(row)
                    else:
                        for key, value in values.items():
                            setattr(row, key, value)
                        row.created_at = saved.created_at
                        row.is_current = True
                    session.flush()
                    return self._to_saved(row)
            except AutobalanceError:
                raise
            except SQLAlchemyError as exc:
                if attempt + 1 == _SAVE_ATTEMPTS or not _retryable(exc):
                    raise self._storage_error(exc) from None
                _backoff(attempt)
        raise AssertionError("unreachable")

    # -- reading ------------------------------------------------------------------------------

    def list_saved(self) -> list[str]:
        """Names of the studies that have a saved configuration, sorted."""
        if not self._store_exists():
            return []
        with self.session_scope() as session:
            names = session.execute(
                select(SavedConfigRow.study_name).distinct().order_by(SavedConfigRow.study_name)
            ).scalars()
            return list(names)

    def load(self, study_name: str) -> SavedConfig:
        """The current saved configuration of ``study_name`` (:class:`StudyNotFoundError` if none)."""
        if self._store_exists():
            with self.session_scope() as session:
                row = session.execute(
                    select(SavedConfigRow)
                    .where(
                        SavedConfigRow.study_name == study_name, SavedConfigRow.is_current.is_(True)
                    )
                    .order_by(SavedConfigRow.id.desc())
                    .limit(1)
                ).scalar_one_or_none()
                if row is not None:
                    return self._to_saved(row)
        raise self._not_found(study_name)

    def history(self, study_name: str) -> list[SavedConfig]:
        """Every saved configuration of ``study_name``, newest first (the current one is first)."""
        if self._store_exists():
            with self.session_scope() as session:
                rows = session.execute(
                    select(SavedConfigRow)
                    .where(SavedConfigRow.study_name == study_name)
                    .order_by(
                        SavedConfigRow.is_current.desc(),
                        SavedConfigRow.created_at.desc(),
                        SavedConfigRow.id.desc(),
                    )
                ).scalars()
                saved = [self._to_saved(row) for row in rows]
            if saved:
                return saved
        raise self._not_found(study_name)

    def count(self, study_name: str) -> int:
        """Number of saved rows (current and history) of ``study_name``."""
        if not self._store_exists():
            return 0
        with self.session_scope() as session:
            n = session.execute(
                select(func.count())
                .select_from(SavedConfigRow)
                .where(SavedConfigRow.study_name == study_name)
            ).scalar_one()
            return int(n)

    def _not_found(self, study_name: str) -> StudyNotFoundError:
        if self._sqlite_file is not None and not os.path.exists(self._sqlite_file):
            return StudyNotFoundError(
                f"Study {study_name!r} has no saved configuration: {self.masked_url} does not exist "
                f"({self._sqlite_file}); pass the storage the study was tuned in (--storage / "
                "AUTOBALANCE_STORAGE) or an exported file (AUTOBALANCE_CONFIG_FILE)."
            )
        names = self.list_saved()
        if not names:
            return StudyNotFoundError(
                f"Study {study_name!r} has no saved configuration in {self.masked_url}, which has none; "
                f"run `autobalance tune` or `autobalance promote --study-name {study_name} --trial N` first."
            )
        shown = ", ".join(repr(n) for n in names[:_MAX_LISTED])
        if len(names) > _MAX_LISTED:
            shown += f" and {len(names) - _MAX_LISTED} more"
        return StudyNotFoundError(
            f"Study {study_name!r} has no saved configuration in {self.masked_url}; "
            f"studies with one: {shown}."
        )

    def _to_saved(self, row: SavedConfigRow) -> SavedConfig:
        try:
            return SavedConfig(
                study_name=row.study_name,
                trial_number=row.trial_number,
                config=config_from_dict(json.loads(row.config_json)),
                figures=json.loads(row.figures_json),
                fingerprint=HardwareFingerprint.from_dict(json.loads(row.fingerprint_json)),
                script_sha256=row.script_sha256 or "",
                created_at=as_utc(row.created_at),
                saved_by=row.saved_by or "",
            )
        except (ConfigError, ValueError) as exc:
            raise StorageError(
                f"Saved configuration id {row.id} of study {row.study_name!r} in {self.masked_url} is "
                f"corrupt ({exc}); save it again with `autobalance promote`."
            ) from None


def _backoff(attempt: int) -> None:
    time.sleep(min(2.0, 0.02 * 2**attempt) * (0.5 + random.random()))
