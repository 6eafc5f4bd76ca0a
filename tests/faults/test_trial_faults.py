"""Faults inside one trial (issue matrix 1, 2 and 7): an OOM while the peer waits in the all-reduce,
a rank killed, hanging or leaving early, and reports that cannot be written or are garbage.

Each test continues the seeded study (its baseline is trial 0), so the faulty trial is trial 1.
Trials run in a warm worker pool (the default); ``cold`` variants run one torchrun per trial.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from optuna.trial import TrialState

from tests.faults.conftest import (
    assert_kept,
    assert_no_processes,
    complete_trials,
    env_for,
    load,
    tune,
)

pytestmark = pytest.mark.slow

MODE = {"warm": (), "cold": ("--cold",)}


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_oom_in_backward_while_peer_waits_in_allreduce(tmp_path: Path, seeded: str, mode: str) -> None:
    """Matrix 1: rank 1 runs out of memory inside the synchronised backward while rank 0 waits in
    the all-reduce. The trial ends well within its timeout as infeasible ``oom``; the next one runs."""
    before = complete_trials(seeded)
    proc = tune(seeded, *MODE[mode], cwd=tmp_path, trials=3 if mode == "warm" else 2,  # "the next runs": once
                env=env_for(tmp_path, AB_FAULT="oom_backward_rank1", AB_FAULT_ONCE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = load(seeded).trials
    oom = trials[1]
    assert oom.state == TrialState.COMPLETE  # infeasible but visible to the sampler
    assert oom.user_attrs["status"] == "oom"
    assert oom.user_attrs["feasible"] is False
    assert oom.system_attrs["constraints"][0] > 0
    assert "rank 1 ran out of memory" in oom.user_attrs["reason"]
    assert oom.user_attrs["failing_rank"] == 1
    assert oom.user_attrs["wall_s"] < 60  # not the trial timeout (90 s): the peer was not left hanging
    if mode == "warm":
        assert trials[2].state == TrialState.COMPLETE and trials[2].user_attrs["status"] == "ok"
    assert_no_processes(tmp_path)
    assert_kept(before, seeded)


@pytest.mark.parametrize(
    ("fault", "mode", "status", "words"),
    [
        ("sigkill_rank1", "warm", "crash", ["rank 1", "SIGKILL"]),
        # rank 0 either notices the lost connection (its report says so) or, on a busy machine, is
        # still in its step when torchrun ends the job: the reason says which, and never blames it
        ("sigkill_rank1", "cold", "crash", ["rank 1 was killed by SIGKILL (signal 9)",
                                            ("ranks [0] lost their connection", "ranks [0] were stopped by torchrun")]),
        ("exit0_rank1", "warm", "crash", ["rank 1", "finished normally (exit code 0) without a report"]),
        ("hang_rank1", "warm", "timeout", ["--trial-timeout 20s", "killed the whole job"]),
    ],
)
def test_rank_killed_hanging_or_leaving_early(tmp_path: Path, seeded: str, fault: str, mode: str, status: str,
                                              words: list[str | tuple[str, ...]]) -> None:
    """Matrix 2: one rank is SIGKILLed mid-trial / sleeps forever before a collective / exits 0
    without a report. The trial ends (crash, or timeout = infeasible), and the study goes on."""
    before = complete_trials(seeded)
    # cold trials count torchrun's start-up in the timeout (a minute on a loaded 2-core machine), so they
    # get more than warm ones; only the hang (warm) reaches its timeout
    proc = tune(seeded, *MODE[mode], cwd=tmp_path, trials=2, timeout=20 if mode == "warm" else 180,
                env=env_for(tmp_path, AB_FAULT=fault, AB_FAULT_ONCE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    trial = load(seeded).trials[1]
    assert trial.user_attrs["status"] == status, trial.user_attrs.get("reason")
    for word in words:  # a tuple: one of its phrases
        assert any(w in trial.user_attrs["reason"] for w in ((word,) if isinstance(word, str) else word)), \
            trial.user_attrs["reason"]
    if status == "timeout":  # a hang is infeasible (recorded, so the sampler avoids it)
        assert trial.state == TrialState.COMPLETE and trial.system_attrs["constraints"][0] > 0
        # killed at its 20 s timeout, not left to hang; the tree kill and clean-up took up to 26 s more
        # on a loaded 2-core machine
        assert trial.user_attrs["wall_s"] < 20 + 40
    else:  # a crash is a failed trial (it counts towards --trials; the study continues)
        assert trial.state == TrialState.FAIL
        assert trial.user_attrs["failing_rank"] == 1
    assert_no_processes(tmp_path)
    assert_kept(before, seeded)


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        ("report_enospc_rank1", ["rank 1 could not write its 'ok' report", "No space left on device"]),
        ("report_eacces_rank1", ["rank 1 could not write its 'ok' report", "Permission denied"]),
        ("report_garbage_rank1", ["report of rank 1 is unreadable"]),
        ("report_truncated_rank1", ["report of rank 1 is unreadable", "Unterminated string"]),
    ],
)
def test_report_unwritable_or_garbage(tmp_path: Path, seeded: str, fault: str, words: list[str]) -> None:
    """Matrix 7: the disk is full / the report directory is not writable when rank 1 writes its
    report, or the report is garbage / cut short. The trial fails (crash) with that reason; the
    tuner neither crashes nor stops, and the next trial runs."""
    before = complete_trials(seeded)
    then_one_more = fault == "report_enospc_rank1"  # that the next trial runs is shown once
    proc = tune(seeded, cwd=tmp_path, trials=3 if then_one_more else 2,
                env=env_for(tmp_path, AB_FAULT=fault, AB_FAULT_ONCE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    trials = load(seeded).trials
    bad = trials[1]
    assert bad.state == TrialState.FAIL
    assert bad.user_attrs["status"] == "crash"
    assert bad.user_attrs["failing_rank"] == 1
    for word in words:
        assert word in bad.user_attrs["reason"], bad.user_attrs["reason"]
    if then_one_more:
        assert trials[2].user_attrs["status"] == "ok"
    assert_no_processes(tmp_path)
    assert_kept(before, seeded)


@pytest.mark.parametrize(
    ("report", "words"),
    [
        ({"status": "ok", "memory": "lots", "device": {}, "step_time_s": 0.1}, "memory is not an object"),
        ({"status": "ok", "memory": {"peak_device": "1 GiB"}, "device": {}, "step_time_s": 0.1},
         "memory.peak_device is not a non-negative number"),
        ({"status": "ok", "memory": {}, "device": {}, "step_time_s": -1}, "an ok report without a step time"),
        ({"status": "ok", "memory": {}, "device": {"capacity_bytes": True}, "step_time_s": 0.1},
         "device.capacity_bytes is not a non-negative number"),
        ({"status": "pwned"}, "status 'pwned' is not one of"),
        ([1, 2, 3], "a JSON list, not an object"),
    ],
)
def test_report_with_wrong_types_is_a_crash_not_a_tuner_error(tmp_path: Path, report: object, words: str) -> None:
    """Matrix 7 (the classifier alone): valid JSON of the wrong shape is an unusable report, never
    a value the tuner computes with."""
    from autobalance.launcher import classify

    good = {"status": "ok", "memory": {"peak_device": 1.0}, "device": {"capacity_bytes": 2.0}, "step_time_s": 0.1}
    (tmp_path / "rank0.json").write_text(json.dumps(good))
    (tmp_path / "rank1.json").write_text(json.dumps(report))
    outcome = classify(trial_dir=str(tmp_path), world_size=2, returncode=0, timed_out=False, interrupted=False,
                       wall_s=1.0, timeout_s=10.0)
    assert outcome.status == "crash"
    assert outcome.failing_rank == 1
    assert words in outcome.reason


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_trial_directory_that_cannot_be_created_is_a_crash_and_nothing_starts(tmp_path: Path, mode: str) -> None:
    """Matrix 7, the launcher's side: the trial directory cannot be made (the runs directory is
    gone, read-only or full). The trial is a crash with that reason; no torchrun is started."""
    from autobalance.launcher import TrialLaunch, WarmPool, run_trial
    from tests.tune_helpers import FAULTY

    launch = TrialLaunch(script=FAULTY, nproc_per_node=2, trial_dir="/proc/autobalance-trial", timeout_s=30)
    if mode == "cold":
        outcome = run_trial(launch)
    else:
        pool = WarmPool(template=launch, pool_dir=str(tmp_path / "pool"))
        outcome = pool.run(launch)
        assert pool.proc is None  # the pool was not even started
    assert outcome.status == "crash"
    assert "could not write the trial directory /proc/autobalance-trial" in outcome.reason
    assert "--runs-dir" in outcome.reason
    assert_no_processes(tmp_path, within=0)
