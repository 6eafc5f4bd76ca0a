"""ConfigStore on SQLite: round-trip, upsert, history, errors, schema version, concurrency."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    FIGURES,
    full_compiled_config,
    full_config,
    full_sharded_config,
    make_fingerprint,
)
from store_workers import SAVES_PER_WORKER, run_concurrent_saves

from autobalance import BalanceConfig, SchemaVersionError, StorageError, StudyNotFoundError
from autobalance.store import ConfigStore, SavedConfig

SaveKwargs = Callable[..., dict[str, Any]]


def _db(url: str) -> str:
    return url.removeprefix("sqlite:///")


def test_full_config_sets_every_field() -> None:
    """Between them (checkpointing and compile exclude each other, parameter sharding fp16 and ZeRO-1),
    every field differs from its default."""
    configs = (full_config(), full_compiled_config(), full_sharded_config())
    for f in dataclasses.fields(BalanceConfig):
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )
        if f.name == "checkpoint":
            default = [[] for _ in configs[0].micro_batches]
        assert any(getattr(c, f.name) != default for c in configs), f"full_config leaves {f.name} at its default"


def test_round_trip_compiled_config(sqlite_url: str, save_kwargs: SaveKwargs) -> None:
    with ConfigStore(url=sqlite_url) as store:
        store.save(**{**save_kwargs(), "config": full_compiled_config()})
    with ConfigStore(url=sqlite_url) as store:
        assert store.load("s").config == full_compiled_config()



def test_round_trip_sharded_config(sqlite_url: str, save_kwargs: SaveKwargs) -> None:
    with ConfigStore(url=sqlite_url) as store:
        store.save(**{**save_kwargs(), "config": full_sharded_config()})
    with ConfigStore(url=sqlite_url) as store:
        assert store.load("s").config == full_sharded_config()

def test_round_trip_every_field(sqlite_url: str, save_kwargs: SaveKwargs) -> None:
    kwargs = save_kwargs()
    with ConfigStore(url=sqlite_url) as store:
        saved = store.save(**kwargs)
    with ConfigStore(url=sqlite_url) as store:
        loaded = store.load("s")
    assert loaded == saved
    for f in dataclasses.fields(BalanceConfig):
        assert getattr(loaded.config, f.name) == getattr(kwargs["config"], f.name), f.name
    assert loaded.figures == FIGURES
    assert loaded.fingerprint == kwargs["fingerprint"]
    assert loaded.trial_number == 7
    assert loaded.script_sha256 == "a" * 64
    assert loaded.saved_by == "alice@node1 (tune)"
    assert loaded.created_at.tzinfo is not None
    assert loaded.created_at.utcoffset().total_seconds() == 0  # type: ignore[union-attr]


def test_config_stored_as_json_not_pickle(sqlite_url: str, save_kwargs: SaveKwargs) -> None:
    with ConfigStore(url=sqlite_url) as store:
        store.save(**save_kwargs())
    raw = sqlite3.connect(_db(sqlite_url))
    (config_json,) = raw.execute("SELECT config_json FROM autobalance_saved_config").fetchone()
    raw.close()
    assert BalanceConfig.from_json(config_json) == full_config()


def test_non_finite_figures_become_null(sqlite_url: str, save_kwargs: SaveKwargs) -> None:
    with ConfigStore(url=sqlite_url) as store:
        saved = store.save(
            **save_kwargs(figures={"spread": float("inf"), "x": [float("nan"), 1.0]})
        )
        assert saved.figures == {"spread": None, "x": [None, 1.0]}
        assert store.load("s").figures == {"spread": None, "x": [None, 1.0]}


def test_idempotent_save(sqlite_url: str, save_kwargs: SaveKwargs) -> None:
    with ConfigStore(url=sqlite_url) as store:
        first = store.save(**save_kwargs())
        again = store.save(**save_kwargs(saved_by="bob@node2 (promote)"))
        assert store.count("s") == 1
        assert again == first  # already current: nothing changes
        assert len(store.history("s")) == 1


def test_newer_save_becomes_current(sqlite_url: str, save_kwargs: SaveKwargs) -> None:
    other = BalanceConfig.uniform(world_size=3, micro_batch=10)
    with ConfigStore(url=sqlite_url) as store:
        store.save(**save_kwargs(trial_number=1))
        store.save(**save_kwargs(trial_number=2, config=other))
        assert store.load("s").trial_number == 2
        assert store.load("s").config == other
        history = store.history("s")
        assert [h.trial_number for h in history] == [2, 1]
        assert store.count("s") == 2
        # same trial number, different configuration: a new row
        store.save(**save_kwargs(trial_number=2))
        assert store.count("s") == 3
        assert store.load("s").config == full_config()
    raw = sqlite3.connect(_db(sqlite_url))
    current = raw.execute(
        "SELECT trial_number FROM autobalance_saved_config WHERE study_name='s' AND is_current"
    ).fetchall()
    raw.close()
    assert current == [(2,)]


def test_resaving_history_row_makes_it_current_without_new_row(
    sqlite_url: str, save_kwargs: SaveKwargs
) -> None:
    other = BalanceConfig.uniform(world_size=3, micro_batch=10)
    with ConfigStore(url=sqlite_url) as store:
        store.save(**save_kwargs(trial_number=1))
        store.save(**save_kwargs(trial_number=2, config=other))
        again = store.save(**save_kwargs(trial_number=1, saved_by="bob@h (promote)"))
        assert store.count("s") == 2
        current = store.load("s")
        assert current == again
        assert current.trial_number == 1
        assert current.saved_by == "bob@h (promote)"
        assert [h.trial_number for h in store.history("s")] == [1, 2]


def test_studies_are_independent(sqlite_url: str, save_kwargs: SaveKwargs) -> None:
    with ConfigStore(url=sqlite_url) as store:
        store.save(**save_kwargs(study_name="b", trial_number=1))
        store.save(**save_kwargs(study_name="a", trial_number=2))
        assert store.list_saved() == ["a", "b"]
        assert store.load("a").trial_number == 2
        assert store.load("b").trial_number == 1


def test_unknown_study_lists_available(sqlite_url: str, save_kwargs: SaveKwargs) -> None:
    with ConfigStore(url=sqlite_url) as store:
        store.save(**save_kwargs(study_name="gpt-small"))
        store.save(**save_kwargs(study_name="mlp"))
        for call in (lambda: store.load("gtp-small"), lambda: store.history("gtp-small")):
            with pytest.raises(StudyNotFoundError) as info:
                call()
            message = str(info.value)
            assert "\n" not in message
            assert "'gtp-small'" in message
            assert "'gpt-small', 'mlp'" in message
            assert sqlite_url in message


def test_unknown_study_in_empty_store(sqlite_url: str, save_kwargs: SaveKwargs) -> None:
    with ConfigStore(url=sqlite_url) as store:
        store.save(**save_kwargs(study_name="a"))
    raw = sqlite3.connect(_db(sqlite_url))
    raw.execute("DELETE FROM autobalance_saved_config")
    raw.commit()
    raw.close()
    with (
        ConfigStore(url=sqlite_url) as store,
        pytest.raises(StudyNotFoundError, match="autobalance promote"),
    ):
        store.load("a")


def test_reads_never_create_the_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'missing.db'}"
    with ConfigStore(url=url) as store:
        assert store.list_saved() == []
        with pytest.raises(StudyNotFoundError, match="does not exist") as info:
            store.load("x")
        assert "\n" not in str(info.value)
    assert not (tmp_path / "missing.db").exists()


def test_reads_of_a_database_without_store_tables(tmp_path: Path) -> None:
    path = tmp_path / "optuna_only.db"
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE studies (study_id INTEGER PRIMARY KEY, study_name TEXT)")
    raw.commit()
    raw.close()
    with ConfigStore(url=f"sqlite:///{path}") as store:
        assert store.list_saved() == []
        with pytest.raises(StudyNotFoundError):
            store.load("x")
    raw = sqlite3.connect(path)
    tables = sorted(r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type='table'"))
    raw.close()
    assert tables == ["studies"]


def test_store_tables_leave_other_tables_alone(sqlite_url: str, save_kwargs: SaveKwargs) -> None:
    raw = sqlite3.connect(_db(sqlite_url))
    raw.execute("CREATE TABLE studies (study_id INTEGER PRIMARY KEY, study_name TEXT)")
    raw.execute("INSERT INTO studies VALUES (1, 's')")
    raw.commit()
    raw.close()
    with ConfigStore(url=sqlite_url) as store:
        store.save(**save_kwargs())
    raw = sqlite3.connect(_db(sqlite_url))
    tables = sorted(r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type='table'"))
    rows = raw.execute("SELECT * FROM studies").fetchall()
    raw.close()
    assert tables == ["autobalance_saved_config", "autobalance_schema", "studies"]
    assert rows == [(1, "s")]


@pytest.mark.parametrize(
    ("version", "expected"),
    [(0, "older than this autobalance's"), (2, "newer than this autobalance's")],
)
def test_schema_version_mismatch(
    sqlite_url: str, save_kwargs: SaveKwargs, version: int, expected: str
) -> None:
    with ConfigStore(url=sqlite_url) as store:
        store.save(**save_kwargs())
    raw = sqlite3.connect(_db(sqlite_url))
    raw.execute("UPDATE autobalance_schema SET version = ?", (version,))
    raw.commit()
    raw.close()
    fix = "autobalance promote" if version == 0 else "upgrade autobalance"
    with ConfigStore(url=sqlite_url) as store:
        for call in (
            lambda: store.load("s"),
            lambda: store.list_saved(),
            lambda: store.save(**save_kwargs(trial_number=8)),
        ):
            with pytest.raises(SchemaVersionError, match=expected) as info:
                call()
            message = str(info.value)
            assert fix in message
            assert f"version {version}" in message
            assert "\n" not in message


def test_store_without_version_table_is_older(sqlite_url: str, save_kwargs: SaveKwargs) -> None:
    with ConfigStore(url=sqlite_url) as store:
        store.save(**save_kwargs())
    raw = sqlite3.connect(_db(sqlite_url))
    raw.execute("DROP TABLE autobalance_schema")
    raw.commit()
    raw.close()
    with ConfigStore(url=sqlite_url) as store, pytest.raises(SchemaVersionError, match="older"):
        store.load("s")


def test_session_scope_rolls_back(sqlite_url: str, save_kwargs: SaveKwargs) -> None:
    from sqlalchemy import text

    with ConfigStore(url=sqlite_url) as store:
        store.save(**save_kwargs())
        with pytest.raises(RuntimeError), store.session_scope(write=True) as session:
            session.execute(text("DELETE FROM autobalance_saved_config"))
            raise RuntimeError("boom")
        assert store.count("s") == 1
        with store.session_scope(write=True) as session:
            session.execute(text("UPDATE autobalance_saved_config SET saved_by = 'x'"))
        assert store.load("s").saved_by == "x"


def test_session_scope_turns_db_errors_into_storage_error(sqlite_url: str) -> None:
    from sqlalchemy import text

    with (
        ConfigStore(url=sqlite_url) as store,
        pytest.raises(StorageError, match="no such table") as info,
        store.session_scope() as session,
    ):
        session.execute(text("SELECT * FROM no_such_table"))
    assert "\n" not in str(info.value)


def test_corrupt_row_is_a_storage_error(sqlite_url: str, save_kwargs: SaveKwargs) -> None:
    with ConfigStore(url=sqlite_url) as store:
        store.save(**save_kwargs())
    raw = sqlite3.connect(_db(sqlite_url))
    raw.execute("UPDATE autobalance_saved_config SET config_json = '{\"micro_batches\": []}'")
    raw.commit()
    raw.close()
    with ConfigStore(url=sqlite_url) as store, pytest.raises(StorageError, match="corrupt"):
        store.load("s")


def test_saved_config_rejects_bad_values(save_kwargs: SaveKwargs) -> None:
    from autobalance import ConfigError

    with ConfigStore(url="sqlite://") as store:
        with pytest.raises(ConfigError, match="figures"):
            store.save(**save_kwargs(figures={"x": object()}))
        with pytest.raises(ConfigError, match="trial_number"):
            store.save(**save_kwargs(trial_number=-1))


def test_concurrent_saves_from_four_processes(sqlite_url: str) -> None:
    errors = run_concurrent_saves(sqlite_url, "concurrent", workers=4)
    assert not errors, "\n".join(errors)
    raw = sqlite3.connect(_db(sqlite_url))
    total = raw.execute("SELECT COUNT(*) FROM autobalance_saved_config").fetchone()[0]
    current = raw.execute(
        "SELECT COUNT(*) FROM autobalance_saved_config WHERE is_current"
    ).fetchone()[0]
    raw.close()
    assert total == 4 * SAVES_PER_WORKER + 1
    assert current == 1
    with ConfigStore(url=sqlite_url) as store:
        assert isinstance(store.load("concurrent"), SavedConfig)
        assert len(store.history("concurrent")) == total


def test_make_fingerprint_helper_is_valid() -> None:
    assert make_fingerprint(world_size=5).world_size == 5
