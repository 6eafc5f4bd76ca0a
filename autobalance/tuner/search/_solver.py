"""Balanced splits and per-rank checkpointing from a linear memory model (pure math, no torch).

Every rank ``r`` is described by a linear peak ``fixed_r + per_sample_r(c_r) * m_r`` where ``m_r`` is its
micro-batch and ``per_sample_r(c) = per_sample_r - saved_per_sample_r * c / num_layers`` for ``c`` checkpointed
blocks, and by a usable limit ``limit_r`` (capacity times one minus the headroom, divided by one plus the model's
safety margin where a model is involved). :func:`balanced_split` minimises ``max_r peak_r / limit_r`` exactly;
:func:`choose_checkpointing` chooses checkpoint counts and the split together.

Ranks of different speeds (mixed GPUs, issue 33): rank ``r`` computes for ``speed_r * m_r * (1 + rho * c_r / L)``,
``speed_r`` its relative cost per sample (2.0: half as fast). Synchronous DDP steps at the slowest rank, so the
minimum step cost makes the ranks finish together: without memory limits or checkpointing ``m_r`` is proportional
to ``1 / speed_r``, and a rank whose memory limit binds first takes what fits while the others share the rest by
speed. Without ``speeds`` (or all equal) ``speed_r = 1``: the same plans.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from autobalance._config import BalanceConfig
from autobalance._errors import UsageError
from autobalance._files import is_int
from autobalance.tuner.search._constants import DEFAULT_RECOMPUTE_FRACTION
from autobalance.tuner.search._memory_model import MemoryModel


@dataclass(kw_only=True)
class SplitPlan:
    """One candidate: per-rank micro-batches and checkpoint counts with their predicted effect."""

    micro_batches: list[int]
    checkpointed: list[int]
    predicted_peaks: list[float]
    step_cost: float
    """Step-time proxy ``max_r speed_r * m_r * (1 + recompute_fraction * c_r / L)`` divided by
    ``total / W``: 1.0 is an even split of equal ranks without checkpointing."""
    spread_bytes: float
    """``max(predicted_peaks) - min(predicted_peaks)``."""


def balanced_split(*, total: int, fixed: Sequence[float], per_sample: Sequence[float],
                   limits: Sequence[float]) -> list[int] | None:
    """Integer micro-batches ``m_r >= 1`` summing to ``total`` that minimise
    ``max_r (fixed_r + per_sample_r * m_r) / limits_r`` subject to every peak ``<= limits_r``;
    None when no such split exists.

    Greedy: start from ``m_r = 1`` and give each further sample to the rank whose resulting relative peak is
    lowest. Optimal for the maximum: if the greedy ever gave a sample at a value above the optimum ``T*``, every
    rank's next value exceeded ``T*`` at that moment, so the optimal split has ``m*_r <= m_r`` on every rank and
    sums to less than ``total``, which is a contradiction. The same argument shows the greedy only stalls when no
    feasible split exists. Implemented as one stable sort of all ranks' (non-decreasing) next values.
    """
    _check_ranks(total=total, fixed=fixed, per_sample=per_sample, limits=limits)
    m = np.arange(1, total - len(limits) + 2, dtype=float)
    values = []
    for f, p, lim in zip(fixed, per_sample, limits, strict=True):
        peaks = f + p * m
        values.append(np.where(peaks <= lim, peaks / lim, np.inf))
    return _min_max_select(values, total)


def _min_max_select(values: list[np.ndarray], total: int) -> list[int] | None:
    """``values[r][m-1]`` = rank ``r``'s (non-decreasing) objective at micro-batch ``m``: the
    greedy's ``m`` (minimises the max; ties go to the lower rank), or None."""
    world = len(values)
    if any(not np.isfinite(v[0]) for v in values):
        return None
    extra = total - world
    if extra == 0:
        return [1] * world
    nexts = [v[1 : extra + 1][np.isfinite(v[1 : extra + 1])] for v in values]
    merged = np.concatenate(nexts)
    if merged.size < extra:
        return None
    owners = np.concatenate([np.full(n.size, rank) for rank, n in enumerate(nexts)])
    counts = np.bincount(owners[np.argsort(merged, kind="stable")[:extra]], minlength=world)
    return [1 + int(c) for c in counts]


def choose_checkpointing(*, total: int, fixed: Sequence[float], per_sample: Sequence[float],
                         saved_per_sample: Sequence[float], num_layers: int, limits: Sequence[float],
                         recompute_fraction: float = DEFAULT_RECOMPUTE_FRACTION,
                         max_spread_bytes: float | None = None, checkpoint_counts: Sequence[int] | None = None,
                         max_plans: int = 5, exhaustive_limit: int = 2_000_000,
                         speeds: Sequence[float] | None = None) -> list[SplitPlan]:
    """Per-rank checkpoint counts and micro-batches chosen together; candidates best first.

    Rank ``r`` with ``m`` samples and ``c`` checkpointed blocks peaks at
    ``fixed_r + m * (per_sample_r - saved_per_sample_r * c / num_layers)`` and computes for
    ``speeds[r] * m * (1 + recompute_fraction * c / num_layers)``.

    Order: feasible (every peak ``<= limits_r``); spread ``<= max_spread_bytes`` when given; then the lowest step
    cost; then the smallest spread; then the fewest checkpointed blocks. Only plans not dominated in (step cost,
    spread) are returned, at most ``max_plans``; ``[]`` when nothing fits.

    Method: with at most ``exhaustive_limit`` (split, checkpoint-vector) combinations (two ranks up to about 800
    samples with 48 blocks) all are scored: exact for every criterion. Otherwise a level sweep: the minimum step
    cost ``C*`` is found exactly (binary search over the finite set of values ``m * (1 + rho * c / L)``); at each
    cost level ``C`` from ``C*`` upward (256 levels, more while no plan meets ``max_spread_bytes``), the split
    minimising the largest relative peak under ``cost <= C`` is solved exactly (each rank checkpoints as much as
    ``C`` allows), then every rank drops to the fewest checkpointed blocks that keep its peak at or below that
    maximum, narrowing the spread. The sweep's first plan has the exact minimum step cost; its spread criteria are
    best effort (it equalises peaks relative to the limits, the spread is in bytes).
    """
    world = _check_ranks(total=total, fixed=fixed, per_sample=per_sample, limits=limits)
    _check_lengths(world, saved_per_sample=saved_per_sample)
    if any(not 0 <= s <= p for s, p in zip(saved_per_sample, per_sample, strict=True)):
        raise UsageError(f"saved_per_sample={saved_per_sample} is not within [0, per_sample] per "
                         "rank; checkpointing saves at most the per-sample bytes.")
    if not is_int(num_layers) or num_layers < 1:
        raise UsageError(f"num_layers={num_layers!r} is not a positive integer; pass the block count.")
    if not 0 <= recompute_fraction < math.inf:
        raise UsageError(f"recompute_fraction={recompute_fraction} is negative or not finite; use e.g. 1/3.")
    if max_plans < 1:
        raise UsageError(f"max_plans={max_plans} must be >= 1; use e.g. 5.")
    counts = sorted(set(range(num_layers + 1) if checkpoint_counts is None else checkpoint_counts))
    if not counts or counts[0] < 0 or counts[-1] > num_layers:
        raise UsageError(f"checkpoint_counts={list(checkpoint_counts or [])} is empty or outside "
                         f"0..{num_layers}; list allowed counts.")
    _check_lengths(world, speeds=speeds)
    if speeds is not None and not all(math.isfinite(float(s)) and float(s) > 0 for s in speeds):
        raise UsageError(f"speeds={list(speeds)} has an entry <= 0 or not finite; pass relative "
                         "costs per sample, e.g. [1.0, 2.0].")
    space = _Space(total=total, fixed=np.asarray(fixed, dtype=float),
                   per_sample=np.asarray(per_sample, dtype=float), saved=np.asarray(saved_per_sample, dtype=float),
                   limits=np.asarray(limits, dtype=float), counts=np.asarray(counts, dtype=float),
                   num_layers=num_layers, rho=recompute_fraction,
                   speed=np.ones(world) if speeds is None else np.asarray(speeds, dtype=float))
    if math.comb(total - 1, world - 1) * len(counts) ** world <= exhaustive_limit:
        plans = _exhaustive_plans(space)
    else:
        plans = _sweep_plans(space, max_spread_bytes=max_spread_bytes)
    front = _pareto(plans, scale=float(max(limits)))
    front.sort(key=lambda p: (max_spread_bytes is not None and p.spread_bytes > max_spread_bytes,
                              round(p.step_cost, 12), p.spread_bytes, sum(p.checkpointed), p.micro_batches))
    return front[:max_plans]


@dataclass(kw_only=True)
class _Space:
    """The solver's per-rank arrays (bytes), the allowed checkpoint counts (ascending) and the
    micro-batch values ``m`` with each count's cost factor ``k``."""

    total: int
    fixed: np.ndarray
    per_sample: np.ndarray
    saved: np.ndarray
    """Bytes per sample saved by checkpointing every block."""
    limits: np.ndarray
    counts: np.ndarray
    num_layers: int
    rho: float
    speed: np.ndarray

    def __post_init__(self) -> None:
        self.world = len(self.fixed)
        self.m = np.arange(1, self.total - self.world + 2, dtype=float)
        self.k = 1.0 + self.rho * self.counts / self.num_layers

    def peaks(self, rank: int, m: np.ndarray | float, counts: np.ndarray) -> np.ndarray:
        per = self.per_sample[rank] - self.saved[rank] * counts / self.num_layers
        return self.fixed[rank] + m * per

    def level_values(self, level: float) -> list[np.ndarray]:
        """Per rank, the relative peak at each ``m`` with the most checkpointing cost ``<= level``
        allows (inf when nothing fits)."""
        values = []
        for rank in range(self.world):
            within = np.outer(self.m, self.k) * self.speed[rank] <= level
            index = within.sum(axis=1) - 1  # k is non-decreasing: the largest count within it
            peaks = self.peaks(rank, self.m, self.counts[np.maximum(index, 0)])
            ok = (index >= 0) & (peaks <= self.limits[rank])
            values.append(np.where(ok, peaks / self.limits[rank], np.inf))
        return values

    def plan(self, split: Sequence[int], checkpointed: list[int], peaks: list[float]) -> SplitPlan:
        cost = max(m * (1.0 + self.rho * c / self.num_layers) * float(s)
                   for m, c, s in zip(split, checkpointed, self.speed, strict=True))
        return SplitPlan(micro_batches=list(split), checkpointed=checkpointed,
                         predicted_peaks=peaks, step_cost=cost / (self.total / self.world),
                         spread_bytes=max(peaks) - min(peaks))


def _plan_at_level(space: _Space, level: float) -> SplitPlan | None:
    values = space.level_values(level)
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
    return space.plan(split, checkpointed, peaks)


def _compositions(total: int, world: int) -> Iterator[tuple[int, ...]]:
    """Every split of ``total`` into ``world`` parts >= 1 (lexicographic): the parts between
    ``world - 1`` cut points."""
    for cuts in itertools.combinations(range(1, total), world - 1):
        yield tuple(b - a for a, b in zip((0, *cuts), (*cuts, total), strict=True))


def _exhaustive_plans(space: _Space) -> list[SplitPlan]:
    """For every split, the checkpoint vectors not dominated in (step cost, spread)."""
    plans: list[SplitPlan] = []
    for split in _compositions(space.total, space.world):
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


def _split_front(space: _Space, split: tuple[int, ...],
                 options: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list[SplitPlan]:
    axes = [np.arange(valid.size) for valid, _, _ in options]
    flat = [g.ravel() for g in np.meshgrid(*axes, indexing="ij")]
    peaks = np.stack([opt[1][i] for opt, i in zip(options, flat, strict=True)])
    costs = np.stack([opt[2][i] for opt, i in zip(options, flat, strict=True)])
    counts = np.stack([space.counts[opt[0][i]] for opt, i in zip(options, flat, strict=True)])
    cost = costs.max(axis=0)
    spread = peaks.max(axis=0) - peaks.min(axis=0)
    order = np.lexsort((counts.sum(axis=0), spread, cost))
    best = np.minimum.accumulate(spread[order])
    keep = order[np.concatenate(([True], best[1:] < best[:-1]))]
    return [space.plan(split, [int(c) for c in counts[:, j]], [float(p) for p in peaks[:, j]]) for j in keep]


def _sweep_plans(space: _Space, *, max_spread_bytes: float | None, max_levels: int = 256) -> list[SplitPlan]:
    costs = np.outer(space.m, space.k).ravel()
    levels = np.unique(np.concatenate([costs * s for s in space.speed]))

    def feasible(i: int) -> bool:
        return _min_max_select(space.level_values(float(levels[i])), space.total) is not None

    if not feasible(len(levels) - 1):
        return []
    first = bisect.bisect_left(range(len(levels) - 1), True, key=feasible)  # monotone in the level
    plans: list[SplitPlan] = []
    met = max_spread_bytes is None
    for index in range(first, min(len(levels), first + max_levels * 16)):
        if index >= first + max_levels and met:
            break
        plan = _plan_at_level(space, float(levels[index]))
        if plan is not None:
            plans.append(plan)
            met = met or plan.spread_bytes <= (max_spread_bytes or 0.0)
    return plans


def _pareto(plans: list[SplitPlan], *, scale: float) -> list[SplitPlan]:
    """Plans not dominated in (step cost, spread), one per distinct point (fewest checkpoints); compared after
    rounding (12 digits; spreads relative to ``scale``): float noise keeps no near-duplicates."""

    def point(p: SplitPlan) -> tuple[float, float]:
        return round(p.step_cost, 12), round(p.spread_bytes / scale, 12)

    front: list[SplitPlan] = []
    best_spread = math.inf
    for plan in sorted(plans, key=lambda p: (*point(p), sum(p.checkpointed), p.micro_batches)):
        if point(plan)[1] < best_spread:
            front.append(plan)
            best_spread = point(plan)[1]
    return front


def predict_feasible(model: MemoryModel, *, micro_batches: Sequence[int], checkpointed: Sequence[int],
                     num_layers: int, dtype: str, limits: Sequence[float], margin: float | None = None,
                     optimizer_shares: Sequence[float] | None = None) -> tuple[bool, list[float]]:
    """Predicted peak of each rank, and whether every ``peak * (1 + margin) <= limit`` (``margin``
    None: ``model.safety_margin``; ``optimizer_shares`` None: unsharded)."""
    _check_lengths(model.world_size, micro_batches=micro_batches, checkpointed=checkpointed, limits=limits)
    margin = _margin(model, margin)
    peaks = [model.predict(rank=r, micro_batch=m, checkpointed=c, num_layers=num_layers, dtype=dtype,
                           optimizer_share=None if optimizer_shares is None else optimizer_shares[r])
             for r, (m, c) in enumerate(zip(micro_batches, checkpointed, strict=True))]
    feasible = all(p * (1.0 + margin) <= lim for p, lim in zip(peaks, limits, strict=True))
    return feasible, peaks


def predict_config_feasible(model: MemoryModel, config: BalanceConfig, *, num_layers: int, limits: Sequence[float],
                            margin: float | None = None) -> tuple[bool, list[float]]:
    """:func:`predict_feasible` for a :class:`BalanceConfig` (checkpoint lists counted per rank)."""
    return predict_feasible(model, micro_batches=config.micro_batches,
                            checkpointed=[len(blocks) for blocks in config.checkpoint],
                            num_layers=num_layers, dtype=config.dtype, limits=limits, margin=margin,
                            optimizer_shares=config.sharding_shares())


def balanced_split_for(model: MemoryModel, *, total: int, checkpointed: Sequence[int], num_layers: int, dtype: str,
                       limits: Sequence[float], margin: float | None = None) -> list[int] | None:
    """:func:`balanced_split` with the model's terms for a fixed per-rank checkpoint choice,
    under ``limits / (1 + margin)``."""
    world = model.world_size
    _check_lengths(world, checkpointed=checkpointed)
    scaled = _margin_limits(model, limits, margin)
    return balanced_split(
        total=total, fixed=[model.fixed_bytes(r, dtype) for r in range(world)],
        per_sample=[max(0.0, model.per_sample_bytes(r, dtype, c, num_layers))
                    for r, c in enumerate(checkpointed)], limits=scaled)


def plans_from_model(model: MemoryModel, *, total: int, num_layers: int, dtype: str, limits: Sequence[float],
                     margin: float | None = None, recompute_fraction: float = DEFAULT_RECOMPUTE_FRACTION,
                     max_spread_bytes: float | None = None, checkpoint_counts: Sequence[int] | None = None,
                     max_plans: int = 5, speeds: Sequence[float] | None = None,
                     optimizer_shares: Sequence[float] | None = None) -> list[SplitPlan]:
    """:func:`choose_checkpointing` with the model's terms for ``dtype`` under ``limits / (1 +
    margin)``, each rank keeping its ``optimizer_shares`` of the optimizer state (None: all)."""
    world = model.world_size
    shares = [None] * world if optimizer_shares is None else list(optimizer_shares)
    full = [max(0.0, model.per_sample_bytes(r, dtype, 0, num_layers)) for r in range(world)]
    least = [model.per_sample_bytes(r, dtype, num_layers, num_layers) for r in range(world)]
    return choose_checkpointing(
        total=total, fixed=[model.fixed_bytes(r, dtype, shares[r]) for r in range(world)],
        per_sample=full,
        saved_per_sample=[min(f, max(0.0, f - lo)) for f, lo in zip(full, least, strict=True)],
        num_layers=num_layers, limits=_margin_limits(model, limits, margin),
        recompute_fraction=recompute_fraction, max_spread_bytes=max_spread_bytes,
        checkpoint_counts=checkpoint_counts, max_plans=max_plans, speeds=speeds)


def optimizer_shares(*, base: Sequence[float], state: float, limits: Sequence[float]) -> list[float]:
    """``zero1`` shares ``q_r >= 0`` (sum 1) of an optimizer state of ``state`` bytes that minimise
    ``max_r (base_r + state * q_r) / limits_r``, where ``base_r`` is rank ``r``'s predicted peak
    without optimizer state (its extras included).

    Water-filling: the optimum fills every rank to one relative level ``T``::

        q_r = max(0, T * limits_r - base_r) / state,   sum_r q_r = 1

    ``T`` is found exactly by sorting the ranks by ``base_r / limits_r`` (the level at which each starts taking
    state) and solving the linear equation on the first segment where the sum reaches 1. A rank already above the
    others' level (the one holding extras) gets less, or none. ``state <= 0``: even shares (nothing to place)."""
    world = len(base)
    if world == 0 or len(limits) != world or any(lim <= 0 for lim in limits):
        raise UsageError(f"base={list(base)} and limits={list(limits)} need one entry per rank and "
                         "positive limits.")
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


def neighbours(micro: list[int]) -> list[list[int]]:
    """Splits one sample away from ``micro`` (memory-balanced is not always fastest)."""
    return [[m - (r == a) + (r == b) for r, m in enumerate(micro)]
            for a, b in itertools.permutations(range(len(micro)), 2) if micro[a] > 1]


def _margin(model: MemoryModel, margin: float | None) -> float:
    margin = model.safety_margin if margin is None else margin
    if margin < 0:
        raise UsageError(f"margin={margin} is negative; use 0 or a small relative margin.")
    return margin


def _margin_limits(model: MemoryModel, limits: Sequence[float], margin: float | None) -> list[float]:
    margin = _margin(model, margin)
    _check_lengths(model.world_size, limits=limits)
    return [float(lim) / (1.0 + margin) for lim in limits]


def _check_lengths(world: int, **named: Sequence[float] | None) -> None:
    for name, values in named.items():
        if values is not None and len(values) != world:
            raise UsageError(f"{name} has {len(values)} entries for {world} ranks; give one per rank.")


def _check_ranks(*, total: int, fixed: Sequence[float], per_sample: Sequence[float],
                 limits: Sequence[float]) -> int:
    world = len(limits)
    if world == 0:
        raise UsageError("limits=[] is empty; give one usable memory limit per rank.")
    _check_lengths(world, fixed=fixed, per_sample=per_sample)
    if not is_int(total) or total < world:
        raise UsageError(f"total={total!r} is below the {world} ranks (or not an integer); every "
                         "rank needs >= 1 sample.")
    for name, values in (("fixed", fixed), ("per_sample", per_sample), ("limits", limits)):
        if not all(math.isfinite(float(v)) for v in values):
            raise UsageError(f"{name}={values} has a non-finite entry; pass byte counts.")
    if any(p < 0 for p in per_sample):
        raise UsageError(f"per_sample={per_sample} has a negative entry; bytes per sample are >= 0.")
    if any(lim <= 0 for lim in limits):
        raise UsageError(f"limits={limits} has an entry <= 0; pass usable bytes per rank.")
    return world
