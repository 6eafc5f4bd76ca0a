"""Storage URLs: masking, normalization, engines, check_storage."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from autobalance import BalanceConfig, SchemaVersionError, StorageError
from autobalance.store import (
    ConfigStore,
    check_storage,
    engine_kwargs,
    make_engine,
    mask_url,
    normalize_storage_url,
)

UNREACHABLE = "postgresql+psycopg://u:secret@127.0.0.1:1/x"


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        (
            "postgresql+psycopg://u:secret@127.0.0.1:5432/db",
            "postgresql+psycopg://u:***@127.0.0.1:5432/db",
        ),
        ("postgresql://u:p@ss@host/db", "postgresql://u:***@host/db"),
        ("mysql+pymysql://root:pw@h/db?charset=utf8", "mysql+pymysql://root:***@h/db?charset=utf8"),
        (
            "postgresql://host/db?user=u&password=secret&x=1",
            "postgresql://host/db?user=u&password=***&x=1",
        ),
        ("postgresql://u@host/db", "postgresql://u@host/db"),
        ("sqlite:///autobalance.db", "sqlite:///autobalance.db"),
        ("sqlite:////tmp/a@b:c.db", "sqlite:////tmp/a@b:c.db"),
        ("not a url at all", "not a url at all"),
        ("", ""),
        ("://:@", "://:@"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_mask_url_never_leaks_password_of_garbage() -> None:
    for url in ["weird://us:er:pa:ss@h", "x+y://a:b/c@d/e", "pg://u:s3cr3t@[::1]:5432/db"]:
        out = mask_url(url)
        assert "***" in out
        assert "pa:ss" not in out and "s3cr3t" not in out


def test_normalize_storage_url() -> None:
    assert normalize_storage_url("sqlite:///autobalance.db") == "sqlite:///autobalance.db"
    assert normalize_storage_url("  runs/x.db ") == "sqlite:///runs/x.db"
    assert normalize_storage_url("postgres://u@h/d") == "postgresql+psycopg://u@h/d"
    assert normalize_storage_url("postgresql://u@h/d") == "postgresql+psycopg://u@h/d"
    assert normalize_storage_url(UNREACHABLE) == UNREACHABLE


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("", "empty"),
        ("autobalance", "not a SQLAlchemy URL"),
        ("nosuchdb://x/y", "unknown database or driver 'nosuchdb'"),
        ("postgresql+nosuchdriver://u:pw@h/d", "unknown database or driver"),
        ("mysql+mysqldb://root:pw@h/db", "pip install mysqlclient"),
        ("sqlite:/autobalance.db", "'sqlite:/autobalance.db' is malformed: a storage URL is SCHEME://..., e.g. "
                                   "sqlite:///autobalance.db (three slashes"),
        ("sqlite:autobalance.db", "is malformed: a storage URL is SCHEME://"),
        ("postgresql:/u:pw@h/d", "'postgresql:/u:***@h/d' is malformed"),
        ("sqlite://autobalance.db", "is malformed: a SQLite URL has three slashes before the file, "
                                    "sqlite:///autobalance.db (four for an absolute path"),
    ],
)
def test_normalize_storage_url_errors(url: str, expected: str) -> None:
    with pytest.raises(StorageError) as info:
        normalize_storage_url(url)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message
    assert "pw@" not in message


def test_missing_postgres_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def fake_import(name: str, *args: object, **kwargs: object) -> object:
        if name == "psycopg" or name.startswith("psycopg."):
            raise ImportError("No module named 'psycopg'", name="psycopg")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(StorageError, match=r"pip install 'psycopg\[binary\]'") as info:
        normalize_storage_url("postgresql+psycopg://u:secret@h/d")
    assert "secret" not in str(info.value)


def test_engine_kwargs() -> None:
    assert engine_kwargs("sqlite:///a.db") == {"connect_args": {"timeout": 30.0}}
    pg = engine_kwargs("postgresql+psycopg://u@h/d")
    assert pg["pool_pre_ping"] is True
    assert pg["connect_args"]["connect_timeout"] > 0


def test_sqlite_engine_uses_wal_and_busy_timeout(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'a.db'}")
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
    finally:
        engine.dispose()
    raw = sqlite3.connect(tmp_path / "a.db")
    assert (
        raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    )  # persistent: Optuna gets it too
    raw.close()


def test_check_storage_ok_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    assert check_storage(f"sqlite:///{path}") == f"sqlite:///{path}"
    raw = sqlite3.connect(path)
    tables = [r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    raw.close()
    assert tables == []


def test_check_storage_read_only(tmp_path: Path) -> None:
    path = tmp_path / "ro.db"
    sqlite3.connect(path).close()
    with pytest.raises(StorageError, match=r"readonly|read-only") as info:
        check_storage(f"sqlite:///file:{path}?mode=ro&uri=true")
    assert "\n" not in str(info.value)


def test_check_storage_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="does not exist"):
        check_storage(f"sqlite:///{tmp_path / 'nope' / 'a.db'}")


def test_check_storage_newer_schema(
    tmp_path: Path, save_kwargs: Callable[..., dict[str, Any]]
) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    with ConfigStore(url=url) as store:
        store.save(**save_kwargs())
    raw = sqlite3.connect(tmp_path / "a.db")
    raw.execute("UPDATE autobalance_schema SET version = 99")
    raw.commit()
    raw.close()
    with pytest.raises(SchemaVersionError, match="upgrade autobalance"):
        check_storage(url)


def test_unreachable_postgres_masks_password() -> None:
    with pytest.raises(StorageError) as info:
        check_storage(UNREACHABLE)
    message = str(info.value)
    assert "secret" not in message
    assert "u:***@127.0.0.1:1/x" in message
    assert "\n" not in message


def test_unreachable_postgres_masks_password_in_store_errors() -> None:
    store = ConfigStore(url=UNREACHABLE)
    assert "secret" not in repr(store)
    config = BalanceConfig.uniform(world_size=1, micro_batch=1)
    from conftest import make_fingerprint

    for call in (
        lambda: store.load("x"),
        lambda: store.list_saved(),
        lambda: store.save(
            study_name="x",
            trial_number=0,
            config=config,
            figures={},
            fingerprint=make_fingerprint(world_size=1),
        ),
    ):
        with pytest.raises(StorageError) as info:
            call()
        assert "secret" not in str(info.value)
        assert "u:***@" in str(info.value)


def test_import_does_not_import_torch() -> None:
    code = (
        "import sys, autobalance.store as s; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'optuna' not in sys.modules, 'optuna imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("command", [["trials"], ["studies"], ["best"], ["report"], ["export", "-o", "x.json"],
                                     ["tune", "examples/mlp/train.py", "--device", "cpu"]])
def test_a_malformed_storage_url_is_one_line_naming_the_form(command: list[str], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``sqlite:/autobalance.db`` (a slash missing) was read as a file path (``directory .../sqlite:
    does not exist``); every command says the URL is malformed and shows the form, and writes nothing."""
    from typer.testing import CliRunner

    from autobalance.cli import app

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    if command[0] == "tune":
        command = ["tune", str(repo / command[1]), *command[2:], "--runs-dir", str(tmp_path / "runs")]
    result = CliRunner().invoke(app, [*command, "--storage", "sqlite:/autobalance.db"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "'sqlite:/autobalance.db' is malformed" in lines[0], lines
    assert "sqlite:///autobalance.db" in lines[0]
    assert list(tmp_path.iterdir()) == []
