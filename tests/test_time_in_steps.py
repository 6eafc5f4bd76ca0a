"""The trial attribute for a trial's seconds in steps is ``time_in_steps_s`` (``steps_s`` read like
steps per second in optuna-dashboard); studies stored before, with only ``steps_s``, still read."""

from __future__ import annotations

import warnings
from pathlib import Path

import optuna
import pytest

from autobalance.cli._views import trial_rows
from autobalance.protocol import TrialAttr, time_in_steps_s
from autobalance.report._rows import summarize
from autobalance.tuner._summary import per_trial_overhead_s
from tests.synthetic_study import build_study


@pytest.fixture(scope="module")
def new(tmp_path_factory: pytest.TempPathFactory) -> optuna.Study:
    return build_study(tmp_path_factory.mktemp("steps") / "s.db", world_size=1)


def _old_copy(study: optuna.Study, db: Path) -> optuna.Study:
    """The same trials, stored as before the rename: ``steps_s`` and no ``time_in_steps_s``."""
    old = optuna.create_study(storage=f"sqlite:///{db}", study_name="old", directions=study.directions)
    for key, value in study.user_attrs.items():
        old.set_user_attr(key, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # system_attrs is deprecated in create_trial
        for t in study.get_trials(deepcopy=False):
            attrs = dict(t.user_attrs)
            if TrialAttr.TIME_IN_STEPS_S in attrs:
                attrs[TrialAttr.STEPS_S_BEFORE] = attrs.pop(TrialAttr.TIME_IN_STEPS_S)
            old.add_trial(optuna.trial.create_trial(
                state=t.state, values=t.values, params=t.params, distributions=t.distributions, user_attrs=attrs,
                system_attrs=t.system_attrs))
    return old


def test_trials_record_time_in_steps_under_its_clear_name(new: optuna.Study) -> None:
    ok = [t for t in new.trials if t.user_attrs.get(TrialAttr.STATUS) == "ok"]
    assert ok
    for t in ok:
        assert t.user_attrs["time_in_steps_s"] > 0 and "steps_s" not in t.user_attrs
    assert all("steps_s" not in t.user_attrs for t in new.trials)


def test_an_old_study_with_only_steps_s_still_reads(new: optuna.Study, tmp_path: Path) -> None:
    old = _old_copy(new, tmp_path / "old.db")
    assert any("steps_s" in t.user_attrs for t in old.trials)
    assert not any("time_in_steps_s" in t.user_attrs for t in old.trials)
    expected = [time_in_steps_s(t.user_attrs) for t in new.trials]
    assert any(v is not None for v in expected)
    assert [time_in_steps_s(t.user_attrs) for t in old.trials] == expected
    # the report's rows, the CLI's `trials --json` rows, the tuner's overhead
    assert [r.time_in_steps_s for r in summarize(old).rows] == expected
    assert [r["time_in_steps_s"] for r in trial_rows(old)] == expected
    assert per_trial_overhead_s(old.trials) == pytest.approx(per_trial_overhead_s(new.trials))
    assert per_trial_overhead_s(old.trials) is not None


def test_the_new_name_wins_over_the_old() -> None:
    assert time_in_steps_s({"time_in_steps_s": 1.5, "steps_s": 9.0}) == 1.5
    assert time_in_steps_s({"steps_s": 9}) == 9.0
    assert time_in_steps_s({}) is None
