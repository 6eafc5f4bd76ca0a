"""The candidates the models rank by predicted objective (what the ``model`` phase proposes from).

**Eager.** The memory model's eager proposals: for each dtype and accumulation, the balanced plans of the
solver (water-filling with per-rank checkpointing), the even split and its one-sample neighbours;
each kept when predicted to fit (and within the spread limit), scored by the predicted objective.

**Compiled.** Compiled proposals from the compiled model: per split, each rank's largest budget predicted to
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

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial

from autobalance._config import CUDA_GRAPH_MODES, BalanceConfig, split_evenly
from autobalance._errors import UsageError
from autobalance.tuner.search._compiled_model import CompiledMemoryModel
from autobalance.tuner.search._constants import CACHE_TIE, NEIGHBOUR_RANKS, SLOW_DTYPE
from autobalance.tuner.search._dominance import dominating_over_cap
from autobalance.tuner.search._memory_model import MemoryModel
from autobalance.tuner.search._model_errors import FIT_ERRORS, ModelErrors, caught
from autobalance.tuner.search._sharding import SavingModel
from autobalance.tuner.search._solver import (
    balanced_split,
    balanced_split_for,
    neighbours,
    optimizer_shares,
    plans_from_model,
    predict_config_feasible,
)
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

__all__ = ["CACHE_TIE", "DYNAMIC", "SLOW_DTYPE", "Candidate", "Score", "cache_order", "compiled_candidates", "compiled_graphs", "eager_candidates",
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
        ready = [g[4] for g in done if g[:4] == (dtype, mode, float(bucket), m) and g[4] <= top]
        for b in sorted(ready, reverse=True):
            if timing.recompute_factor(dtype, mode, b) <= timing.recompute_factor(dtype, mode, top) * (1.0 + CACHE_TIE):
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
        cost = [timing.recompute_factor(dtype, mode, b) for b in chosen]
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


# -------------------------------------------------------------------------------- eager candidates
Score = Callable[[BalanceConfig, list[float], float], "float | None"]
"""(configuration, predicted per-rank peaks, predicted step ms) -> predicted objective."""


def eager_candidates(*, space: SearchSpace, model: MemoryModel, timing: StepTimeModel, usable: list[float],
                     bucket: float, view: bool, max_spread: float | None, score: Score,
                     errors: ModelErrors | None = None, savings: SavingModel | None = None) -> list[Candidate]:
    """Eager configurations the memory model predicts to fit (its balanced plans per dtype and
    accumulation, the even split and its one-sample neighbours), scored by ``score``; a solver that
    fails on the model's figures gives no plan, noted in ``errors``. With ``savings`` (parameter sharding
    searched, ``_sharding``), the same for each sharding: the model's unsharded peaks less what the
    sharding saves on each rank (its plans solved against the usable memory plus that saving)."""
    out: list[Candidate] = []
    seen: set[str] = set()
    for mode in ["off", *([m for m in space.param_shardings if m != "off"] if savings is not None else [])]:
        out += _eager_candidates(space=space, model=model, timing=timing, usable=usable, bucket=bucket, view=view,
                                 max_spread=max_spread, score=score, errors=errors, seen=seen, mode=mode,
                                 savings=savings)
    return out


def _eager_candidates(*, space: SearchSpace, model: MemoryModel, timing: StepTimeModel, usable: list[float],
                      bucket: float, view: bool, max_spread: float | None, score: Score, errors: ModelErrors | None,
                      seen: set[str], mode: str, savings: SavingModel | None) -> list[Candidate]:
    """:func:`eager_candidates` for one ``param_sharding`` value."""
    layers = max(1, space.num_layers)
    world = space.world_size
    out: list[Candidate] = []
    sharded = mode != "off"

    def lift(dtype: str, acc: int) -> list[float]:
        """Per rank, what ``mode`` saves at ``acc`` micro-steps (0 unsharded)."""
        if not sharded or savings is None:
            return [0.0] * world
        probe = BalanceConfig.from_dict({"micro_batches": [1] * world, "accumulation": acc,
                                         "global_batch": world * acc, "dtype": dtype, "param_sharding": mode})
        return [savings.saving(probe, r) for r in range(world)]

    shard = "zero1" in space.shardings and model.can_shard and not sharded

    def consider(micro: list[int], counts: list[int], dtype: str, acc: int, zero: bool = False) -> None:
        # any split: the largest micro-batch per rank that fits; the ranks whose steps cost more
        # per sample (more recomputation) give up the samples beyond the global batch first
        cost = timing.sample_costs(counts, layers=layers)
        cfg = space.config_for(micro, acc, cost, checkpoint=[list(range(c)) for c in counts], dtype=dtype,
                                    bucket_cap_mb=bucket, gradient_as_bucket_view=view)
        if zero:  # zero1: the state water-filled over the ranks' peaks without it (solver.optimizer_shares)
            base = [model.predict(rank=r, micro_batch=cfg.micro_batches[r], checkpointed=counts[r],
                                  num_layers=layers, dtype=dtype, optimizer_share=0.0) for r in range(world)]
            shares = normalised_shares(optimizer_shares(base=base, state=model.optimizer_bytes(None), limits=usable))
            cfg = dataclasses.replace(cfg, optimizer_sharding="zero1", optimizer_shares=shares)
        if sharded:
            cfg = BalanceConfig.from_dict({**cfg.to_dict(), "param_sharding": mode})
        key = cfg.to_json()
        if key in seen or not space.contains(cfg):  # e.g. a split the space keeps fixed
            return
        seen.add(key)
        saved = lift(dtype, acc)
        fits, peaks = predict_config_feasible(model, cfg, num_layers=layers,
                                              limits=[u + s for u, s in zip(usable, saved, strict=True)])
        if not fits or model.config_clamped(cfg, num_layers=layers):
            return  # an impossible (clamped) prediction proposes nothing
        peaks = [p - s for p, s in zip(peaks, saved, strict=True)]
        if max_spread is not None and max(peaks) - min(peaks) > max_spread:
            return
        ms = timing.predict(cfg)
        value = None if ms is None else score(cfg, peaks, ms)
        if value is not None:
            out.append(Candidate(score=value, config=cfg, peaks=peaks, step_ms=ms,
                                 extrapolated=model.config_extrapolated(cfg, num_layers=layers)))

    for dtype in space.dtypes:
        if not model.can_predict(dtype) or (sharded and dtype == "fp16"):  # fp16: sharding refuses it
            continue
        for acc in space.accumulations:
            total = space.micro_total(acc)
            usable_now = [u + s for u, s in zip(usable, lift(dtype, acc), strict=True)]
            try:
                plans = plans_from_model(model, total=total, num_layers=layers, dtype=dtype, limits=usable_now,
                                         max_plans=5, recompute_fraction=timing.rho,
                                         max_spread_bytes=max_spread,
                                         checkpoint_counts=None if space.num_layers > 0 else [0],
                                         speeds=timing.speeds)
            except FIT_ERRORS as exc:
                caught(errors, "eager search", exc)
                plans = []
            for plan in plans:
                consider(list(plan.micro_batches), list(plan.checkpointed), dtype, acc)
            if shard:  # the same plans with the state placed where memory is left (less on the rank with extras)
                fixed0 = [model.fixed_bytes(r, dtype, 0.0) for r in range(world)]
                first = optimizer_shares(base=fixed0, state=model.optimizer_bytes(None), limits=usable_now)
                try:
                    zero_plans = plans_from_model(model, total=total, num_layers=layers, dtype=dtype, limits=usable_now,
                                                  max_plans=5, recompute_fraction=timing.rho,
                                                  max_spread_bytes=max_spread,
                                                  checkpoint_counts=None if space.num_layers > 0 else [0],
                                                  speeds=timing.speeds, optimizer_shares=first)
                except FIT_ERRORS as exc:
                    caught(errors, "eager search", exc)
                    zero_plans = []
                for plan in zero_plans:
                    consider(list(plan.micro_batches), list(plan.checkpointed), dtype, acc, zero=True)
            try:
                even = balanced_split_for(model, total=total, checkpointed=[0] * world, num_layers=layers,
                                          dtype=dtype, limits=usable_now)
            except FIT_ERRORS as exc:
                caught(errors, "eager search", exc)
                even = None
            if even is not None:
                for micro in (even, *neighbours(even)):
                    consider(micro, [0] * world, dtype, acc)
                    if shard:
                        consider(micro, [0] * world, dtype, acc, zero=True)
    return out
