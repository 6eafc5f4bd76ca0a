"""Balanced splits and per-rank checkpointing from a linear memory model (pure math, no torch).

Every rank ``r`` is described by a linear peak ``fixed_r + per_sample_r(c_r) * m_r`` where ``m_r``
is its micro-batch and ``per_sample_r(c) = per_sample_r - saved_per_sample_r * c / num_layers``
for ``c`` checkpointed blocks, and by a usable limit ``limit_r`` (capacity times one minus the
headroom, divided by one plus the model's safety margin where a model is involved).

* :func:`balanced_split` solves ``min max_r peak_r / limit_r`` over integer ``m_r >= 1`` summing
  to the global micro-batch total, exactly (a greedy proven optimal; see its docstring).
* :func:`choose_checkpointing` chooses checkpoint counts and the split together: minimum
  step-time proxy first, then the smallest spread of peaks.

Ranks of different speeds (mixed GPUs, issue 33): rank ``r`` computes for
``speed_r * m_r * (1 + rho * c_r / L)``, ``speed_r`` its relative cost per sample (measured from the
ranks' busy times by the step-time model; 2.0 is a rank half as fast). Synchronous DDP steps at the
slowest rank, so the minimum step cost makes the ranks finish together: without memory limits or
checkpointing ``m_r`` is proportional to ``1 / speed_r`` (rounded by the same exact greedy), and a
rank whose memory limit binds first takes what fits while the others share the rest by speed. With
``speeds`` left out (or all equal) every cost is the one above with ``speed_r = 1``: the same plans.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from autobalance._config import BalanceConfig
from autobalance._errors import UsageError
from autobalance.tuner.search._constants import DEFAULT_RECOMPUTE_FRACTION
from autobalance.tuner.search._memory_model import MemoryModel

__all__ = ["DEFAULT_RECOMPUTE_FRACTION", "SplitPlan", "balanced_split", "balanced_split_for",
           "choose_checkpointing", "neighbours", "optimizer_shares", "plans_from_model", "predict_config_feasible",
           "predict_feasible"]


@dataclass(kw_only=True)
class SplitPlan:
    """One candidate: per-rank micro-batches and checkpoint counts with their predicted effect."""

    micro_batches: list[int]
    """Micro-batch of each rank; they sum to the requested total."""
    checkpointed: list[int]
    """Number of checkpointed blocks of each rank."""
    num_layers: int
    """Number of checkpointable blocks of the model."""
    predicted_peaks: list[float]
    """Predicted peak bytes of each rank."""
    step_cost: float
    """Step-time proxy ``max_r m_r * (1 + recompute_fraction * c_r / L)`` divided by ``total / W``:
    1.0 is an even split without checkpointing."""
    spread_bytes: float
    """``max(predicted_peaks) - min(predicted_peaks)``."""
    max_relative_peak: float
    """Largest ``peak_r / limit_r`` (limits as given to the solver)."""

    def checkpoint_blocks(self) -> list[list[int]]:
        """Block indices per rank for :class:`BalanceConfig` (the first ``c_r`` blocks)."""
        return [list(range(c)) for c in self.checkpointed]

    def to_config(
        self,
        *,
        dtype: str,
        accumulation: int = 1,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = False,
    ) -> BalanceConfig:
        """This plan as a configuration (global batch = ``sum(micro_batches) * accumulation``)."""
        return BalanceConfig(
            micro_batches=list(self.micro_batches),
            accumulation=accumulation,
            global_batch=sum(self.micro_batches) * accumulation,
            checkpoint=self.checkpoint_blocks(),
            dtype=dtype,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )


# ----------------------------------------------------------------------------- balanced split


def balanced_split(
    *, total: int, fixed: Sequence[float], per_sample: Sequence[float], limits: Sequence[float]
) -> list[int] | None:
    """Integer micro-batches ``m_r >= 1`` summing to ``total`` that minimise
    ``max_r (fixed_r + per_sample_r * m_r) / limits_r`` subject to every peak ``<= limits_r``;
    None when no such split exists.

    Greedy: start from ``m_r = 1`` and give each further sample to the rank whose resulting
    relative peak is lowest. Optimal for the maximum: if the greedy ever gave a sample at a value
    above the optimum ``T*``, every rank's next value exceeded ``T*`` at that moment, so the
    optimal split has ``m*_r <= m_r`` on every rank and sums to less than ``total``, which is a
    contradiction. The same argument shows the greedy only stalls when no feasible split exists.
    Implemented as one stable sort of all ranks' (non-decreasing) next values.
    """
    world = _check_ranks(total=total, fixed=fixed, per_sample=per_sample, limits=limits)
    m = np.arange(1, total - world + 2, dtype=float)
    values = []
    for f, p, lim in zip(fixed, per_sample, limits, strict=True):
        peaks = f + p * m
        values.append(np.where(peaks <= lim, peaks / lim, np.inf))
    return _min_max_select(values, total)


def _min_max_select(values: list[np.ndarray], total: int) -> list[int] | None:
    """``values[r][m-1]`` = rank ``r``'s (non-decreasing) objective at micro-batch ``m``.

    Returns the greedy's ``m`` (minimises the max; ties go to the lower rank) or None.
    """
    world = len(values)
    if any(not np.isfinite(v[0]) for v in values):
        return None
    extra = total - world
    if extra == 0:
        return [1] * world
    nexts, owners = [], []
    for rank, v in enumerate(values):
        finite = v[1 : extra + 1]
        finite = finite[np.isfinite(finite)]
        nexts.append(finite)
        owners.append(np.full(finite.size, rank))
    merged = np.concatenate(nexts)
    if merged.size < extra:
        return None
    order = np.argsort(merged, kind="stable")[:extra]
    counts = np.bincount(np.concatenate(owners)[order], minlength=world)
    return [1 + int(c) for c in counts]


# ----------------------------------------------------------------------- joint checkpointing


def choose_checkpointing(
    *,
    total: int,
    fixed: Sequence[float],
    per_sample: Sequence[float],
    saved_per_sample: Sequence[float],
    num_layers: int,
    limits: Sequence[float],
    recompute_fraction: float = DEFAULT_RECOMPUTE_FRACTION,
    max_spread_bytes: float | None = None,
    checkpoint_counts: Sequence[int] | None = None,
    max_plans: int = 5,
    max_levels: int = 256,
    exhaustive_limit: int = 2_000_000,
    speeds: Sequence[float] | None = None,
) -> list[SplitPlan]:
    """Per-rank checkpoint counts and micro-batches chosen together; candidates best first.

    Rank ``r`` with ``m`` samples and ``c`` checkpointed blocks peaks at
    ``fixed_r + m * (per_sample_r - saved_per_sample_r * c / num_layers)`` and computes for
    ``speeds[r] * m * (1 + recompute_fraction * c / num_layers)`` (``speeds``: each rank's relative
    cost per sample, default 1 on every rank; see the module docstring); synchronous DDP steps at
    the slowest rank.

    Order: feasible (every peak ``<= limits_r``); spread ``<= max_spread_bytes`` when given; then
    the lowest step cost; then the smallest spread; then the fewest checkpointed blocks. Only
    plans not dominated in (step cost, spread) are returned, at most ``max_plans``; ``[]`` when
    nothing fits.

    Method: when there are at most ``exhaustive_limit`` (split, checkpoint-vector) combinations
    (two ranks up to about 800 samples with 48 blocks), all of them are scored, so the result is
    exact for every criterion, ``max_spread_bytes`` included. Otherwise a level sweep: the minimum
    step cost ``C*`` is found exactly (binary search over the finite set of values
    ``m * (1 + rho * c / L)`` with an exact capacity test); at each cost level ``C`` from ``C*``
    upward (``max_levels`` levels, more while no plan meets ``max_spread_bytes``), the split
    minimising the largest relative peak under ``cost <= C`` is solved exactly (each rank
    checkpoints as much as ``C`` allows), then every rank drops to the fewest checkpointed blocks
    that keep its peak at or below that maximum, which lifts low peaks and narrows the spread.
    The sweep's first plan has the exact minimum step cost; its spread criteria are best effort
    (it equalises peaks relative to the limits, the spread is in bytes: the same for equal limits).
    Either way, ranks with less free memory checkpoint more instead of only taking fewer samples.
    """
    world = _check_ranks(total=total, fixed=fixed, per_sample=per_sample, limits=limits)
    _check_saved(saved_per_sample, per_sample)
    if not isinstance(num_layers, int) or num_layers < 1:
        raise UsageError(
            f"num_layers={num_layers!r} is not a positive integer; pass the block count."
        )
    if not 0 <= recompute_fraction < math.inf:
        raise UsageError(
            f"recompute_fraction={recompute_fraction} is negative or not finite; use e.g. 1/3."
        )
    if max_plans < 1 or max_levels < 1:
        raise UsageError(
            f"max_plans={max_plans}, max_levels={max_levels} must be >= 1; use e.g. 5 and 256."
        )
    counts = _check_counts(checkpoint_counts, num_layers)
    speed = _check_speeds(speeds, world)
    space = _Space(
        total=total,
        fixed=np.asarray(fixed, dtype=float),
        per_sample=np.asarray(per_sample, dtype=float),
        saved=np.asarray(saved_per_sample, dtype=float),
        limits=np.asarray(limits, dtype=float),
        counts=counts,
        num_layers=num_layers,
        rho=recompute_fraction,
        speed=speed,
    )
    if _combinations(total, world, len(counts)) <= exhaustive_limit:
        plans = _exhaustive_plans(space, world)
    else:
        plans = _sweep_plans(space, world, max_spread_bytes=max_spread_bytes, max_levels=max_levels)
    front = _pareto(plans, scale=float(max(limits)))
    front.sort(key=lambda p: _rank_key(p, max_spread_bytes))
    return front[:max_plans]


@dataclass(kw_only=True)
class _Space:
    """The solver's arrays: micro-batch values ``m`` and allowed checkpoint counts with their cost factor."""

    total: int
    """Global micro-batch total."""
    fixed: np.ndarray
    """Per-rank fixed bytes."""
    per_sample: np.ndarray
    """Per-rank bytes per sample without checkpointing."""
    saved: np.ndarray
    """Per-rank bytes per sample saved by checkpointing every block."""
    limits: np.ndarray
    """Per-rank usable limits."""
    counts: np.ndarray
    """Allowed checkpoint counts, ascending."""
    num_layers: int
    """Number of blocks."""
    rho: float
    """Recompute fraction."""
    speed: np.ndarray
    """Per-rank relative cost per sample (ones: equally fast ranks)."""

    def __post_init__(self) -> None:
        self.m = np.arange(1, self.total - len(self.fixed) + 2, dtype=float)
        self.k = 1.0 + self.rho * self.counts / self.num_layers

    def peaks(self, rank: int, m: np.ndarray | float, counts: np.ndarray) -> np.ndarray:
        per = self.per_sample[rank] - self.saved[rank] * counts / self.num_layers
        return self.fixed[rank] + m * per

    def level_values(self, level: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per rank, the relative peak at each ``m`` with the most checkpointing cost ``<= level``
        allows (inf when nothing fits), and that checkpoint-count index per ``m`` (-1: none)."""
        values, indices = [], []
        for rank in range(len(self.fixed)):
            within = np.outer(self.m, self.k) * self.speed[rank] <= level
            index = within.sum(axis=1) - 1  # k is non-decreasing: the largest count within the level
            chosen = self.counts[np.maximum(index, 0)]
            indices.append(index)
            peaks = self.peaks(rank, self.m, chosen)
            ok = (index >= 0) & (peaks <= self.limits[rank])
            values.append(np.where(ok, peaks / self.limits[rank], np.inf))
        return values, indices


def _first_feasible_level(space: _Space, levels: np.ndarray) -> int | None:
    def feasible(i: int) -> bool:
        values, _ = space.level_values(float(levels[i]))
        return _min_max_select(values, space.total) is not None

    if not feasible(len(levels) - 1):
        return None
    lo, hi = 0, len(levels) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _plan_at_level(space: _Space, level: float, world: int) -> SplitPlan | None:
    values, _ = space.level_values(level)
    split = _min_max_select(values, space.total)
    if split is None:
        return None
    top = max(float(values[r][m - 1]) for r, m in enumerate(split))
    checkpointed, peaks = [], []
    for rank, m in enumerate(split):
        c_peaks = space.peaks(rank, np.float64(m), space.counts)
        ok = (m * space.k * space.speed[rank] <= level) & (c_peaks <= space.limits[rank])
        ok &= c_peaks / space.limits[rank] <= top
        j = int(np.argmax(ok))  # fewest checkpointed blocks that keep the peak <= the top
        checkpointed.append(int(space.counts[j]))
        peaks.append(float(c_peaks[j]))
    return _make_plan(space, split, checkpointed, peaks, world)


def _combinations(total: int, world: int, choices: int) -> int:
    """Number of (split, checkpoint-vector) pairs the exhaustive search would score."""
    return math.comb(total - 1, world - 1) * choices**world


def _compositions(total: int, world: int) -> Iterator[tuple[int, ...]]:
    """Every split of ``total`` into ``world`` parts >= 1."""
    if world == 1:
        yield (total,)
        return
    for first in range(1, total - world + 2):
        for rest in _compositions(total - first, world - 1):
            yield (first, *rest)


def _exhaustive_plans(space: _Space, world: int) -> list[SplitPlan]:
    """For every split, the checkpoint vectors not dominated in (step cost, spread)."""
    plans: list[SplitPlan] = []
    for split in _compositions(space.total, world):
        options = []
        for rank, m in enumerate(split):
            peaks = space.peaks(rank, np.float64(m), space.counts)
            valid = np.flatnonzero(peaks <= space.limits[rank])
            if valid.size == 0:
                break
            options.append((valid, peaks[valid], m * space.k[valid] * space.speed[rank]))
        else:
            plans.extend(_split_front(space, split, options))
    return plans


def _split_front(
    space: _Space, split: tuple[int, ...], options: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
) -> list[SplitPlan]:
    world = len(split)
    grids = np.meshgrid(*[np.arange(valid.size) for valid, _, _ in options], indexing="ij")
    flat = [g.ravel() for g in grids]
    peaks = np.stack([opt[1][i] for opt, i in zip(options, flat, strict=True)])
    costs = np.stack([opt[2][i] for opt, i in zip(options, flat, strict=True)])
    counts = np.stack([space.counts[opt[0][i]] for opt, i in zip(options, flat, strict=True)])
    cost = costs.max(axis=0)
    spread = peaks.max(axis=0) - peaks.min(axis=0)
    order = np.lexsort((counts.sum(axis=0), spread, cost))
    best = np.minimum.accumulate(spread[order])
    keep = order[np.concatenate(([True], best[1:] < best[:-1]))]
    return [
        _make_plan(
            space,
            list(split),
            [int(c) for c in counts[:, j]],
            [float(p) for p in peaks[:, j]],
            world,
        )
        for j in keep
    ]


def _sweep_plans(
    space: _Space, world: int, *, max_spread_bytes: float | None, max_levels: int
) -> list[SplitPlan]:
    levels = np.unique(np.concatenate([np.outer(space.m, space.k).ravel() * s for s in space.speed]))
    first = _first_feasible_level(space, levels)
    if first is None:
        return []
    plans: list[SplitPlan] = []
    met = max_spread_bytes is None
    for index in range(first, min(len(levels), first + max_levels * 16)):
        if index >= first + max_levels and met:
            break
        plan = _plan_at_level(space, float(levels[index]), world)
        if plan is not None:
            plans.append(plan)
            met = met or plan.spread_bytes <= (max_spread_bytes or 0.0)
    return plans


def _make_plan(
    space: _Space, split: list[int], checkpointed: list[int], peaks: list[float], world: int
) -> SplitPlan:
    costs = [
        m * (1.0 + space.rho * c / space.num_layers) * float(s)
        for m, c, s in zip(split, checkpointed, space.speed, strict=True)
    ]
    return SplitPlan(
        micro_batches=split,
        checkpointed=checkpointed,
        num_layers=space.num_layers,
        predicted_peaks=peaks,
        step_cost=max(costs) / (space.total / world),
        spread_bytes=max(peaks) - min(peaks),
        max_relative_peak=max(p / float(lim) for p, lim in zip(peaks, space.limits, strict=True)),
    )


def _pareto(plans: list[SplitPlan], *, scale: float) -> list[SplitPlan]:
    """Plans not dominated in (step cost, spread), one per distinct point (fewest checkpoints).

    Costs and spreads are compared after rounding (12 digits; spreads relative to ``scale``) so
    that float noise does not keep near-duplicates."""

    def point(p: SplitPlan) -> tuple[float, float]:
        return round(p.step_cost, 12), round(p.spread_bytes / scale, 12)

    front: list[SplitPlan] = []
    best_spread = math.inf
    for plan in sorted(plans, key=lambda p: (*point(p), sum(p.checkpointed), p.micro_batches)):
        if point(plan)[1] < best_spread:
            front.append(plan)
            best_spread = point(plan)[1]
    return front


def _rank_key(
    plan: SplitPlan, max_spread_bytes: float | None
) -> tuple[bool, float, float, int, list[int]]:
    violates = max_spread_bytes is not None and plan.spread_bytes > max_spread_bytes
    return (
        violates,
        round(plan.step_cost, 12),
        plan.spread_bytes,
        sum(plan.checkpointed),
        plan.micro_batches,
    )


# ------------------------------------------------------------------------------ model helpers


def predict_feasible(
    model: MemoryModel,
    *,
    micro_batches: Sequence[int],
    checkpointed: Sequence[int],
    num_layers: int,
    dtype: str,
    limits: Sequence[float],
    margin: float | None = None,
    optimizer_shares: Sequence[float] | None = None,
) -> tuple[bool, list[float]]:
    """Predicted peak of each rank, and whether every ``peak * (1 + margin) <= limit``
    (``margin`` defaults to ``model.safety_margin``; ``optimizer_shares``: ``zero1``'s, None: unsharded)."""
    world = model.world_size
    for name, values in (
        ("micro_batches", micro_batches),
        ("checkpointed", checkpointed),
        ("limits", limits),
    ):
        if len(values) != world:
            raise UsageError(
                f"{name} has {len(values)} entries for {world} ranks; give one per rank."
            )
    margin = model.safety_margin if margin is None else margin
    if margin < 0:
        raise UsageError(f"margin={margin} is negative; use 0 or a small relative margin.")
    peaks = [
        model.predict(rank=r, micro_batch=m, checkpointed=c, num_layers=num_layers, dtype=dtype,
                      optimizer_share=None if optimizer_shares is None else optimizer_shares[r])
        for r, (m, c) in enumerate(zip(micro_batches, checkpointed, strict=True))
    ]
    feasible = all(p * (1.0 + margin) <= lim for p, lim in zip(peaks, limits, strict=True))
    return feasible, peaks


def predict_config_feasible(
    model: MemoryModel,
    config: BalanceConfig,
    *,
    num_layers: int,
    limits: Sequence[float],
    margin: float | None = None,
) -> tuple[bool, list[float]]:
    """:func:`predict_feasible` for a :class:`BalanceConfig` (checkpoint lists counted per rank)."""
    return predict_feasible(
        model,
        micro_batches=config.micro_batches,
        checkpointed=[len(blocks) for blocks in config.checkpoint],
        num_layers=num_layers,
        dtype=config.dtype,
        limits=limits,
        margin=margin,
        optimizer_shares=config.sharding_shares(),
    )


def balanced_split_for(
    model: MemoryModel,
    *,
    total: int,
    checkpointed: Sequence[int],
    num_layers: int,
    dtype: str,
    limits: Sequence[float],
    margin: float | None = None,
) -> list[int] | None:
    """:func:`balanced_split` with the model's terms for a fixed per-rank checkpoint choice,
    under ``limits / (1 + margin)``."""
    world = model.world_size
    if len(checkpointed) != world:
        raise UsageError(
            f"checkpointed has {len(checkpointed)} entries for {world} ranks; give one per rank."
        )
    scaled = _margin_limits(model, limits, margin)
    return balanced_split(
        total=total,
        fixed=[model.fixed_bytes(r, dtype) for r in range(world)],
        per_sample=[
            max(0.0, model.per_sample_bytes(r, dtype, c, num_layers))
            for r, c in enumerate(checkpointed)
        ],
        limits=scaled,
    )


def plans_from_model(
    model: MemoryModel,
    *,
    total: int,
    num_layers: int,
    dtype: str,
    limits: Sequence[float],
    margin: float | None = None,
    recompute_fraction: float = DEFAULT_RECOMPUTE_FRACTION,
    max_spread_bytes: float | None = None,
    checkpoint_counts: Sequence[int] | None = None,
    max_plans: int = 5,
    speeds: Sequence[float] | None = None,
    optimizer_shares: Sequence[float] | None = None,
) -> list[SplitPlan]:
    """:func:`choose_checkpointing` with the model's terms for ``dtype`` under
    ``limits / (1 + margin)`` (``max_relative_peak`` is relative to those reduced limits);
    ``optimizer_shares``: each rank keeps that share of the optimizer state (``zero1``; None: all)."""
    world = model.world_size
    shares = [None] * world if optimizer_shares is None else list(optimizer_shares)
    full = [max(0.0, model.per_sample_bytes(r, dtype, 0, num_layers)) for r in range(world)]
    least = [model.per_sample_bytes(r, dtype, num_layers, num_layers) for r in range(world)]
    return choose_checkpointing(
        total=total,
        fixed=[model.fixed_bytes(r, dtype, shares[r]) for r in range(world)],
        per_sample=full,
        saved_per_sample=[min(f, max(0.0, f - lo)) for f, lo in zip(full, least, strict=True)],
        num_layers=num_layers,
        limits=_margin_limits(model, limits, margin),
        recompute_fraction=recompute_fraction,
        max_spread_bytes=max_spread_bytes,
        checkpoint_counts=checkpoint_counts,
        max_plans=max_plans,
        speeds=speeds,
    )


def optimizer_shares(*, base: Sequence[float], state: float, limits: Sequence[float]) -> list[float]:
    """``zero1`` shares ``q_r >= 0`` (sum 1) of an optimizer state of ``state`` bytes that minimise
    ``max_r (base_r + state * q_r) / limits_r``, where ``base_r`` is rank ``r``'s predicted peak
    without optimizer state (its extras included).

    Water-filling: the optimum fills every rank to one relative level ``T``::

        q_r = max(0, T * limits_r - base_r) / state,   sum_r q_r = 1

    ``T`` is found exactly by sorting the ranks by ``base_r / limits_r`` (the level at which each
    starts taking state) and solving the linear equation on the first segment where the sum reaches 1.
    A rank already above the others' level (the one holding extras) gets less, or none. ``state <= 0``:
    even shares (nothing to place)."""
    world = len(base)
    if world == 0 or len(limits) != world or any(lim <= 0 for lim in limits):
        raise UsageError(f"base={list(base)} and limits={list(limits)} need one entry per rank and positive limits.")
    if state <= 0:
        return [1.0 / world] * world
    order = sorted(range(world), key=lambda r: base[r] / limits[r])
    level = 0.0
    for k in range(1, world + 1):
        active = order[:k]
        # sum over active (T * L_r - b_r) = state  ->  T = (state + sum b) / sum L
        level = (state + sum(base[r] for r in active)) / sum(limits[r] for r in active)
        if k == world or level <= base[order[k]] / limits[order[k]]:
            break
    raw = [max(0.0, level * limits[r] - base[r]) for r in range(world)]
    total = sum(raw)
    return [q / total for q in raw]


# --------------------------------------------------------------------------------- validation


def _margin_limits(
    model: MemoryModel, limits: Sequence[float], margin: float | None
) -> list[float]:
    margin = model.safety_margin if margin is None else margin
    if margin < 0:
        raise UsageError(f"margin={margin} is negative; use 0 or a small relative margin.")
    if len(limits) != model.world_size:
        raise UsageError(
            f"limits has {len(limits)} entries for {model.world_size} ranks; give one per rank."
        )
    return [float(lim) / (1.0 + margin) for lim in limits]


def _check_ranks(
    *, total: int, fixed: Sequence[float], per_sample: Sequence[float], limits: Sequence[float]
) -> int:
    world = len(limits)
    if world == 0:
        raise UsageError("limits=[] is empty; give one usable memory limit per rank.")
    for name, values in (("fixed", fixed), ("per_sample", per_sample)):
        if len(values) != world:
            raise UsageError(
                f"{name} has {len(values)} entries for {world} ranks; give one per rank."
            )
    if not isinstance(total, int) or isinstance(total, bool) or total < world:
        raise UsageError(
            f"total={total!r} is below the {world} ranks (or not an integer); every rank needs >= 1 sample."
        )
    for name, values in (("fixed", fixed), ("per_sample", per_sample), ("limits", limits)):
        if not all(math.isfinite(float(v)) for v in values):
            raise UsageError(f"{name}={values} has a non-finite entry; pass byte counts.")
    if any(p < 0 for p in per_sample):
        raise UsageError(
            f"per_sample={per_sample} has a negative entry; bytes per sample are >= 0."
        )
    if any(lim <= 0 for lim in limits):
        raise UsageError(f"limits={limits} has an entry <= 0; pass usable bytes per rank.")
    return world


def _check_saved(saved: Sequence[float], per_sample: Sequence[float]) -> None:
    if len(saved) != len(per_sample):
        raise UsageError(
            f"saved_per_sample has {len(saved)} entries for {len(per_sample)} ranks; give one per rank."
        )
    if any(not 0 <= s <= p for s, p in zip(saved, per_sample, strict=True)):
        raise UsageError(
            f"saved_per_sample={saved} is not within [0, per_sample] per rank; checkpointing saves at "
            "most the per-sample bytes."
        )


def _check_speeds(speeds: Sequence[float] | None, world: int) -> np.ndarray:
    if speeds is None:
        return np.ones(world)
    if len(speeds) != world:
        raise UsageError(f"speeds has {len(speeds)} entries for {world} ranks; give one per rank.")
    if not all(math.isfinite(float(s)) and float(s) > 0 for s in speeds):
        raise UsageError(f"speeds={list(speeds)} has an entry <= 0 or not finite; pass relative costs per "
                         "sample, e.g. [1.0, 2.0].")
    return np.asarray(speeds, dtype=float)


def _check_counts(counts: Sequence[int] | None, num_layers: int) -> np.ndarray:
    if counts is None:
        return np.arange(num_layers + 1, dtype=float)
    chosen = sorted(set(counts))
    if not chosen or chosen[0] < 0 or chosen[-1] > num_layers:
        raise UsageError(
            f"checkpoint_counts={list(counts)} is empty or outside 0..{num_layers}; list allowed counts."
        )
    return np.asarray(chosen, dtype=float)


def neighbours(micro: list[int]) -> list[list[int]]:
    """Splits one sample away from ``micro`` (memory-balanced is not always fastest)."""
    out = []
    for a in range(len(micro)):
        for b in range(len(micro)):
            if a != b and micro[a] > 1:
                moved = list(micro)
                moved[a] -= 1
                moved[b] += 1
                out.append(moved)
    return out
