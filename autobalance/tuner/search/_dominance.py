"""What cannot fit, said before launching (the vetoes; recorded as ``predicted_oom``).

Dominance, model-free (monotonicity only): a configuration that needs at least as much memory, on
some rank, as a launched trial that did not fit there will not fit either
(:func:`dominating_over_cap`). The memory models where they are confident (:func:`model_veto`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance.protocol import GIB, MEASURED_STATUSES, Status, TrialAttr, memory_text
from autobalance.tuner.search._constants import SHARE_TOL
from autobalance.tuner.search._memory_model import DEFAULT_SAFETY_MARGIN
from autobalance.tuner.search._objective import TrialFigures
from autobalance.tuner.search._sharding import sharding_level
from autobalance.tuner.search._solver import predict_config_feasible
from autobalance.tuner.search._space import config_compile_key

if TYPE_CHECKING:
    from autobalance.tuner.search._compiled_model import CompiledMemoryModel
    from autobalance.tuner.search._memory_model import MemoryModel

__all__ = ["activation_budget", "dominance_veto", "dominating_over_cap", "model_veto"]

Veto = tuple[TrialFigures, dict[str, Any]]


def activation_budget(cfg: dict[str, Any], rank: int) -> float:
    """Rank ``rank``'s compile activation budget in ``cfg`` (1.0: none set, everything kept)."""
    budgets = cfg.get("activation_budget")
    return 1.0 if not budgets else float(budgets[rank])


def _ranks_over_cap(t: FrozenTrial) -> list[int] | None:
    """Ranks whose memory did not fit in trial ``t``; [] when it fit; None when it ran out of memory
    but the rank is unknown (then only a configuration dominating it on every rank is implied)."""
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
    """Rank ``rank`` of ``cfg`` holds at least the memory it held under ``other``: every term below no
    smaller (at one sharding level, at least the groups ``other`` keeps gathered). Accumulation changes no peak."""
    mine, theirs = (sharding_level(c.get("param_sharding", "off")) for c in (cfg, other))
    return (cfg["dtype"] == other["dtype"] and cfg.get("compile", "off") == other.get("compile", "off")
            and cfg.get("compile_scope", "whole") == other.get("compile_scope", "whole")
            and cfg["micro_batches"][rank] >= other["micro_batches"][rank]
            and len(cfg["checkpoint"][rank]) <= len(other["checkpoint"][rank])
            and activation_budget(cfg, rank) >= activation_budget(other, rank)
            and float(cfg["bucket_cap_mb"]) >= float(other["bucket_cap_mb"])
            and (not cfg["gradient_as_bucket_view"] or bool(other["gradient_as_bucket_view"]))
            and _holds_state_of(cfg, other, rank)
            and (mine < theirs if mine != theirs
                 else set(cfg.get("keep_gathered", [])) >= set(other.get("keep_gathered", []))))


def _holds_state_of(cfg: dict[str, Any], other: dict[str, Any], rank: int) -> bool:
    """Rank ``rank``'s run of the optimizer state (cumulative fractions; all of it unsharded) encloses its run
    under ``other``: the partition (``runtime._zero.partition``) is monotone in the cumulative shares, so it owns
    every parameter that one owns (a larger share alone does not, from three ranks on)."""
    def run(c: dict[str, Any]) -> tuple[float, float]:
        if c.get("optimizer_sharding", "off") == "off":
            return 0.0, 1.0
        world = len(c["micro_batches"])
        shares = c.get("optimizer_shares") or [1.0 / world] * world
        return float(sum(shares[:rank])), float(sum(shares[:rank + 1]))
    (low, high), (other_low, other_high) = run(cfg), run(other)
    return low <= other_low + SHARE_TOL and high >= other_high - SHARE_TOL


def dominating_over_cap(trials: list[FrozenTrial], config: BalanceConfig) -> tuple[FrozenTrial, int] | None:
    """A launched trial that did not fit on some rank where ``config`` needs at least as much
    memory, with that rank; None when there is none. Model-free: it covers compiled ones too."""
    cfg = config.to_dict()
    for t in trials:
        other = t.user_attrs.get(TrialAttr.CONFIG)
        if (t.state != TrialState.COMPLETE or not other
                or t.user_attrs.get(TrialAttr.STATUS) not in MEASURED_STATUSES
                or t.user_attrs.get(TrialAttr.REUSED_FROM) is not None
                or len(other["micro_batches"]) != config.world_size):
            continue
        over = _ranks_over_cap(t)
        if over is None and all(_needs_at_least(cfg, other, r) for r in range(config.world_size)):
            return t, int(t.user_attrs.get(TrialAttr.FAILING_RANK) or 0)
        if (rank := next((r for r in over or [] if _needs_at_least(cfg, other, r)), None)) is not None:
            return t, rank
    return None


def _predicted_oom(peaks: list[float | None], *, usable: list[float], headroom: float, **attrs: Any) -> Veto:
    """A trial recorded as ``predicted_oom`` without launching; ``attrs``: who predicted it and why."""
    n = len(peaks)
    figures = TrialFigures(status=Status.PREDICTED_OOM, peak_device=peaks, peak_allocated=[None] * n,
                           peak_reserved=[None] * n, outside_pytorch=[None] * n, step_time_s=None,
                           samples_per_s=None, startup_s=None, capacity=[u / (1.0 - headroom) for u in usable])
    return figures, {**figures.user_attrs(headroom), "status": Status.PREDICTED_OOM, "predicted": True,
                     **attrs, "baseline": False}


def model_veto(model: MemoryModel, compiled: CompiledMemoryModel | None, config: BalanceConfig, *,
               usable: list[float], headroom: float, num_layers: int) -> Veto | bool | None:
    """The memory models' verdict on ``config``: its ``predicted_oom`` figures when a rank will not fit, True when
    it is predicted to fit, None when they cannot say. Compiled: a rank (whose eager fixed part the memory model
    is sure of) that the compiled model's measured budgets prove cannot fit."""
    layers = max(1, num_layers)
    if config.compile != "off":
        if compiled is None or not model.can_predict(config.dtype):
            return None
        budgets = config.activation_budget or [1.0] * config.world_size
        own = config.sharding_shares()  # zero1: each rank's share of the state (None: unsharded)
        shares: list[float | None] = [None] * config.world_size if own is None else list(own)
        for rank, (m, b) in enumerate(zip(config.micro_batches, budgets, strict=True)):
            common: dict[str, Any] = {"rank": rank, "micro_batch": m, "dtype": config.dtype}
            if not model.is_confident(**common, checkpointed=0, num_layers=layers):
                continue
            common.update(mode=config_compile_key(config), limit=usable[rank], optimizer_share=shares[rank])
            low, why = compiled.surely_over(budget=b, **common), "the compiled model's measured budgets put"
            if low is None:  # not even the least any budget keeps fits (a tiny budget does not save it)
                low, why = compiled.over_at_any_budget(**common), "at any budget the compiled model predicts"
            if low is None:
                continue
            return _predicted_oom(
                [low if r == rank else None for r in range(len(usable))], usable=usable, headroom=headroom,
                predicted_by="compiled-model", reason=(
                    f"not launched (not compiled): {why} rank {rank} at least at {memory_text(low / GIB)} "
                    f"with micro-batch {m}, budget {b:g} (+{100 * compiled.safety_margin:.0f}% margin) > usable "
                    f"{memory_text(usable[rank] / GIB)}"))
        return True
    if config.param_sharding != "off":  # the model is of unsharded memory (dominance still vetoes)
        return None
    if not model.can_predict(config.dtype) or not all(
            model.is_confident(rank=r, micro_batch=m, checkpointed=len(c), num_layers=layers, dtype=config.dtype)
            for r, (m, c) in enumerate(zip(config.micro_batches, config.checkpoint, strict=True))):
        return None
    # at the default margin, not the self-widened one the proposals use: a widened margin (up to 50 %) vetoed
    # configurations that fit (issue 41: predicted 9.28 MiB +50 % > 12.2 MiB usable, measured 9.2-10.0 MiB)
    feasible, peaks = predict_config_feasible(model, config, num_layers=layers, limits=usable,
                                              margin=DEFAULT_SAFETY_MARGIN)
    if feasible:
        return True
    worst = max(range(len(peaks)), key=lambda r: peaks[r] / usable[r])
    return _predicted_oom(list(peaks), usable=usable, headroom=headroom, predicted_by="memory-model", reason=(
        f"not launched: the memory model predicts rank {worst} at {memory_text(peaks[worst] / GIB)} "
        f"(+{100 * DEFAULT_SAFETY_MARGIN:.0f}% margin) > usable {memory_text(usable[worst] / GIB)}"))


def dominance_veto(config: BalanceConfig, trial: FrozenTrial, rank: int, *, usable: list[float],
                   headroom: float) -> Veto:
    """The figures of ``config``, dominated on ``rank`` by launched ``trial`` that did not fit."""
    seen = (trial.user_attrs.get(TrialAttr.PEAK_DEVICE_GIB) or [None] * config.world_size)[rank]
    other = trial.user_attrs[TrialAttr.CONFIG]
    what = (f"budget {activation_budget(other, rank):g}" if other.get("compile", "off") != "off"
            else f"{len(other['checkpoint'][rank])} checkpointed blocks")
    peak = None if seen is None else float(seen) * GIB  # a lower bound: it needs at least that
    return _predicted_oom(
        [peak if r == rank else None for r in range(len(usable))], usable=usable, headroom=headroom,
        predicted_by="dominance", dominated_by=trial.number, reason=(
            f"not launched: trial {trial.number} exceeded rank {rank}'s usable memory "
            f"({memory_text(usable[rank] / GIB)}) with micro-batch {other['micro_batches'][rank]}, {what}; "
            "this configuration needs at least as much there (same dtype and compile mode, no smaller "
            "micro-batch, no more recomputation, no smaller bucket)"))
