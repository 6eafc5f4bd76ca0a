"""Balanced splits and joint checkpointing, checked against brute force on small cases."""

from __future__ import annotations

import functools
import itertools
import random
from typing import TypedDict

import pytest

from autobalance._config import BalanceConfig
from autobalance._errors import UsageError
from autobalance.tuner.search import (
    MemoryModel,
    MemoryObservation,
    SplitPlan,
    balanced_split,
    balanced_split_for,
    choose_checkpointing,
    plans_from_model,
    predict_config_feasible,
    predict_feasible,
)

GIB = 2**30
RHO = 1 / 3


def splits(total: int, world: int) -> list[tuple[int, ...]]:
    return [s for s in itertools.product(range(1, total + 1), repeat=world) if sum(s) == total]


def max_rel(
    split: tuple[int, ...] | list[int], fixed: list[float], ps: list[float], lim: list[float]
) -> float:
    return max((f + p * m) / li for m, f, p, li in zip(split, fixed, ps, lim, strict=True))


def brute_split(total: int, fixed: list[float], ps: list[float], lim: list[float]) -> float | None:
    feasible = [
        max_rel(s, fixed, ps, lim)
        for s in splits(total, len(fixed))
        if all(f + p * m <= li for m, f, p, li in zip(s, fixed, ps, lim, strict=True))
    ]
    return min(feasible) if feasible else None


def random_case(
    rng: random.Random, world: int
) -> tuple[int, list[float], list[float], list[float]]:
    total = rng.randint(world, 12 if world == 2 else 9)
    fixed = [rng.uniform(0, 10) for _ in range(world)]
    ps = [rng.uniform(0.2, 3) for _ in range(world)]
    lim = [rng.uniform(5, 30) for _ in range(world)]
    if rng.random() < 0.3:
        ps = [ps[0]] * world
    if rng.random() < 0.3:
        lim = [lim[0]] * world
    return total, fixed, ps, lim


# ------------------------------------------------------------------------------ balanced_split


def test_split_sums_to_total_and_equalises() -> None:
    fixed = [14 * GIB, 8 * GIB, 8 * GIB, 8 * GIB]
    split = balanced_split(total=64, fixed=fixed, per_sample=[1 * GIB] * 4, limits=[80 * GIB] * 4)
    assert split is not None and sum(split) == 64
    # Rank 0's 6 GiB extra is worth 6 samples: 10.5 + 18 + ... -> [12, 18, 17, 17] or similar.
    peaks = [f + GIB * m for f, m in zip(fixed, split, strict=True)]
    assert max(peaks) - min(peaks) <= 1 * GIB
    assert split[0] == min(split)


@pytest.mark.parametrize("world", [2, 3])
def test_split_is_optimal_against_brute_force(world: int) -> None:
    rng = random.Random(world)
    checked = infeasible = 0
    for _ in range(300):
        total, fixed, ps, lim = random_case(rng, world)
        best = brute_split(total, fixed, ps, lim)
        split = balanced_split(total=total, fixed=fixed, per_sample=ps, limits=lim)
        if best is None:
            assert split is None
            infeasible += 1
            continue
        assert split is not None and sum(split) == total and min(split) >= 1
        assert all(f + p * m <= li for m, f, p, li in zip(split, fixed, ps, lim, strict=True))
        assert max_rel(split, fixed, ps, lim) == pytest.approx(best, rel=1e-12)
        checked += 1
    assert checked > 100 and infeasible > 5


def test_split_respects_caps_and_heterogeneous_limits() -> None:
    # Same model on both ranks, rank 1 has half the usable memory: it gets about half the samples.
    split = balanced_split(total=30, fixed=[2.0, 1.0], per_sample=[1.0, 1.0], limits=[40.0, 20.0])
    assert split == [20, 10]
    # A tight cap on rank 0 pushes everything it cannot hold to rank 1.
    split = balanced_split(total=10, fixed=[5.0, 0.0], per_sample=[1.0, 1.0], limits=[7.0, 100.0])
    assert split is not None and split[0] <= 2 and sum(split) == 10


def test_split_none_when_nothing_fits() -> None:
    assert (
        balanced_split(total=10, fixed=[5.0, 5.0], per_sample=[1.0, 1.0], limits=[9.0, 9.0]) is None
    )
    assert (
        balanced_split(total=2, fixed=[5.0, 11.0], per_sample=[1.0, 1.0], limits=[100.0, 11.5])
        is None
    )
    assert balanced_split(total=8, fixed=[5.0, 5.0], per_sample=[1.0, 1.0], limits=[9.0, 9.0]) == [
        4,
        4,
    ]


def test_split_zero_per_sample_and_one_rank() -> None:
    assert balanced_split(total=5, fixed=[1.0], per_sample=[1.0], limits=[10.0]) == [5]
    split = balanced_split(total=10, fixed=[3.0, 1.0], per_sample=[0.0, 1.0], limits=[10.0, 10.0])
    assert split is not None and sum(split) == 10 and split[1] <= 2  # rank 1 stops at 3.0
    assert max_rel(split, [3.0, 1.0], [0.0, 1.0], [10.0, 10.0]) == pytest.approx(0.3)


def test_split_usage_errors() -> None:
    with pytest.raises(UsageError, match="total=1"):
        balanced_split(total=1, fixed=[0.0, 0.0], per_sample=[1.0, 1.0], limits=[1.0, 1.0])
    with pytest.raises(UsageError, match="per_sample has 1 entries"):
        balanced_split(total=4, fixed=[0.0, 0.0], per_sample=[1.0], limits=[1.0, 1.0])
    with pytest.raises(UsageError, match="limits="):
        balanced_split(total=4, fixed=[0.0, 0.0], per_sample=[1.0, 1.0], limits=[1.0, 0.0])
    with pytest.raises(UsageError, match="negative"):
        balanced_split(total=4, fixed=[0.0, 0.0], per_sample=[1.0, -1.0], limits=[1.0, 1.0])


# ------------------------------------------------------------------------- choose_checkpointing


def brute_plans(
    total: int, fixed: list[float], ps: list[float], sv: list[float], layers: int, lim: list[float]
) -> list[tuple[float, float, tuple[int, ...], tuple[int, ...]]]:
    """(step cost, spread, split, checkpoint counts) of every feasible combination."""
    world = len(fixed)
    out = []
    for split in splits(total, world):
        for ckpt in itertools.product(range(layers + 1), repeat=world):
            peaks = [
                f + m * (p - s * c / layers)
                for f, m, p, s, c in zip(fixed, split, ps, sv, ckpt, strict=True)
            ]
            if any(pk > li for pk, li in zip(peaks, lim, strict=True)):
                continue
            cost = max(m * (1 + RHO * c / layers) for m, c in zip(split, ckpt, strict=True)) / (
                total / world
            )
            out.append((cost, max(peaks) - min(peaks), split, ckpt))
    return out


class CkptCase(TypedDict):
    total: int
    fixed: list[float]
    per_sample: list[float]
    saved_per_sample: list[float]
    num_layers: int
    limits: list[float]


def random_ckpt_case(rng: random.Random, world: int) -> CkptCase:
    total, fixed, ps, lim = random_case(rng, world)
    return {
        "total": min(total, 8),
        "fixed": fixed,
        "per_sample": ps,
        "saved_per_sample": [p * rng.uniform(0, 0.9) for p in ps],
        "num_layers": rng.choice([1, 2, 3, 4]),
        "limits": [li * 0.6 for li in lim],
    }


def brute_case(case: CkptCase) -> list[tuple[float, float, tuple[int, ...], tuple[int, ...]]]:
    return brute_plans(
        case["total"],
        case["fixed"],
        case["per_sample"],
        case["saved_per_sample"],
        case["num_layers"],
        case["limits"],
    )


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("exhaustive", [True, False])
def test_checkpointing_min_step_cost_against_brute_force(world: int, exhaustive: bool) -> None:
    rng = random.Random(10 * world + exhaustive)
    checked = 0
    for _ in range(80):
        case = random_ckpt_case(rng, world)
        every = brute_case(case)
        plans = choose_checkpointing(**case, exhaustive_limit=10**9 if exhaustive else 0)
        if not every:
            assert plans == []
            continue
        checked += 1
        best_cost = min(e[0] for e in every)
        assert plans[0].step_cost == pytest.approx(best_cost, rel=1e-12)
        assert sum(plans[0].micro_batches) == case["total"]
        assert all(
            pk <= li for pk, li in zip(plans[0].predicted_peaks, case["limits"], strict=True)
        )
        if exhaustive:  # also exact on the spread among the fastest
            best_spread = min(e[1] for e in every if e[0] <= best_cost * (1 + 1e-12))
            assert plans[0].spread_bytes == pytest.approx(best_spread, rel=1e-9, abs=1e-12)
    assert checked > 25


@pytest.mark.parametrize("max_spread", [0.5, 2.0])
def test_checkpointing_spread_constraint_against_brute_force(max_spread: float) -> None:
    rng = random.Random(int(max_spread * 10))
    checked = 0
    for _ in range(80):
        case = random_ckpt_case(rng, 2)
        every = [e for e in brute_case(case) if e[1] <= max_spread]
        plans = choose_checkpointing(**case, max_spread_bytes=max_spread)
        if every:
            checked += 1
            assert plans[0].spread_bytes <= max_spread
            assert plans[0].step_cost == pytest.approx(min(e[0] for e in every), rel=1e-12)
        else:
            assert not plans or plans[0].spread_bytes > max_spread
    assert checked > 15


def gpt_like(cap_gib: float, *, total: int = 32) -> list[SplitPlan]:
    """Two ranks, rank 0 holds 6 GiB of extras; 1 GiB per sample, checkpointing saves 70 %."""
    return choose_checkpointing(
        total=total,
        fixed=[16 * GIB, 10 * GIB],
        per_sample=[1 * GIB, 1 * GIB],
        saved_per_sample=[0.7 * GIB, 0.7 * GIB],
        num_layers=24,
        limits=[cap_gib * GIB, cap_gib * GIB],
    )


def test_no_checkpointing_when_memory_is_ample() -> None:
    best = gpt_like(80)[0]
    assert best.micro_batches == [16, 16]
    assert best.checkpointed == [0, 0]
    assert best.step_cost == 1.0
    assert best.spread_bytes == pytest.approx(6 * GIB)


def test_rank_with_big_fixed_part_checkpoints_more_when_the_cap_forces_it() -> None:
    plans = gpt_like(30)
    best = plans[0]
    # The even split without checkpointing (32 GiB on rank 0) would not fit in 30 GiB.
    assert best.checkpointed[0] > best.checkpointed[1]
    assert best.micro_batches[0] >= 14  # it checkpoints instead of only shedding samples
    assert all(p <= 30 * GIB for p in best.predicted_peaks)
    assert sum(best.micro_batches) == 32
    # Shedding samples alone (the best split without checkpointing) is slower.
    no_ckpt = balanced_split(
        total=32, fixed=[16 * GIB, 10 * GIB], per_sample=[GIB, GIB], limits=[30 * GIB] * 2
    )
    assert no_ckpt == [13, 19]
    assert best.step_cost < max(no_ckpt) / 16
    # Candidates are distinct, best first, and never dominated in (step cost, spread).
    costs = [p.step_cost for p in plans]
    assert costs == sorted(costs)
    spreads = [p.spread_bytes for p in plans]
    assert spreads == sorted(spreads, reverse=True)


def test_spread_constraint_trades_step_time_for_evenness() -> None:
    plans = choose_checkpointing(
        total=32,
        fixed=[16 * GIB, 10 * GIB],
        per_sample=[1 * GIB, 1 * GIB],
        saved_per_sample=[0.7 * GIB, 0.7 * GIB],
        num_layers=24,
        limits=[80 * GIB, 80 * GIB],
        max_spread_bytes=0.5 * GIB,
    )
    best = plans[0]
    assert best.spread_bytes <= 0.5 * GIB
    assert best.step_cost > 1.0
    assert best.micro_batches[0] < best.micro_batches[1]


def test_checkpointing_nothing_fits_and_restricted_counts() -> None:
    assert gpt_like(17) == []  # even fully checkpointed, rank 0 holds 3 samples and rank 1 23
    plans = choose_checkpointing(
        total=32,
        fixed=[16 * GIB, 10 * GIB],
        per_sample=[1 * GIB, 1 * GIB],
        saved_per_sample=[0.7 * GIB, 0.7 * GIB],
        num_layers=24,
        limits=[28 * GIB, 28 * GIB],
        checkpoint_counts=[0, 12, 24],
    )
    assert plans and all(c in (0, 12, 24) for p in plans for c in p.checkpointed)


def test_sweep_handles_many_ranks_quickly() -> None:
    world = 8
    plans = choose_checkpointing(
        total=256,
        fixed=[30 * GIB] + [20 * GIB] * (world - 1),
        per_sample=[1.25 * GIB] * world,
        saved_per_sample=[0.875 * GIB] * world,
        num_layers=24,
        limits=[60 * GIB] * world,
        max_spread_bytes=0.5 * GIB,
    )
    best = plans[0]
    assert sum(best.micro_batches) == 256
    assert best.spread_bytes <= 0.5 * GIB
    assert best.checkpointed[0] == max(best.checkpointed)
    assert best.step_cost < 1.2


def test_checkpointing_usage_errors() -> None:
    base = functools.partial(
        choose_checkpointing,
        total=4,
        fixed=[0.0, 0.0],
        per_sample=[1.0, 1.0],
        num_layers=4,
        limits=[10.0, 10.0],
    )
    with pytest.raises(UsageError, match="saved_per_sample"):
        base(saved_per_sample=[2.0, 0.0])
    with pytest.raises(UsageError, match="checkpoint_counts"):
        base(saved_per_sample=[0.5, 0.5], checkpoint_counts=[5])


# ------------------------------------------------------------------------------- model helpers


def fitted_model() -> MemoryModel:
    layers = 24

    def peak(rank: int, mb: int, ckpt: int) -> float:
        return [16 * GIB, 10 * GIB][rank] + mb * (GIB - 0.7 * GIB * ckpt / layers)

    observations = [
        MemoryObservation(
            rank=r,
            micro_batch=mb,
            checkpointed=c,
            num_layers=layers,
            dtype="fp32",
            peak_bytes=peak(r, mb, c),
        )
        for r, mb, c in [(0, 4, 0), (1, 4, 0), (0, 8, 12), (1, 2, 24), (0, 1, 6), (1, 9, 3)]
    ]
    return MemoryModel.fit(observations, world_size=2)


def test_predict_feasible_uses_the_margin() -> None:
    model = fitted_model()
    ok, peaks = predict_feasible(
        model,
        micro_batches=[10, 10],
        checkpointed=[0, 0],
        num_layers=24,
        dtype="fp32",
        limits=[27 * GIB, 27 * GIB],
    )
    assert peaks == pytest.approx([26 * GIB, 20 * GIB])
    assert not ok  # 26 GiB * 1.05 > 27 GiB
    ok, _ = predict_feasible(
        model,
        micro_batches=[10, 10],
        checkpointed=[0, 0],
        num_layers=24,
        dtype="fp32",
        limits=[27 * GIB, 27 * GIB],
        margin=0.0,
    )
    assert ok
    config = BalanceConfig(
        micro_batches=[10, 10], global_batch=20, checkpoint=[list(range(24)), []]
    )
    ok, peaks = predict_config_feasible(model, config, num_layers=24, limits=[27 * GIB, 27 * GIB])
    assert ok and peaks[0] == pytest.approx(16 * GIB + 10 * 0.3 * GIB)


def test_model_helpers_plan_under_the_margin() -> None:
    model = fitted_model()
    split = balanced_split_for(
        model,
        total=32,
        checkpointed=[0, 0],
        num_layers=24,
        dtype="fp32",
        limits=[60 * GIB, 60 * GIB],
    )
    assert split == [13, 19]
    plans = plans_from_model(
        model, total=32, num_layers=24, dtype="fp32", limits=[29.4 * GIB, 29.4 * GIB]
    )
    best = plans[0]
    assert all(p * (1 + model.safety_margin) <= 29.4 * GIB for p in best.predicted_peaks)
    assert best.checkpointed[0] > best.checkpointed[1]
    ok, peaks = predict_feasible(
        model,
        micro_batches=best.micro_batches,
        checkpointed=best.checkpointed,
        num_layers=24,
        dtype="fp32",
        limits=[29.4 * GIB, 29.4 * GIB],
    )
    assert ok and peaks == pytest.approx(best.predicted_peaks)
