"""Errors in the user's script (issue matrix 3).

On the first trial (the baseline: the script's own configuration) an import error or a raised
non-OOM error stops the study at once, with the rank's traceback and exit code 1. On a later
trial, after successes: ``--on-error stop`` (the default) stops the same way; ``--on-error
continue`` marks the trial failed (status ``error``) and goes on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from optuna.trial import TrialState

from tests.faults.conftest import (
    assert_kept,
    assert_no_processes,
    by_status,
    complete_trials,
    counted,
    env_for,
    load,
    sqlite_url,
    tune,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        ("import_error", ["ModuleNotFoundError", "this_module_does_not_exist"]),
        ("raise", ["ValueError: injected failure in the training script"]),
    ],
)
def test_error_on_the_first_trial_stops_the_study_with_the_traceback(tmp_path: Path, fault: str,
                                                                    words: list[str]) -> None:
    url = sqlite_url(tmp_path / "study.db")
    proc = tune(url, cwd=tmp_path, trials=4, env=env_for(tmp_path, AB_FAULT=fault))
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    for word in words:
        assert word in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("autobalance: error: the baseline trial (the script's own configuration) failed")
    # stopped at once: one launch, nothing recorded as if it had been measured
    assert len(list((tmp_path / "autobalance_runs" / "s").glob("trial-*"))) == 1
    assert complete_trials(url) == {}
    assert_no_processes(tmp_path)


def test_error_after_successes_stops_by_default(tmp_path: Path, seeded: str) -> None:
    before = complete_trials(seeded)
    proc = tune(seeded, cwd=tmp_path, trials=4, env=env_for(tmp_path, AB_FAULT="raise"))
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "trial 1 failed in the training script" in last and "--on-error continue" in last
    trial = load(seeded).trials[1]
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["status"] == "error"
    assert "ValueError: injected failure in the training script" in trial.user_attrs["reason"]
    assert "Traceback" in trial.user_attrs["error_tail"]
    assert len(load(seeded).trials) == 2  # stopped at once: no trial after the failing one
    assert_no_processes(tmp_path)
    assert_kept(before, seeded)


def test_error_after_successes_with_on_error_continue_marks_it_and_goes_on(tmp_path: Path, seeded: str) -> None:
    before = complete_trials(seeded)
    proc = tune(seeded, "--on-error", "continue", cwd=tmp_path, trials=3,
                env=env_for(tmp_path, AB_FAULT="raise", AB_FAULT_ONCE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    statuses = by_status(seeded)
    assert [t.number for t in statuses["error"]] == [1]
    assert statuses["error"][0].state == TrialState.FAIL
    assert [t.number for t in statuses["ok"]] == [0, 2]
    assert counted(seeded) == 3  # a failed trial counts towards --trials
    assert_no_processes(tmp_path)
    assert_kept(before, seeded)
