"""Dominance: a configuration that needs at least as much memory, on some rank, as a launched
trial that did not fit there will not fit either. Model-free (monotonicity only)."""

from __future__ import annotations

from typing import Any

from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance.protocol import MEASURED_STATUSES, Status, TrialAttr
from autobalance.tuner.search._sharding import sharding_level

__all__ = ["activation_budget", "dominating_over_cap"]

_SHARE_TOL = 1e-9
"""Cumulative shares this close are the same boundary (sums of 4-decimal shares in floating point)."""


def activation_budget(cfg: dict[str, Any], rank: int) -> float:
    """Rank ``rank``'s compile activation budget in ``cfg`` (1.0: none set, everything kept)."""
    budgets = cfg.get("activation_budget")
    return 1.0 if not budgets else float(budgets[rank])


def _ranks_over_cap(t: FrozenTrial) -> list[int] | None:
    """Ranks whose memory did not fit in trial ``t``; [] when it fit; None when it ran out of memory
    but the rank is unknown (then only a configuration that dominates it on every rank is implied)."""
    peaks = t.user_attrs.get(TrialAttr.PEAK_DEVICE_GIB) or []
    usable = t.user_attrs.get(TrialAttr.USABLE_GIB) or []
    over = {r for r, (p, u) in enumerate(zip(peaks, usable, strict=False)) if p is not None and u and p > u}
    if t.user_attrs.get(TrialAttr.STATUS) == Status.OOM:
        if t.user_attrs.get(TrialAttr.FAILING_RANK) is not None:
            over.add(int(t.user_attrs[TrialAttr.FAILING_RANK]))
        if not over:
            return None
    return sorted(over)


def _needs_at_least(cfg: dict[str, Any], other: dict[str, Any], rank: int) -> bool:
    """Rank ``rank`` of ``cfg`` holds at least the memory it held under ``other``: same dtype and
    compile mode and scope, a micro-batch no smaller, no more recomputation (checkpointing the first N blocks,
    or a compile budget: a larger budget keeps more activations), buckets no smaller, not views
    where ``other`` used views, and at least ``other``'s optimizer state (``zero1``: its run of the
    parameters contains ``other``'s; unsharded: all of it). Accumulation does not change a rank's peak."""
    if (cfg["dtype"] != other["dtype"] or cfg.get("compile", "off") != other.get("compile", "off")
            or cfg.get("compile_scope", "whole") != other.get("compile_scope", "whole")):
        return False
    return (cfg["micro_batches"][rank] >= other["micro_batches"][rank]
            and len(cfg["checkpoint"][rank]) <= len(other["checkpoint"][rank])
            and activation_budget(cfg, rank) >= activation_budget(other, rank)
            and float(cfg["bucket_cap_mb"]) >= float(other["bucket_cap_mb"])
            and (not cfg["gradient_as_bucket_view"] or bool(other["gradient_as_bucket_view"]))
            and _holds_state_of(cfg, other, rank)
            and _holds_parameters_of(cfg, other))


def _holds_parameters_of(cfg: dict[str, Any], other: dict[str, Any]) -> bool:
    """``cfg`` shards no more parameters than ``other`` (off < embeddings < blocks; at the same sharding,
    keeping at least the groups ``other`` keeps gathered): each rank holds at least as much of them."""
    mine, theirs = sharding_level(cfg.get("param_sharding", "off")), sharding_level(other.get("param_sharding", "off"))
    if mine != theirs:
        return mine < theirs
    return set(cfg.get("keep_gathered", [])) >= set(other.get("keep_gathered", []))


def _state_run(cfg: dict[str, Any], rank: int) -> tuple[float, float]:
    """Rank ``rank``'s run of the optimizer state in ``cfg``, as cumulative fractions of the parameter
    bytes: ``(sum(q[:r]), sum(q[:r+1]))`` of its ``zero1`` shares (even when not given); ``(0, 1)``
    unsharded (the whole state)."""
    if cfg.get("optimizer_sharding", "off") == "off":
        return 0.0, 1.0
    world = len(cfg["micro_batches"])
    shares = cfg.get("optimizer_shares") or [1.0 / world] * world
    return float(sum(shares[:rank])), float(sum(shares[:rank + 1]))


def _holds_state_of(cfg: dict[str, Any], other: dict[str, Any], rank: int) -> bool:
    """Rank ``rank`` keeps at least the optimizer state it kept under ``other``: its run of the
    parameters contains ``other``'s. The partition (``runtime._zero.partition``) puts each boundary at
    the whole parameter closest to its cumulative share, monotone in it, so a run whose cumulative
    bounds enclose another's owns every parameter that one owns (a larger share alone does not: with
    three ranks or more the run may lie elsewhere in the parameter order)."""
    low, high = _state_run(cfg, rank)
    other_low, other_high = _state_run(other, rank)
    return low <= other_low + _SHARE_TOL and high >= other_high - _SHARE_TOL


def dominating_over_cap(trials: list[FrozenTrial], config: BalanceConfig) -> tuple[FrozenTrial, int] | None:
    """A launched trial that did not fit on some rank where ``config`` needs at least as much memory
    (so ``config`` will not fit either), with that rank; None when there is none. Model-free: it
    needs only monotonicity, so it covers compiled configurations, which the memory model does not."""
    cfg = config.to_dict()
    for t in trials:
        other = t.user_attrs.get(TrialAttr.CONFIG)
        if (t.state != TrialState.COMPLETE or t.user_attrs.get(TrialAttr.STATUS) not in MEASURED_STATUSES or not other
                or t.user_attrs.get(TrialAttr.REUSED_FROM) is not None or len(other["micro_batches"]) != config.world_size):
            continue
        over = _ranks_over_cap(t)
        if over is None:
            if all(_needs_at_least(cfg, other, r) for r in range(config.world_size)):
                return t, int(t.user_attrs.get(TrialAttr.FAILING_RANK) or 0)
            continue
        for r in over:
            if _needs_at_least(cfg, other, r):
                return t, r
    return None
