"""A dataset smaller than one global batch: partial steps measured with their true sample count, said
in words; a dataset with no step at all is an error (real torchrun trials, 2 CPU ranks)."""

from __future__ import annotations

import time

import pytest

from autobalance.launcher import TrialLaunch, run_trial
from autobalance.tuner._script_facts import script_facts
from tests.tune_helpers import REPO

pytestmark = pytest.mark.slow

USER = str(REPO / "tests" / "scripts" / "user_train.py")


def _trial(tmp_path, *script_args: str, name: str):
    launch = TrialLaunch(script=USER, script_args=list(script_args), nproc_per_node=2, device="cpu", steps=2,
                         warmup=1, trial_dir=str(tmp_path / name), timeout_s=120, trial_id=f"{name}{time.time()}",
                         env={"OMP_NUM_THREADS": "1"})
    return run_trial(launch)


def test_partial_steps_report_the_samples_really_used(tmp_path):
    # 20 samples, global batch 64 (2 ranks x 32): every step of every epoch is one partial step of 20
    outcome = _trial(tmp_path, "--samples", "20", "--micro-batch", "32", "--epochs", "6", name="small")
    assert outcome.status == "ok", (outcome.reason, outcome.traceback[-2000:])
    for rep in outcome.reports.values():
        assert rep["data"] == {"samples": 20, "global_batch": 64, "steps_per_epoch": 1, "dropped": 0}
        assert rep["step_samples"] == [20, 20] and rep["partial_steps"] == 2
        assert rep["samples_per_s"] == pytest.approx(20 / rep["step_time_s"], rel=0.05)
    lines = script_facts(outcome.reports[0], kept_split=False, allow=False, split="32,32")
    assert any("fewer than one global batch (64)" in line and "partial step" in line for line in lines), lines


def test_a_dataset_with_no_step_is_an_error_that_says_so(tmp_path):
    outcome = _trial(tmp_path, "--samples", "1", "--micro-batch", "4", name="one")
    assert outcome.status == "error"
    assert "1 sample" in outcome.reason and "no optimizer step" in outcome.reason, outcome.reason
