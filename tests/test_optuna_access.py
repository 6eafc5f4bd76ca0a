"""Optuna's private names are reached in one module only (``autobalance/store/_optuna_access.py``),
and what that module returns is checked against a real study, so an Optuna upgrade breaks here."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import optuna
import pytest

from autobalance.store import (
    heartbeat_table,
    stale_trial_ids,
    storage_of,
    study_id,
    study_system_attr_table,
    trial_id,
)

ROOT = Path(__file__).resolve().parents[1] / "autobalance"
ADAPTER = ROOT / "store" / "_optuna_access.py"
PRIVATE = re.compile(
    r"\._trial_id\b|\._study_id\b|\._storage\b|_get_stale_trial_ids|optuna\.\w+\._\w+|optuna_dashboard\._\w+"
)
"""Optuna's (and optuna-dashboard's) private names autobalance has used; ``self._storage_error`` of
the store is autobalance's own and does not match (``\\b``)."""


def test_no_module_but_the_adapter_touches_optunas_private_names():
    offenders = [f"{p.relative_to(ROOT.parent)}:{n}: {line.strip()}"
                 for p in sorted(ROOT.rglob("*.py")) if p != ADAPTER
                 for n, line in enumerate(p.read_text().splitlines(), 1) if PRIVATE.search(line)]
    assert offenders == []


def test_the_pattern_finds_what_it_forbids():
    for line in ("trial._trial_id", "study._study_id", "study._storage.get_trial(1)",
                 "storage._get_stale_trial_ids(1)", "from optuna.storages._rdb import models",
                 "from optuna_dashboard._note import x"):
        assert PRIVATE.search(line), line
    assert not PRIVATE.search("self._storage_error(exc)")


@pytest.fixture
def rdb(tmp_path):
    return optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'a.db'}", heartbeat_interval=60, grace_period=1)


@pytest.fixture
def study(rdb):
    optuna.create_study(storage=rdb, study_name="other")  # ids differ from numbers
    return optuna.create_study(storage=rdb, study_name="s")


def test_ids_and_storage_are_optunas_own(study):
    storage = storage_of(study)
    sid = study_id(study)
    assert storage.get_study_name_from_id(sid) == "s"
    assert study_id(storage.get_all_studies()[1], storage) == sid  # a FrozenStudy, with its storage
    optuna.create_study(storage=storage, study_name="other2").ask()
    trial = study.ask()
    tid = trial_id(trial)
    assert storage.get_trial_id_from_study_id_trial_number(sid, trial.number) == tid
    assert trial_id(study.get_trials()[0]) == tid  # a FrozenTrial


def test_stale_trials_and_tables(study, rdb):
    storage = rdb
    trial = study.ask()
    assert stale_trial_ids(storage, study_id(study)) == []
    storage.record_heartbeat(trial_id(trial))
    table = heartbeat_table()
    with storage.engine.begin() as conn:  # a heartbeat from long ago: the trial is stale
        conn.execute(table.update().values(heartbeat=datetime.datetime(2000, 1, 1)))
    assert stale_trial_ids(storage, study_id(study)) == [trial_id(trial)]
    assert {"study_id", "key", "value_json"} <= set(study_system_attr_table().c.keys())
