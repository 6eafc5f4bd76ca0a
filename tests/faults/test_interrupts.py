"""The tuner itself is stopped mid-trial (issue matrix 4 and 5).

Ctrl-C (SIGINT) or SIGTERM: the running job is killed, the trial is marked FAIL with status
``interrupted`` (not counted), exit code 130; the same command continues the study to its total.
SIGKILL: nothing in the tuner runs, so the trial's processes must go by themselves (parent-death
signals: torchrun gets SIGTERM, the workers SIGKILL); the next start fails the RUNNING trial whose
heartbeat stopped (status ``stale``, not counted) and runs another in its place.
"""

from __future__ import annotations

import signal
import subprocess
import time
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
    tune_cmd,
    wait_for,
)
from tests.tune_helpers import ctrl_c_reaches_it

pytestmark = pytest.mark.slow

MODE = {"warm": (), "cold": ("--cold",)}


def _start_and_wait_for_trial_1(url: str, tmp_path: Path, *extra: str, trials: int,
                                env: dict[str, str]) -> subprocess.Popen[str]:
    """Start ``tune`` on the seeded study; return once trial 1 is RUNNING and its ranks are stepping
    (they then sleep in the injected hang, so the timing of the signal does not matter)."""
    proc = subprocess.Popen(tune_cmd(url, *extra, trials=trials), cwd=tmp_path, env=env, text=True, preexec_fn=ctrl_c_reaches_it,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: list((tmp_path / "autobalance_runs" / "s").glob("trial-0001-*/progress.json")),
                 timeout=120, what="trial 1 to be running")
    except AssertionError:
        proc.kill()
        _out, err = proc.communicate()
        raise AssertionError(f"trial 1 never ran:\n{err[-3000:]}") from None
    assert [t.state for t in load(url).trials] == [TrialState.COMPLETE, TrialState.RUNNING]
    return proc


@pytest.mark.parametrize(
    ("sig", "mode"),
    [(signal.SIGINT, "warm"), (signal.SIGTERM, "warm"), (signal.SIGINT, "cold")],
    ids=["SIGINT", "SIGTERM", "SIGINT-cold"],
)
def test_interrupt_kills_the_trial_marks_it_and_a_rerun_continues(tmp_path: Path, seeded: str,
                                                                  sig: signal.Signals, mode: str) -> None:
    before = complete_trials(seeded)
    env = env_for(tmp_path, AB_FAULT="hang_all", AB_FAULT_ONCE="1")
    proc = _start_and_wait_for_trial_1(seeded, tmp_path, *MODE[mode], trials=3, env=env)
    proc.send_signal(sig)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("autobalance: error: interrupted;")
    # the best so far (the seeded baseline) and how to keep it, on the same line
    assert "Best so far: trial 0 (rank 0: " in last  # the configuration in the one notation
    assert f"`autobalance promote --study-name s --trial 0 --storage {seeded}`" in last
    assert last.endswith("or run the same command again to continue the study.")
    assert "Traceback" not in err
    trial = load(seeded).trials[1]
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["status"] == "interrupted"
    assert "interrupted" in trial.user_attrs["reason"]
    assert_no_processes(tmp_path, within=15)
    assert_kept(before, seeded)
    assert counted(seeded) == 1  # the interrupted trial does not count: it is run again
    if sig != signal.SIGINT or mode != "warm":
        return
    # the same command again continues the study up to the requested total
    again = tune(seeded, cwd=tmp_path, trials=3, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert counted(seeded) == 3
    statuses = by_status(seeded)
    assert [t.number for t in statuses["ok"]] == [0, 2, 3]
    assert [t.number for t in statuses["interrupted"]] == [1]
    assert_no_processes(tmp_path)
    assert_kept(before, seeded)


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_sigkilled_tuner_leaves_no_workers_and_its_stale_trial_is_replaced(tmp_path: Path, seeded: str,
                                                                           mode: str) -> None:
    before = complete_trials(seeded)
    # heartbeat every second: the killed tuner's trial is stale after 3 s instead of 30 s
    env = env_for(tmp_path, AB_FAULT="hang_all", AB_FAULT_ONCE="1", AUTOBALANCE_HEARTBEAT_S="1")
    proc = _start_and_wait_for_trial_1(seeded, tmp_path, *MODE[mode], trials=2, env=env)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    killed_at = time.monotonic()
    # the orphaned torchrun and both ranks die of their parent-death signals, well within the
    # trial timeout (90 s), instead of sleeping on for an hour
    assert_no_processes(tmp_path, within=60)
    assert time.monotonic() - killed_at < 60
    assert load(seeded).trials[1].state == TrialState.RUNNING  # nobody told the storage
    if mode == "cold":
        return  # what follows is the same for both: the storage side (shown once)
    time.sleep(4)  # > 3 heartbeat intervals
    again = tune(seeded, cwd=tmp_path, trials=2, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    trials = load(seeded).trials
    assert trials[1].state == TrialState.FAIL
    assert trials[1].user_attrs["status"] == "stale"
    assert "heartbeat" in trials[1].user_attrs["reason"]
    assert trials[2].user_attrs["status"] == "ok"
    assert counted(seeded) == 2
    assert_no_processes(tmp_path)
    assert_kept(before, seeded)


def test_sigkilled_during_the_baseline_the_next_start_takes_over(tmp_path: Path) -> None:
    """The baseline runs under a claim (one worker runs it, others wait). A tuner killed while
    running it leaves the claim behind; the next start on this host sees its owner is gone and runs
    the baseline itself at once instead of waiting for the claim to expire."""
    url = sqlite_url(tmp_path / "study.db")
    env = env_for(tmp_path, AB_FAULT="hang_all", AB_FAULT_ONCE="1")
    proc = subprocess.Popen(tune_cmd(url, trials=2), cwd=tmp_path, env=env, text=True, preexec_fn=ctrl_c_reaches_it,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(lambda: list((tmp_path / "autobalance_runs" / "s").glob("trial-0000-*/progress.json")),
             timeout=120, what="the baseline to be running")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert_no_processes(tmp_path, within=60)
    study = load(url)
    assert study.trials == []  # the baseline is recorded only when measured
    assert "autobalance:baseline_claim" in study._storage.get_study_system_attrs(study._study_id)
    again = tune(url, cwd=tmp_path, trials=2, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Waiting for the baseline" not in again.stderr  # the dead owner's claim was not waited for
    trials = load(url).trials
    assert [t.user_attrs["status"] for t in trials] == ["ok", "ok"]
    assert [t.user_attrs["baseline"] for t in trials] == [True, False]
    assert_no_processes(tmp_path)
