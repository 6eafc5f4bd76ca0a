"""The memory model's eager proposals: for each dtype and accumulation, the balanced plans of the
solver (water-filling with per-rank checkpointing), the even split and its one-sample neighbours;
each kept when predicted to fit (and within the spread limit), scored by the predicted objective."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from autobalance._config import BalanceConfig
from autobalance.tuner.search._compiled_search import Candidate
from autobalance.tuner.search._memory_model import MemoryModel
from autobalance.tuner.search._model_errors import FIT_ERRORS, ModelErrors, caught
from autobalance.tuner.search._sharding import SavingModel
from autobalance.tuner.search._solver import (
    balanced_split_for,
    neighbours,
    optimizer_shares,
    plans_from_model,
    predict_config_feasible,
)
from autobalance.tuner.search._space import SearchSpace, normalised_shares
from autobalance.tuner.search._timing import StepTimeModel

__all__ = ["Score", "eager_candidates"]

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
        speeds = timing.speeds or [1.0] * world
        cost = [(1.0 + timing.rho * c / layers) * s for c, s in zip(counts, speeds, strict=True)]
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
