"""``--measure-s``: a trial measures for about that long (at least ``--steps``, at most ``--max-steps``
measured steps), every rank stopping after the same step; real torchrun jobs, 2 ranks, gloo."""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import pytest

from autobalance.launcher import TrialLaunch, WarmPool, run_trial, trial_processes
from autobalance.tuner._summary import per_trial_overhead_s
from tests.tune_helpers import GPT

pytestmark = pytest.mark.slow

SMALL = ["--n-layer", "2", "--n-embd", "32", "--samples", "128"]
"""128 samples, global batch 16: one epoch is 8 optimizer steps."""


def _launch(tmp_path: Path, name: str, **kw: object) -> TrialLaunch:
    fields: dict = {"script": GPT, "script_args": SMALL, "nproc_per_node": 2, "device": "cpu", "steps": 2,
                    "warmup": 1, "timeout_s": 120, "trial_dir": str(tmp_path / name),
                    "env": {"OMP_NUM_THREADS": "1"}, **kw}
    return TrialLaunch(**fields, trial_id=f"{name}-{time.time()}")


def _counts(outcome) -> list[int]:
    assert outcome.status == "ok", outcome.reason
    return [outcome.reports[r].measured_steps for r in range(2)]


def test_measure_s_lengthens_cold_and_warm_trials_up_to_the_bounds(tmp_path):
    # asks for far more than the steps take: capped by max_steps, the same on both ranks
    capped = run_trial(_launch(tmp_path, "capped", measure_s=600.0, max_steps=5))
    assert _counts(capped) == [5, 5]
    assert all(len(capped.reports[r].step_times_s) == 5 for r in range(2))
    timing = capped.reports[0].timing
    assert timing.measure_s == 600.0 and timing.steps_s > 0
    # the script's data ends after 8 steps (1 warm-up + 7): past the minimum, the trial is ok
    ran_out = run_trial(_launch(tmp_path, "ran-out", measure_s=600.0, max_steps=50))
    assert _counts(ran_out) == [7, 7]

    # warm: the target and the bound travel with each trial (one pool serves them all)
    pool = WarmPool(template=_launch(tmp_path, "pool-template"), pool_dir=str(tmp_path / "pool"))
    try:
        assert _counts(pool.run(_launch(tmp_path, "w-long", measure_s=600.0, max_steps=4))) == [4, 4]
        # the data running out after the minimum: measured, and the pool goes on
        assert _counts(pool.run(_launch(tmp_path, "w-ran-out", measure_s=600.0, max_steps=50))) == [7, 7]
        assert _counts(pool.run(_launch(tmp_path, "w-tiny", measure_s=1e-6))) == [2, 2]  # a tiny target keeps the minimum
        assert _counts(pool.run(_launch(tmp_path, "w-off", max_steps=4))) == [2, 2]
        assert pool.starts == 1
        pool_id = pool.pool_id
    finally:
        pool.close()
    assert trial_processes(pool_id) == []


def test_auto_measure_targets_the_overhead_of_recent_trials():
    def trial(wall: float, steps: float, compile_s: float | None = None, status: str = "ok"):
        attrs = {"status": status, "wall_s": wall, "time_in_steps_s": steps}
        if compile_s is not None:
            attrs["compile_s"] = compile_s
        return optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=1.0, user_attrs=attrs)

    assert per_trial_overhead_s([]) is None
    assert per_trial_overhead_s([trial(1.0, 0.7), trial(0.8, 0.5), trial(0.9, 0.5)]) == pytest.approx(0.3)
    # compilation is not overhead; OOM trials and reused trials do not count
    assert per_trial_overhead_s([trial(31.0, 0.7, compile_s=30.0), trial(5.0, 0.1, status="oom")]) == pytest.approx(0.3)
    # only the recent trials: a cold start long ago does not inflate it
    trials = [trial(15.0, 0.5)] + [trial(0.7, 0.5)] * 5
    assert per_trial_overhead_s(trials) == pytest.approx(0.2)
    # a study stored before the rename holds "steps_s": read the same
    old = trial(1.0, 0.7)
    old.user_attrs["steps_s"] = old.user_attrs.pop("time_in_steps_s")
    assert per_trial_overhead_s([old]) == pytest.approx(0.3)
    # a warm pool (re)started for a trial: its start is not per-trial overhead
    restarted = trial(14.7, 0.5)
    restarted.user_attrs["pool_start_s"] = 14.0
    assert per_trial_overhead_s([restarted]) == pytest.approx(0.2)
