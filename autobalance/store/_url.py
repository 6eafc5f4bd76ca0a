"""Storage URLs: masking credentials, validating drivers, engines that survive concurrency."""

from __future__ import annotations

import importlib.util
import os
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from autobalance._errors import StorageError, StorageURLError

if TYPE_CHECKING:
    from sqlalchemy.engine import URL, Engine

__all__ = [
    "DEFAULT_STORAGE",
    "check_storage",
    "engine_kwargs",
    "make_engine",
    "mask_url",
    "normalize_storage_url",
]

DEFAULT_STORAGE = "sqlite:///autobalance.db"
"""Storage used when neither ``--storage`` nor ``AUTOBALANCE_STORAGE`` names one."""

SQLITE_BUSY_TIMEOUT_S = 30.0
"""How long a SQLite connection waits for another process's write lock before failing."""

PG_CONNECT_TIMEOUT_S = 10
"""How long a PostgreSQL connection attempt may take before the server counts as unreachable."""

_MASK = "***"
_USERINFO = re.compile(
    r"^(?P<head>[A-Za-z][\w+.\-]*://[^:/@?#]*):(?P<password>.*)@(?P<tail>[^@]*)$", re.S
)
_SECRET_PARAMS = re.compile(
    r"(?P<key>(?:^|[?&;\s])(?:password|passwd|pwd|sslpassword|secret|token|access_token)=)(?P<value>[^&;\s]*)",
    re.I,
)
_DRIVER_PACKAGES = {
    "psycopg": "'psycopg[binary]'",
    "psycopg2": "psycopg2-binary (or use postgresql+psycopg:// with 'psycopg[binary]')",
    "pg8000": "pg8000",
    "asyncpg": "asyncpg",
    "pymysql": "pymysql",
    "mysqldb": "mysqlclient",
    "mariadb": "mariadb",
    "oracledb": "oracledb",
    "pyodbc": "pyodbc",
}


_SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][\w+.\-]+):(?!\\)")
"""A URL scheme of two letters or more (a Windows drive letter, ``C:\\``, is a path)."""
_FORM = ("a storage URL is SCHEME://..., e.g. sqlite:///autobalance.db (three slashes, then a path relative "
         "to this directory; sqlite:////abs/path.db for an absolute one) or postgresql+psycopg://user@host:5432/db")


_LOOSE_USERINFO = re.compile(r"^(?P<head>[^@]*?:/*[^:@/]*):(?P<password>[^@]*)@(?P<tail>.*)$", re.S)


def _mask_malformed(url: str) -> str:
    """``url`` (a URL missing its ``//``) with a password between ``user:`` and ``@`` masked."""
    match = _LOOSE_USERINFO.match(url)
    text = f"{match['head']}:{_MASK}@{match['tail']}" if match is not None else url
    return mask_url(text)


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***``; safe for any string, URL or not."""
    text = str(url)
    match = _USERINFO.match(text)
    if match is not None:
        text = f"{match['head']}:{_MASK}@{match['tail']}"
    return _SECRET_PARAMS.sub(lambda m: f"{m['key']}{_MASK}", text)


def scrub(text: str, url: str) -> str:
    """``text`` (e.g. a driver's error message) with every form of ``url``'s password masked."""
    text = text.replace(url, mask_url(url))
    for secret in _secrets(url):
        if len(secret) >= 3:
            text = text.replace(secret, _MASK)
    return text


def _secrets(url: str) -> set[str]:
    found: set[str] = set()
    match = _USERINFO.match(url)
    if match is not None and match["password"]:
        found |= {
            match["password"],
            unquote(match["password"]),
            quote(unquote(match["password"]), safe=""),
        }
    for m in _SECRET_PARAMS.finditer(url):
        if m["value"]:
            found |= {m["value"], unquote(m["value"])}
    return found


def normalize_storage_url(url: str) -> str:
    """The canonical SQLAlchemy URL for ``url``, or a one-line :class:`StorageError`.

    A bare ``*.db``/``*.sqlite`` path becomes a SQLite URL, ``postgres://`` becomes
    ``postgresql://`` and a PostgreSQL URL without a driver gets the installed one (psycopg).
    The database driver must be importable.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    raw = (url or "").strip()
    example = "use e.g. sqlite:///autobalance.db or postgresql+psycopg://user@host:5432/db"
    if not raw:
        raise StorageURLError(f"Storage URL is empty; {example}.")
    scheme = _SCHEME.match(raw)
    if "://" not in raw and scheme is not None:  # sqlite:/autobalance.db, sqlite:autobalance.db, postgresql:/...
        raise StorageURLError(f"Storage URL {_mask_malformed(raw)!r} is malformed: {_FORM}.")
    if raw.lower().startswith("sqlite://") and raw.lower() != "sqlite://" and not raw.lower().startswith("sqlite:///"):
        raise StorageURLError(  # sqlite://x.db: SQLAlchemy reads x.db as a host and opens an in-memory database
            f"Storage URL {mask_url(raw)!r} is malformed: a SQLite URL has three slashes before the file, "
            f"sqlite:///{raw[len('sqlite://'):]} (four for an absolute path: sqlite:////abs/path.db).")
    if "://" not in raw:
        if raw.lower().endswith((".db", ".sqlite", ".sqlite3")):
            raw = "sqlite:///" + raw
        else:
            raise StorageURLError(f"Storage URL {mask_url(raw)!r} is not a SQLAlchemy URL; {example}.")
    try:
        parsed = make_url(raw)
    except (ArgumentError, ValueError) as exc:
        raise StorageURLError(
            f"Storage URL {mask_url(raw)!r} cannot be parsed ({scrub(str(exc), raw)}); {example}."
        ) from None
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "postgres":
        backend = "postgresql"
    if backend == "postgresql" and not driver:
        has_psycopg2 = importlib.util.find_spec("psycopg2") is not None
        has_psycopg = importlib.util.find_spec("psycopg") is not None
        driver = "psycopg" if has_psycopg or not has_psycopg2 else "psycopg2"
    parsed = parsed.set(drivername=f"{backend}+{driver}" if driver else backend)
    masked = mask_url(parsed.render_as_string(hide_password=False))
    try:
        dialect_cls = parsed.get_dialect()
    except NoSuchModuleError:
        raise StorageURLError(
            f"Storage URL {masked!r} names an unknown database or driver {parsed.drivername!r}; {example}."
        ) from None
    try:
        dialect_cls.import_dbapi()
    except ImportError as exc:
        module = (getattr(exc, "name", None) or driver or backend).split(".")[0]
        package = _DRIVER_PACKAGES.get(module.lower(), module)
        raise StorageError(
            f"Storage URL {masked!r} needs the database driver {module!r}, which is not installed; "
            f"run `pip install {package}`."
        ) from None
    return parsed.render_as_string(hide_password=False)


def engine_kwargs(url: str) -> dict[str, Any]:
    """``create_engine`` keyword arguments for ``url`` (also fit for Optuna's ``RDBStorage(engine_kwargs=...)``).

    SQLite: a 30 s busy timeout. PostgreSQL: ``pool_pre_ping`` and a connect timeout.
    """
    backend, _, driver = url.split(":", 1)[0].lower().partition("+")
    if backend == "sqlite":
        return {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S}}
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if backend == "postgresql" and driver in ("", "psycopg", "psycopg2"):  # libpq drivers
        kwargs["connect_args"] = {"connect_timeout": PG_CONNECT_TIMEOUT_S}
    return kwargs


def make_engine(url: str) -> Engine:
    """An engine for ``url`` (normalized first) that does not fail when several processes write.

    SQLite connections get a busy timeout and WAL journal mode (so readers never block the
    writer), and SQLAlchemy emits ``BEGIN`` itself: ``BEGIN IMMEDIATE`` on connections with the
    execution option ``autobalance_write=True``, which takes the write lock up front instead of
    failing with "database is locked" when a read transaction later tries to write.
    """
    from sqlalchemy import create_engine

    normalized = normalize_storage_url(url)
    engine = create_engine(normalized, **engine_kwargs(normalized))
    if engine.dialect.name == "sqlite":
        _configure_sqlite(engine)
    return engine


def _configure_sqlite(engine: Engine) -> None:
    from sqlalchemy import event

    timeout_ms = int(SQLITE_BUSY_TIMEOUT_S * 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy emits BEGIN (see _on_begin)
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {timeout_ms}")
            try:
                cursor.execute("PRAGMA journal_mode = WAL")
            except Exception:
                pass  # a read-only database keeps its journal mode; reading still works
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get("autobalance_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def sqlite_path(url: URL) -> str | None:
    """The file of a SQLite URL, or None for in-memory/URI databases and other backends."""
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:") or url.query.get("uri"):
        return None
    return os.path.abspath(database)


def describe_db_error(exc: BaseException, url: str) -> str:
    """The first line of a database error, without SQLAlchemy's boilerplate or any password."""
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    if first.startswith("(") and ")" in first:
        first = first.split(")", 1)[1].strip() or first
    return scrub(first, url).rstrip(".")


def check_storage(url: str) -> str:
    """Connect to ``url`` once and prove it is writable; returns the normalized URL.

    Creates the schema-version table in a transaction that is rolled back, and checks the
    schema version of an existing store. Raises :class:`StorageError` (URL masked) when the
    storage is unreachable or read-only, :class:`SchemaVersionError` when it is too old or new.
    """
    from sqlalchemy import Column, Integer, MetaData, Table
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from autobalance.store._models import read_schema_version, verify_schema_version

    normalized = normalize_storage_url(url)
    masked = mask_url(normalized)
    path = sqlite_path(make_url(normalized))
    if path is not None and not os.path.isdir(os.path.dirname(path)):
        raise StorageURLError(
            f"Storage {masked} cannot be created: directory {os.path.dirname(path)} does not exist; "
            "create it or pass another --storage."
        )
    engine = make_engine(normalized)
    try:
        with engine.connect() as conn:
            conn = conn.execution_options(autobalance_write=True)
            with conn.begin() as transaction:
                verify_schema_version(read_schema_version(conn), masked)
                probe = Table(
                    f"autobalance_probe_{os.getpid()}",
                    MetaData(),
                    Column("id", Integer, primary_key=True),
                )
                probe.create(conn)
                transaction.rollback()
    except SQLAlchemyError as exc:
        detail = describe_db_error(exc, normalized)
        lower = detail.lower()
        if "readonly" in lower or "read-only" in lower or "permission denied" in lower:
            fix = "use a storage this user can write to"
        else:
            fix = (
                "check that the server is running and the URL (host, port, user, database) is right"
            )
        raise StorageError(f"Storage {masked} is not usable: {detail}; {fix}.") from None
    finally:
        engine.dispose()
    return normalized
