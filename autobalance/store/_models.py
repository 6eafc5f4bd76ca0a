"""SQLAlchemy models of the store: ``autobalance_*`` tables beside (never inside) Optuna's."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    Boolean,
    Connection,
    DateTime,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    insert,
    inspect,
    select,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from autobalance._errors import SchemaVersionError

__all__ = [
    "SCHEMA_TABLE",
    "SCHEMA_VERSION",
    "TABLE_PREFIX",
    "Base",
    "SavedConfigRow",
    "SchemaRow",
    "ensure_schema",
    "read_schema_version",
    "verify_schema_version",
]

SCHEMA_VERSION = 1
"""Version of the ``autobalance_*`` tables this code reads and writes."""

TABLE_PREFIX = "autobalance_"
"""Every table of the store starts with this; Optuna's tables are never touched."""

SCHEMA_TABLE = "autobalance_schema"
SAVED_CONFIG_TABLE = "autobalance_saved_config"


def _utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    """Declarative base with its own ``MetaData``, so ``create_all`` creates only our tables."""

    metadata = MetaData()


class SchemaRow(Base):
    """The single row that records the schema version of the store."""

    __tablename__ = SCHEMA_TABLE

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    """Always 1: there is one row."""
    version: Mapped[int] = mapped_column(Integer, nullable=False)
    """:data:`SCHEMA_VERSION` of the code that created the tables."""


class SavedConfigRow(Base):
    """One saved best configuration of a study; the newest save is the current one."""

    __tablename__ = SAVED_CONFIG_TABLE
    __table_args__ = (
        UniqueConstraint(
            "study_name", "trial_number", "config_sha256", name="uq_autobalance_saved_config_trial"
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    """Row id (immutable: every rank of a production job can read the same row by id)."""
    study_name: Mapped[str] = mapped_column(String(512), index=True, nullable=False)
    """Optuna study the configuration was tuned in."""
    trial_number: Mapped[int] = mapped_column(Integer, nullable=False)
    """Optuna trial number the configuration comes from."""
    config_json: Mapped[str] = mapped_column(Text, nullable=False)
    """The validated :class:`~autobalance.BalanceConfig` as canonical JSON (sorted keys)."""
    config_sha256: Mapped[str] = mapped_column(String(64), nullable=False)
    """SHA-256 of ``config_json``: the idempotency key together with study and trial."""
    figures_json: Mapped[str] = mapped_column(Text, nullable=False)
    """Measured figures (per-rank peaks, spread, step time, baseline figures) as a JSON object."""
    fingerprint_json: Mapped[str] = mapped_column(Text, nullable=False)
    """:class:`~autobalance.store.HardwareFingerprint` of the tuning job as JSON."""
    script_sha256: Mapped[str] = mapped_column(String(64), nullable=False, default="")
    """SHA-256 of the training script at tuning time ("" when unknown)."""
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, default=_utcnow
    )
    """When it was saved (UTC)."""
    saved_by: Mapped[str] = mapped_column(String(512), nullable=False, default="")
    """Who and what saved it, e.g. ``alice@node1 (tune)``."""
    is_current: Mapped[bool] = mapped_column(Boolean, nullable=False, default=True)
    """True for exactly one row per study: the configuration production jobs load."""


Index(
    "uq_autobalance_saved_config_current",
    SavedConfigRow.study_name,
    unique=True,
    postgresql_where=SavedConfigRow.is_current.is_(true()),
    sqlite_where=SavedConfigRow.is_current.is_(true()),
)


def read_schema_version(conn: Connection) -> int | None:
    """The schema version of the store at ``conn``: None when there is no store yet.

    A saved-config table without a version table counts as version 0 (older than any release).
    """
    inspector = inspect(conn)
    if not inspector.has_table(SCHEMA_TABLE):
        return 0 if inspector.has_table(SAVED_CONFIG_TABLE) else None
    version = conn.execute(select(SchemaRow.version).where(SchemaRow.id == 1)).scalar_one_or_none()
    if version is None:
        return 0 if inspector.has_table(SAVED_CONFIG_TABLE) else None
    return int(version)


def verify_schema_version(version: int | None, masked_url: str) -> None:
    """Raise :class:`SchemaVersionError` with the fix when ``version`` is not :data:`SCHEMA_VERSION`."""
    if version is None or version == SCHEMA_VERSION:
        return
    if version < SCHEMA_VERSION:
        raise SchemaVersionError(
            f"Store schema version {version} in {masked_url} is older than this autobalance's "
            f"({SCHEMA_VERSION}); save again with `autobalance promote --storage NEW_URL ...` into a new "
            f"database, or delete the {TABLE_PREFIX}* tables there (Optuna's tables are not affected)."
        )
    raise SchemaVersionError(
        f"Store schema version {version} in {masked_url} is newer than this autobalance's "
        f"({SCHEMA_VERSION}); upgrade autobalance (`pip install -U autobalance`)."
    )


def ensure_schema(conn: Connection, masked_url: str) -> None:
    """Create the store's tables if missing and record the version; verify it otherwise.

    Call inside a write transaction (serialized across processes by the caller).
    """
    version = read_schema_version(conn)
    verify_schema_version(version, masked_url)
    if version is not None:
        return
    Base.metadata.create_all(conn, checkfirst=True)
    conn.execute(insert(SchemaRow).values(id=1, version=SCHEMA_VERSION))
