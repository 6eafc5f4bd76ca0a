"""The study's objective from known per-rank peaks and step times, with numbers derived by hand.

Each test names in its docstring the mutation of ``tuner/search/_objective.py`` it catches.
"""

from __future__ import annotations

import dataclasses

import pytest

from autobalance.launcher import TrialOutcome
from autobalance.tuner.search import INFEASIBLE_TIME, TrialFigures, figures_from_outcome

GIB = 2**30


def figures(peaks: list[float | None], caps: list[float], step: float | None, status: str = "ok") -> TrialFigures:
    return TrialFigures(status=status, peak_device=peaks, peak_allocated=list(peaks), peak_reserved=list(peaks),
                        outside_pytorch=[0.0] * len(peaks), capacity=caps, step_time_s=step,
                        samples_per_s=None, startup_s=None)


def test_single_objective_adds_the_spread_to_the_normalised_step_time():
    """Fails if the spread term is dropped (weight_spread ignored or forced to 0), if the time is
    not divided by the reference, or if the weights are swapped.

    Ranks peak at 6 and 10 GiB of 16 GiB: spread = (10 - 6) / 16 = 0.25. Step 0.3 s against a
    reference of 0.2 s: 1.5. Weights 1 and 1: 1.75; weights 2 and 0.5: 0.5 + 0.75 = 1.25.
    """
    f = figures([6 * GIB, 10 * GIB], [16 * GIB, 16 * GIB], 0.3)
    assert f.spread_fraction() == pytest.approx(0.25)
    assert f.values(reference_step_s=0.2, weight_spread=1.0, weight_time=1.0,
                    multi_objective=False) == [pytest.approx(1.75)]
    assert f.values(reference_step_s=0.2, weight_spread=2.0, weight_time=0.5,
                    multi_objective=False) == [pytest.approx(1.25)]
    assert f.values(reference_step_s=0.2, weight_spread=1.0, weight_time=1.0,
                    multi_objective=True) == [pytest.approx(0.25), pytest.approx(1.5)]


def test_spread_is_a_fraction_of_each_ranks_own_capacity():
    """Fails if the spread is measured in bytes, or divided by one rank's capacity for all ranks.

    Both ranks peak at 4 GiB (0 bytes apart), but rank 0 has 16 GiB and rank 1 8 GiB:
    4/16 = 0.25 and 4/8 = 0.5, spread 0.25; with a reference equal to the step, 0.25 + 1 = 1.25.
    """
    f = figures([4 * GIB, 4 * GIB], [16 * GIB, 8 * GIB], 0.1)
    assert f.spread_bytes() == 0
    assert f.spread_fraction() == pytest.approx(0.25)
    assert f.values(reference_step_s=0.1, weight_spread=1.0, weight_time=1.0,
                    multi_objective=False) == [pytest.approx(1.25)]


def test_three_ranks_spread_is_max_minus_min():
    """Fails if the spread compares neighbouring ranks or the first and last rank only.

    Peaks 5, 2, 5 GiB of 20 GiB: fractions 0.25, 0.1, 0.25; spread 0.15 (rank 0 vs rank 2: 0).
    """
    f = figures([5 * GIB, 2 * GIB, 5 * GIB], [20 * GIB] * 3, 1.0)
    assert f.spread_fraction() == pytest.approx(0.15)
    assert f.values(reference_step_s=2.0, weight_spread=1.0, weight_time=1.0,
                    multi_objective=False) == [pytest.approx(0.65)]


def test_a_trial_without_a_measurement_scores_the_worst_spread_and_the_infeasible_time():
    """Fails if an OOM trial scores its partial peaks (the rank killed first looks balanced), or if
    the spread term of an unmeasured trial is dropped: 1 (spread) + 10 (time) = 11."""
    assert INFEASIBLE_TIME == 10.0
    oom = figures([15 * GIB, None], [16 * GIB, 16 * GIB], None, status="oom")
    assert oom.values(reference_step_s=0.2, weight_spread=1.0, weight_time=1.0,
                      multi_objective=False) == [pytest.approx(11.0)]
    assert oom.values(reference_step_s=0.2, weight_spread=1.0, weight_time=1.0,
                      multi_objective=True) == [pytest.approx(1.0), pytest.approx(10.0)]
    # a full set of peaks but status oom is still not a measurement
    partial = figures([15 * GIB, 15 * GIB], [16 * GIB, 16 * GIB], 0.2, status="oom")
    assert partial.values(reference_step_s=0.2, weight_spread=1.0, weight_time=1.0,
                          multi_objective=False) == [pytest.approx(11.0)]


def test_memory_constraint_compares_each_peak_with_its_usable_memory():
    """Fails if the headroom is ignored, if the constraint uses the mean instead of the worst
    rank, or if an OOM trial can come out feasible.

    16 GiB with 10 % headroom: 14.4 GiB usable. Peaks 6 and 10 GiB: 10 / 14.4 - 1 = -0.305556.
    A 15 GiB peak: 15 / 14.4 - 1 = 0.041667 (infeasible although under the 16 GiB capacity).
    """
    ok = figures([6 * GIB, 10 * GIB], [16 * GIB, 16 * GIB], 0.3)
    assert ok.memory_constraint(0.1) == pytest.approx(-0.305556, abs=1e-6)
    over = figures([6 * GIB, 15 * GIB], [16 * GIB, 16 * GIB], 0.3)
    assert over.memory_constraint(0.1) == pytest.approx(0.041667, abs=1e-6)
    oom = figures([6 * GIB, None], [16 * GIB, 16 * GIB], None, status="oom")
    assert oom.memory_constraint(0.1) == 1.0


def test_figures_take_the_slowest_rank_and_every_ranks_peak():
    """Fails if the step time is the fastest rank's or rank 0's (DDP steps wait for the slowest),
    or if peaks are taken from one rank for all.

    Rank 0: 0.25 s, 6 GiB; rank 1: 0.3 s, 10 GiB. Global batch 24: 24 / 0.3 = 80 samples/s.
    """
    def report(rank: int, step: float, peak: float) -> dict:
        return {"status": "ok", "rank": rank, "step_time_s": step, "config": {"global_batch": 24},
                "memory": {"peak_device": peak, "peak_allocated": peak, "peak_reserved": peak,
                           "outside_pytorch": 0},
                "device": {"capacity_bytes": 16 * GIB}}

    outcome = TrialOutcome(status="ok", reason="", reports={0: report(0, 0.25, 6 * GIB), 1: report(1, 0.3, 10 * GIB)})
    f = figures_from_outcome(outcome, world_size=2, caps=None)
    assert f.step_time_s == 0.3
    assert f.peak_device == [6 * GIB, 10 * GIB]
    assert f.capacity == [16 * GIB, 16 * GIB]
    assert f.samples_per_s == pytest.approx(80.0)
    assert f.values(reference_step_s=0.2, weight_spread=1.0, weight_time=1.0,
                    multi_objective=False) == [pytest.approx(1.75)]
    assert f.parameter_bytes is None and "parameter_bytes" not in f.user_attrs(0.05)  # not reported
    with_model = {r: dataclasses.replace(rep, model={"num_blocks": 2, "parameter_bytes": 4096})
                  for r, rep in outcome.reports.items()}
    g = figures_from_outcome(TrialOutcome(status="ok", reason="", reports=with_model), world_size=2, caps=None)
    assert g.user_attrs(0.05)["parameter_bytes"] == 4096  # what verification's forecast reads


def test_partial_steps_count_the_samples_they_really_used():
    """Fails if samples/s is the configuration's global batch over the step time when every measured
    step was partial (a dataset smaller than one global batch: the issue's 6307.9 samples/s for
    20-sample steps of a 64-sample global batch).

    Both ranks: 0.01 s per step of 20 samples (global batch 64): 20 / 0.01 = 2000 samples/s, not 6400.
    """
    def report(rank: int) -> dict:
        return {"status": "ok", "rank": rank, "step_time_s": 0.01, "config": {"global_batch": 64},
                "samples_per_step": 20.0, "partial_steps": 3,
                "memory": {"peak_device": GIB, "peak_allocated": GIB, "peak_reserved": GIB, "outside_pytorch": 0},
                "device": {"capacity_bytes": 16 * GIB}}

    outcome = TrialOutcome(status="ok", reason="", reports={0: report(0), 1: report(1)})
    assert figures_from_outcome(outcome, world_size=2, caps=None).samples_per_s == pytest.approx(2000.0)
