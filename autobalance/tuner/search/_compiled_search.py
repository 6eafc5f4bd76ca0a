"""Compiled proposals from the compiled model: per split, each rank's largest budget predicted to
fit, scored by the predicted objective; ordered so that few new graphs are compiled.

For each (dtype, compile mode, accumulation) the splits tried are the even split, the splits that
balance the compiled peaks at budgets 1.0, 0.5 and the smallest one (the ranks' fixed parts differ:
rank 0 holds extras), and, with up to :data:`NEIGHBOUR_RANKS` ranks, their one-sample neighbours.
Each rank then takes the largest budget of the 0.05 grid predicted to fit - or a smaller one
already compiled for the same (dtype, mode, buckets, micro-batch) when its predicted recomputation
costs at most :data:`CACHE_TIE` more (the per-study Inductor cache then serves the graph). A
configuration that a launched trial dominates (it needs at least the memory of one that did not
fit) is never proposed, so never compiled.

**ZeRO-1** (``"zero1"`` searched and the eager model has measured the optimizer state ``S``): each
split also gets a ``zero1`` variant. Its shares water-fill the state over the ranks' compiled bounds
without it at budget 1.0 (:func:`optimizer_shares` with ``base_r = fixed_r(0) + m_r * act_r * f(1) *
(1 + extra(1))``, normalised by :func:`normalised_shares`): budget 1.0 because it is known before any
budget is chosen, and the unsharded budget may not exist (a rank that does not fit at any budget
unsharded is the case ZeRO-1 is for); the extras decide the shares either way. Each rank then takes
its largest budget with ``fixed_r(q_r) = fixed_r + S * q_r``. The splits are also balanced once more
on the fixed parts sharded by the state placed on the fixed parts alone (``base_r = fixed_r(0)``),
and those new splits get a ``zero1`` variant only. Dtypes the eager time model already knows to be
:data:`SLOW_DTYPE` times slower per sample than the fastest are not compiled at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial

from autobalance._config import CUDA_GRAPH_MODES, BalanceConfig, split_evenly
from autobalance._errors import UsageError
from autobalance.tuner.search._compiled_model import CompiledMemoryModel
from autobalance.tuner.search._constants import CACHE_TIE, NEIGHBOUR_RANKS, SLOW_DTYPE
from autobalance.tuner.search._dominance import dominating_over_cap
from autobalance.tuner.search._model_errors import FIT_ERRORS, ModelErrors, caught
from autobalance.tuner.search._solver import balanced_split, neighbours, optimizer_shares
from autobalance.tuner.search._space import (
    SearchSpace,
    compile_key,
    normalised_shares,
)
from autobalance.tuner.search._timing import (
    DYNAMIC,
    CompiledTimeModel,
    StepTimeModel,
    compiled_graphs,
    graph_keys,
)

__all__ = ["CACHE_TIE", "DYNAMIC", "SLOW_DTYPE", "Candidate", "cache_order", "compiled_candidates", "compiled_graphs",
           "graph_keys", "much_slower"]


@dataclass(kw_only=True)
class Candidate:
    """One proposal with what the models predict for it."""

    score: float
    """Predicted objective (lower is better)."""
    config: BalanceConfig
    """The configuration."""
    peaks: list[float]
    """Predicted peak bytes per rank."""
    step_ms: float | None
    """Predicted milliseconds per optimizer step."""
    new_graphs: int = 0
    """Graphs no launched trial of the study has compiled yet (0 for eager configurations)."""
    source: str = "memory-model"
    """``memory-model`` (eager) or ``compiled-model``."""
    extrapolated: bool = False
    """The memory prediction goes beyond the measured data (the trial line says so)."""


def much_slower(dtype: str, timing: StepTimeModel) -> bool:
    """Whether eager trials already measured ``dtype`` :data:`SLOW_DTYPE` times slower per sample."""
    if dtype not in timing.k or len(timing.k) < 2:
        return False
    return timing.k[dtype] > SLOW_DTYPE * min(timing.k.values())


def cache_order(candidates: list[Candidate]) -> list[Candidate]:
    """Best predicted objective first; among candidates within :data:`CACHE_TIE` of the best left,
    the one needing the fewest new graphs first."""
    left = sorted(candidates, key=lambda c: c.score)
    out: list[Candidate] = []
    while left:
        head = left[0].score
        tied = [c for c in left if c.score - head <= CACHE_TIE * max(abs(head), 1e-12)]
        pick = min(tied, key=lambda c: (c.new_graphs, c.score))
        out.append(pick)
        left.remove(pick)
    return out


def compiled_candidates(
    *, space: SearchSpace, trials: Sequence[FrozenTrial], memory: CompiledMemoryModel, timing: CompiledTimeModel,
    eager_timing: StepTimeModel, usable: list[float], bucket: float, view: bool, max_spread: float | None,
    score: Callable[[BalanceConfig, list[float], float], float | None], errors: ModelErrors | None = None,
) -> list[Candidate]:
    """Compiled configurations predicted to fit (module doc), unordered; a balanced split the
    solver fails on is left out, noted in ``errors``."""
    modes = [(compile_key(m, scope), m, scope) for m in space.compile_modes if m != "off"
             for scope in space.compile_scopes if scope == "whole" or m not in CUDA_GRAPH_MODES]
    if not modes:
        return []
    world = space.world_size
    done = compiled_graphs(trials)
    trial_list = list(trials)
    seen: set[str] = set()
    out: list[Candidate] = []
    budget_cache: dict[tuple[str, str, int, int, float | None], float | None] = {}
    shard = "zero1" in space.shardings and memory.eager.can_shard
    state = memory.eager.optimizer_bytes(None)

    def budget_for(rank: int, m: int, dtype: str, mode: str, share: float | None = None) -> float | None:
        key = (dtype, mode, rank, m, share)
        if key not in budget_cache:
            top = memory.largest_budget(rank=rank, micro_batch=m, dtype=dtype, mode=mode, limit=usable[rank],
                                        optimizer_share=share)
            budget_cache[key] = None if top is None else cached_budget(top, m, dtype, mode)
        return budget_cache[key]

    def cached_budget(top: float, m: int, dtype: str, mode: str) -> float:
        _, rho, _ = timing.params(dtype, mode)
        ready = [g[4] for g in done if g[:4] == (dtype, mode, float(bucket), m) and g[4] <= top]
        for b in sorted(ready, reverse=True):
            if (1.0 + rho * (1.0 - b)) <= (1.0 + rho * (1.0 - top)) * (1.0 + CACHE_TIE):
                return b
        return top

    def zero_shares(micro: list[int], dtype: str, mode: str) -> list[float]:
        """The state water-filled over the ranks' compiled bounds without it at budget 1.0."""
        curve = memory.curve(dtype, mode)
        act = curve.estimate(1.0) * (1.0 + curve.extra_margin(1.0))
        base = [memory.eager.fixed_bytes(r, dtype, 0.0) + m * memory.unit(r, dtype) * act
                for r, m in enumerate(micro)]
        return normalised_shares(optimizer_shares(base=base, state=state, limits=usable))

    def consider(micro: list[int], acc: int, dtype: str, target: tuple[str, str, str], zero: bool) -> None:
        mode, compile_mode, scope = target
        try:
            placed = zero_shares(micro, dtype, mode) if zero else None
        except FIT_ERRORS as exc:
            caught(errors, "compiled search", exc)
            return
        shares: list[float | None] = list(placed) if placed is not None else [None] * world
        budgets = [budget_for(r, m, dtype, mode, q) for r, (m, q) in enumerate(zip(micro, shares, strict=True))]
        if any(b is None for b in budgets):
            return
        chosen = [float(b) for b in budgets if b is not None]
        _, rho, _ = timing.params(dtype, mode)
        cost = [1.0 + rho * (1.0 - b) for b in chosen]
        sharding: dict[str, Any] = {} if placed is None else {"optimizer_sharding": "zero1", "optimizer_shares": placed}
        try:
            cfg = space.config_for(micro, acc, cost, checkpoint=[[] for _ in range(world)], dtype=dtype,
                                   bucket_cap_mb=bucket, gradient_as_bucket_view=view, compile=compile_mode,
                                   compile_scope=scope, activation_budget=chosen, **sharding)
        except (UsageError, ValueError):  # a split the space cannot hold (a fixed split, too few
            return                        # samples): a configuration refused, not a failed fit
        key = cfg.to_json()
        if key in seen or not space.contains(cfg):
            return
        seen.add(key)
        if dominating_over_cap(trial_list, cfg) is not None:
            return  # never compile what a launched trial proves cannot fit
        if memory.clamped(cfg):
            return  # an impossible prediction (below what a rank holds apart from activations): no proposal
        peaks = memory.config_peaks(cfg)
        if max_spread is not None and max(peaks) - min(peaks) > max_spread:
            return
        ms = timing.predict(cfg)
        value = None if ms is None else score(cfg, peaks, ms)
        if value is None:
            return
        out.append(Candidate(score=value, config=cfg, peaks=peaks, step_ms=ms,
                             new_graphs=len(graph_keys(cfg.to_dict()) - done), source="compiled-model",
                             extrapolated=memory.extrapolated(cfg)))

    for dtype in space.dtypes:
        if not memory.can_predict(dtype) or much_slower(dtype, eager_timing):
            continue
        for key in modes:
            mode = key[0]
            first = None  # zero1: the state placed by the fixed parts alone, to balance the splits with
            if shard:
                try:
                    first = optimizer_shares(base=[memory.eager.fixed_bytes(r, dtype, 0.0) for r in range(world)],
                                             state=state, limits=usable)
                except FIT_ERRORS as exc:
                    caught(errors, "compiled search", exc)
            for acc in space.accumulations:
                total = space.micro_total(acc)
                if total < world:
                    continue
                plain = _splits(memory, total=total, dtype=dtype, mode=mode, usable=usable, world=world,
                                errors=errors)
                for micro in plain:
                    consider(micro, acc, dtype, key, zero=False)
                    if shard:
                        consider(micro, acc, dtype, key, zero=True)
                if first is not None:
                    for micro in _splits(memory, total=total, dtype=dtype, mode=mode, usable=usable, world=world,
                                         errors=errors, shares=first):
                        if micro not in plain:
                            consider(micro, acc, dtype, key, zero=True)
    return out


def _splits(memory: CompiledMemoryModel, *, total: int, dtype: str, mode: str, usable: list[float],
            world: int, errors: ModelErrors | None = None, shares: list[float] | None = None) -> list[list[int]]:
    """The even split, the splits balancing compiled peaks at a few common budgets, and (few ranks)
    their one-sample neighbours; with ``shares``, the peaks of ``zero1`` with those shares (each rank's
    fixed part ``fixed_r(q_r)``), else unsharded."""
    bases = [split_evenly(total, [1.0] * world)]
    curve = memory.curve(dtype, mode)
    fixed = [memory.eager.fixed_bytes(r, dtype, None if shares is None else shares[r]) for r in range(world)]
    for budget in (1.0, 0.5, 0.05):
        per_sample = [memory.unit(r, dtype) * curve.estimate(budget) * (1.0 + curve.extra_margin(budget))
                      for r in range(world)]
        try:
            split = balanced_split(total=total, fixed=fixed,
                                   per_sample=per_sample, limits=[u / (1.0 + memory.safety_margin) for u in usable])
        except FIT_ERRORS as exc:
            caught(errors, "compiled search", exc)
            split = None
        if split is not None:
            bases.append(split)
    out: list[list[int]] = []
    for base in bases:
        for micro in (base, *(neighbours(base) if world <= NEIGHBOUR_RANKS else [])):
            if micro not in out:
                out.append(micro)
    return out
