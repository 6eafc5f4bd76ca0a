"""Partial steps (the end of an epoch, or a dataset smaller than one global batch): measured with
their true sample count and said in words; a dataset with no step at all is an error. The unit tests
run in process; the others are real torchrun jobs (2 CPU ranks), trials and production runs."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from autobalance.launcher import TrialLaunch, TrialOutcome, run_trial
from autobalance.runtime._clock import StepClock
from autobalance.tuner._remeasure import dispersion, merge_outcomes
from autobalance.tuner._summary import script_facts
from tests.conftest import torchrun
from tests.tune_helpers import REPO

USER = str(REPO / "tests" / "scripts" / "user_train.py")


def _clock(monkeypatch, steps: list[tuple[float, int]]) -> StepClock:
    for name in ("AUTOBALANCE_WARMUP", "AUTOBALANCE_STEPS", "AUTOBALANCE_MEASURE_S", "AUTOBALANCE_MAX_STEPS"):
        monkeypatch.delenv(name, raising=False)
    clock = StepClock(trial_dir=None, rank=0, device=torch.device("cpu"), compile_steps=0, one_step=False)
    for seconds, samples in steps:
        clock.record(seconds, claimed=False, samples=samples)
    return clock


def test_full_and_partial_steps_mixed_time_the_full_steps_with_the_global_batch(monkeypatch):
    """Samples [64, 64, 20]: the 20-sample step did less work. Fails if it is timed with the full
    steps (the median of all three, 0.10 s, would make 64 samples look faster) or if the samples
    per step are a mean over the mixed steps (49.3: samples/s too low for the full steps' time)."""
    clock = _clock(monkeypatch, [(0.10, 64), (0.12, 64), (0.03, 20)])
    step_time, per_step, partial = clock.step_figures(64)
    assert step_time == pytest.approx(0.11) and per_step == 64.0 and partial == 1
    assert per_step / step_time == pytest.approx(64 / 0.11)  # the report's samples_per_s
    assert clock.timed(64) == ([0.10, 0.12], 64.0)  # the steps its spread (IQR) is taken over
    assert clock.measured_samples(64) == [64, 64, 20]
    # every step partial (20 samples for a global batch of 64): their time, their true samples
    only_partial = _clock(monkeypatch, [(0.03, 20), (0.05, 20)])
    assert only_partial.step_figures(64) == (pytest.approx(0.04), 20.0, 2)
    # a step recorded without its count (the compile step) counts as a full one
    assert _clock(monkeypatch, [(0.2, None), (0.1, 20)]).step_figures(64) == (0.2, 64.0, 1)


def _measured(times: list[float], samples: list[int]) -> TrialOutcome:
    step = statistics.median([t for t, n in zip(times, samples, strict=True) if n == 64])
    rep = {"status": "ok", "config": {"global_batch": 64}, "step_times_s": times, "step_samples": samples,
           "step_time_s": step, "samples_per_step": 64.0, "memory": {"peak_device": 1.0}, "device": {"type": "cpu"}}
    return TrialOutcome(status="ok", reason="x", reports={0: rep}, wall_s=1.0)


def test_a_remeasured_trial_pools_the_full_steps_only_and_a_partial_step_is_not_spread():
    """Fails if the merge of two runs takes the median over their partial steps too (0.05 s here:
    samples/s of 64 per step twice too high), or if a short partial step counts as dispersion."""
    first = _measured([0.10, 0.10, 0.03], [64, 64, 20])
    second = _measured([0.10, 0.10, 0.03, 0.03, 0.03], [64, 64, 20, 20, 20])
    assert dispersion(first) == 0.0  # the full steps agree
    merged = merge_outcomes(first, second, reason="r").reports[0]
    assert merged.step_time_s == pytest.approx(0.10) and merged.samples_per_s == pytest.approx(640.0)
    assert merged.step_samples == [64, 64, 20, 64, 64, 20, 20, 20] and merged.partial_steps == 4
    assert merged.measured_steps == 8 and merged.step_time_iqr_s == 0.0


def _trial(tmp_path, *script_args: str, name: str):
    launch = TrialLaunch(script=USER, script_args=list(script_args), nproc_per_node=2, device="cpu", steps=2,
                         warmup=1, trial_dir=str(tmp_path / name), timeout_s=120, trial_id=f"{name}{time.time()}",
                         env={"OMP_NUM_THREADS": "1"})
    return run_trial(launch)


@pytest.mark.slow
def test_partial_steps_report_the_samples_really_used(tmp_path):
    # 20 samples, global batch 64 (2 ranks x 32): every step of every epoch is one partial step of 20
    outcome = _trial(tmp_path, "--samples", "20", "--micro-batch", "32", "--epochs", "6", name="small")
    assert outcome.status == "ok", (outcome.reason, outcome.traceback[-2000:])
    for rep in outcome.reports.values():
        assert rep.data == {"samples": 20, "global_batch": 64, "steps_per_epoch": 1, "dropped": 0}
        assert rep.step_samples == [20, 20] and rep.partial_steps == 2
        assert rep.samples_per_s == pytest.approx(20 / rep.step_time_s, rel=0.05)
    lines = script_facts(outcome.reports[0], kept_split=False, allow=False, split="32,32")
    assert any("fewer than one global batch (64)" in line and "partial step" in line for line in lines), lines


@pytest.mark.slow
def test_a_dataset_with_no_step_is_an_error_that_says_so(tmp_path):
    outcome = _trial(tmp_path, "--samples", "1", "--micro-batch", "4", name="one")
    assert outcome.status == "error"
    assert "1 sample" in outcome.reason and "no optimizer step" in outcome.reason, outcome.reason


def _production(*script_args: str):
    return torchrun([USER, *script_args], env={"AUTOBALANCE_DEVICE": "cpu"})


@pytest.mark.slow
def test_a_production_run_on_a_dataset_smaller_than_one_global_batch_warns_once_and_trains():
    """A production job (the script's own configuration, no trial) with 20 samples for a global
    batch of 64: one line (rank 0) names the dataset's size, the global batch and what to do; the
    job trains its partial steps."""
    proc = _production("--samples", "20", "--micro-batch", "32", "--epochs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "fewer than one global batch" in line]
    assert len(said) == 1, proc.stderr[-3000:]
    assert "the dataset has 20 samples, fewer than one global batch (64)" in said[0]
    assert "one partial step of 20 samples" in said[0]
    assert "give plan.dataloader() at least 64 samples, or use a smaller global batch" in said[0]


@pytest.mark.slow
def test_a_production_run_on_one_sample_trains_no_step_and_says_so():
    """One sample for two ranks: no optimizer step at all. Fails if the job trains nothing and
    exits 0, or says only that the dataset is small (as if it trained partial steps)."""
    proc = _production("--samples", "1", "--micro-batch", "4")
    assert proc.returncode != 0
    assert ("the dataset has 1 sample(s), fewer than the 2 ranks: an epoch has no optimizer step (nothing "
            "would train)") in proc.stderr, proc.stderr[-3000:]
    assert "fewer than one global batch" not in proc.stderr
