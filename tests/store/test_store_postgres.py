"""The store on the real PostgreSQL server (AUTOBALANCE_TEST_POSTGRES_URL); each test has its own schema."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from conftest import FIGURES, full_config, make_fingerprint
from store_workers import SAVES_PER_WORKER, run_concurrent_saves

from autobalance import BalanceConfig, HardwareMismatchError, StudyNotFoundError
from autobalance.store import (
    ConfigStore,
    check_compatibility,
    check_storage,
    load_saved_config,
)

pytestmark = pytest.mark.postgres

SaveKwargs = Callable[..., dict[str, Any]]


def test_check_storage(postgres_url: str) -> None:
    assert check_storage(postgres_url) == postgres_url
    from sqlalchemy import inspect

    from autobalance.store import make_engine

    engine = make_engine(postgres_url)
    try:
        assert inspect(engine).get_table_names() == []  # the probe was rolled back
    finally:
        engine.dispose()


def test_round_trip(postgres_url: str, save_kwargs: SaveKwargs, study_name: str) -> None:
    with ConfigStore(url=postgres_url) as store:
        saved = store.save(**save_kwargs(study_name=study_name))
        again = store.save(**save_kwargs(study_name=study_name))
        assert again == saved
        assert store.count(study_name) == 1
    with ConfigStore(url=postgres_url) as store:
        loaded = store.load(study_name)
        assert loaded == saved
        for f in dataclasses.fields(BalanceConfig):
            assert getattr(loaded.config, f.name) == getattr(full_config(), f.name), f.name
        assert loaded.figures == FIGURES
        assert loaded.fingerprint == make_fingerprint()
        assert loaded.created_at.utcoffset() is not None
        other = BalanceConfig.uniform(world_size=3, micro_batch=2)
        store.save(**save_kwargs(study_name=study_name, trial_number=9, config=other))
        assert store.load(study_name).trial_number == 9
        assert [h.trial_number for h in store.history(study_name)] == [9, 7]
        assert store.list_saved() == [study_name]
        with pytest.raises(StudyNotFoundError, match=repr(study_name)):
            store.load(study_name + "-typo")


def test_concurrent_saves_from_four_processes(postgres_url: str, study_name: str) -> None:
    errors = run_concurrent_saves(postgres_url, study_name, workers=4)
    assert not errors, "\n".join(errors)
    from sqlalchemy import text

    with ConfigStore(url=postgres_url) as store, store.session_scope() as session:
        total = session.execute(
            text("SELECT COUNT(*) FROM autobalance_saved_config WHERE study_name = :s"),
            {"s": study_name},
        ).scalar_one()
        current = session.execute(
            text(
                "SELECT COUNT(*) FROM autobalance_saved_config WHERE study_name = :s AND is_current"
            ),
            {"s": study_name},
        ).scalar_one()
    assert total == 4 * SAVES_PER_WORKER + 1
    assert current == 1


def test_production_load(postgres_url: str, save_kwargs: SaveKwargs, study_name: str) -> None:
    with ConfigStore(url=postgres_url) as store:
        saved = store.save(**save_kwargs(study_name=study_name))
    loaded = load_saved_config(study=study_name, storage=postgres_url, config_file=None)
    assert loaded == saved
    assert (
        check_compatibility(loaded, current=make_fingerprint(), script_path=None, policy="error")
        == []
    )
    with pytest.raises(HardwareMismatchError, match="world size 3"):
        check_compatibility(
            loaded, current=make_fingerprint(world_size=2), script_path=None, policy="error"
        )
