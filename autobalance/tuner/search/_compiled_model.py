"""A model of compiled configurations: per-rank peak memory as a function of the micro-batch and the per-rank
activation budget, per (dtype, compile mode), fitted from few trials.

Rank ``r`` with micro-batch ``m``, budget ``b`` and ``zero1`` share ``q`` (1: unsharded) peaks at::

    peak_r(m, b, q) = fixed_r + S * q + m * act_r * f(b)

``fixed_r``, ``S`` (the optimizer state; 0 while the eager model has not measured it) and ``act_r`` (one sample's
activations without checkpointing) come from the eager :class:`MemoryModel`: a compiled graph holds the same weights
and state, only its activations follow the budget. ``f(b)``, the share of the eager activations the partitioner
keeps, is fitted per pair: each rank of a trial gives a point ``y = (peak - fixed_r - S * q_r) / (m * act_r)``
(clipped at 0; out of memory, a lower bound at its capacity). The min-cut knapsack makes ``f`` monotone but
stepwise, so the fit is the *least monotone upper envelope* ``F_j = max`` of the points at budgets ``<= b_j``,
linear between measured budgets; outside them the partitioner's rule (it keeps about ``b`` times its default):
``F_1 * max(b / b_1, LOW_BUDGET_FLOOR)`` below (it cannot drop the graphs' inputs, nor a loss outside the model and
its logits), ``max(F_n, min(max(F_n, 1), F_n * b / b_n))`` above. A pair without trials borrows its scope's other
pairs' points; without any, ``f(b) = max(b, FLOOR_PRIOR)``.

At an unmeasured ``b`` the activation part gets ``UNMEASURED_MARGIN / sqrt(1 + knots)`` more (all of it without own
knots) and the whole peak the self-correcting safety margin: a configuration fits when
``(fixed_r + S * q + m * act_r * f(b) * (1 + extra)) * (1 + margin) <= limit_r``. It surely does not when even ``F``
at the largest measured ``b_j <= b`` (``surely_over``) or ``f(0.05)`` (``over_at_any_budget``) exceeds
``limit_r * (1 + margin)``.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance._errors import UsageError
from autobalance.protocol import GIB, MEASURED_STATUSES, Status, TrialAttr
from autobalance.tuner.search._constants import (
    DEFAULT_SAFETY_MARGIN,
    FLOOR_PRIOR,
    LOW_BUDGET_FLOOR,
    MAX_MARGIN,
    UNMEASURED_MARGIN,
)
from autobalance.tuner.search._constants import MIN_SAMPLE_BYTES as _TINY
from autobalance.tuner.search._memory_model import MemoryModel, below_floor, widen_margin
from autobalance.tuner.search._space import (
    BUDGET_RANGE,
    BUDGET_STEP,
    REGIONAL_KEY,
    config_compile_key,
)

__all__ = ["UNMEASURED_MARGIN", "BudgetCurve", "CompiledMemoryModel", "CompiledObservation", "budget_grid",
           "compiled_observations", "measured_peaks"]


def budget_grid() -> list[float]:
    """The search space's budgets, largest first (1.0, 0.95, ..., 0.05)."""
    low, high = BUDGET_RANGE
    n = round((high - low) / BUDGET_STEP)
    return [round(high - i * BUDGET_STEP, 3) for i in range(n + 1)]


Pair = tuple[str, str]
"""(dtype, compile mode)."""


@dataclass(kw_only=True)
class CompiledObservation:
    """One rank's measured peak in one compiled trial (its largest micro-batch, its budget, its
    ``zero1`` share: None unsharded); not ``ok`` (out of memory), the peak is a lower bound."""

    rank: int
    micro_batch: int
    budget: float
    dtype: str
    mode: str
    peak_bytes: float
    ok: bool = True
    trial: int = -1
    """Number of the trial (held-out errors leave whole trials out)."""
    optimizer_share: float | None = None


@dataclass(kw_only=True)
class BudgetCurve:
    """``f(b)`` of one (dtype, mode): the least monotone upper envelope of its points (module doc)."""

    budgets: list[float]
    """Measured budgets, ascending."""
    fractions: list[float]
    """``F_j``: the envelope at each measured budget (non-decreasing)."""
    exact: list[bool]
    """Whether a rank that fitted was measured at that budget (else only lower bounds)."""
    borrowed: bool = False
    """The points are other pairs' (this pair has no compiled trial of its own)."""

    @classmethod
    def from_points(cls, points: Sequence[tuple[float, float, bool]], *, borrowed: bool = False) -> BudgetCurve:
        """``points``: ``(budget, fraction, exact)``; an inexact point is a lower bound."""
        by_budget: dict[float, tuple[float, bool]] = {}
        for b, y, exact in points:
            key = round(float(b), 6)
            old = by_budget.get(key, (0.0, False))
            by_budget[key] = (max(old[0], max(0.0, float(y))), old[1] or exact)
        budgets = sorted(by_budget)
        fractions = list(accumulate((by_budget[b][0] for b in budgets), max))
        return cls(budgets=budgets, fractions=fractions, exact=[by_budget[b][1] for b in budgets], borrowed=borrowed)

    def estimate(self, budget: float) -> float:
        """``f(budget)``: interpolated between measured budgets, the partitioner's rule outside."""
        if not self.budgets:
            return max(0.0, budget, FLOOR_PRIOR)
        b = float(budget)
        first_b, first_f = self.budgets[0], self.fractions[0]
        last_b, last_f = self.budgets[-1], self.fractions[-1]
        if b <= first_b:
            return first_f * max(b / first_b, LOW_BUDGET_FLOOR) if first_b > 0 else first_f
        if b >= last_b:
            return max(last_f, min(max(last_f, 1.0), last_f * b / last_b))
        i = bisect_left(self.budgets, b)  # budgets[i - 1] < b <= budgets[i]
        (b0, b1), (f0, f1) = self.budgets[i - 1:i + 1], self.fractions[i - 1:i + 1]
        return f0 + (f1 - f0) * (b - b0) / (b1 - b0)

    def lower(self, budget: float) -> float:
        """A lower bound of ``f(budget)`` (monotone): the envelope at the largest measured budget <= it, 0 below."""
        i = bisect_right(self.budgets, budget + 1e-9)
        return self.fractions[i - 1] if i else 0.0

    def measured(self, budget: float) -> bool:
        """Whether a rank that fitted was measured at exactly this budget."""
        return any(abs(b - budget) < 1e-6 and e for b, e in zip(self.budgets, self.exact, strict=True))

    def extra_margin(self, budget: float) -> float:
        """The activation part's extra margin at ``budget`` (module doc)."""
        if self.borrowed or not self.budgets:
            return UNMEASURED_MARGIN
        return 0.0 if self.measured(budget) else UNMEASURED_MARGIN / math.sqrt(1 + len(self.budgets))


@dataclass(kw_only=True)
class CompiledMemoryModel:
    """Per-rank compiled peaks from the eager model's fixed part and per-pair budget curves."""

    eager: MemoryModel
    num_layers: int
    """Blocks of the model (for the eager model's queries)."""
    curves: dict[Pair, BudgetCurve] = field(default_factory=dict)
    """Fitted curves of the pairs with compiled trials."""
    pooled_by_scope: dict[bool, BudgetCurve] = field(default_factory=dict)
    """Per scope (True: regional), its pairs' points together: what a pair of that scope without
    trials borrows (never the other scope's: a scope's fractions say little of the other's)."""
    safety_margin: float = DEFAULT_SAFETY_MARGIN
    """Relative margin on the whole peak (widened by :meth:`correct`, to :data:`MAX_MARGIN`)."""
    corrections: int = 0
    """How many times the margin was widened."""

    @classmethod
    def fit(cls, observations: Sequence[CompiledObservation], *, eager: MemoryModel, num_layers: int,
            safety_margin: float | None = None) -> CompiledMemoryModel:
        model = cls(eager=eager, num_layers=max(1, num_layers),
                    safety_margin=eager.safety_margin if safety_margin is None else safety_margin)
        points: dict[Pair, list[tuple[float, float, bool]]] = {}
        for o in observations:
            if not 0 <= o.rank < eager.world_size or o.micro_batch < 1 or not eager.can_predict(o.dtype):
                continue
            points.setdefault((o.dtype, o.mode), []).append((o.budget, model.fraction(o), o.ok))
        model.curves = {pair: BudgetCurve.from_points(p) for pair, p in points.items()}
        for regional in (False, True):
            every = [p for pair, group in points.items() if pair[1].endswith(REGIONAL_KEY) == regional for p in group]
            if every:
                model.pooled_by_scope[regional] = BudgetCurve.from_points(every, borrowed=True)
        return model

    def unit(self, rank: int, dtype: str) -> float:
        """``act_r``: eager activation bytes of one sample without checkpointing (at least 1 byte)."""
        return max(_TINY, self.eager.per_sample_bytes(rank, dtype, 0, self.num_layers))

    def fraction(self, o: CompiledObservation) -> float:
        """The observation's point ``(peak - fixed_r(q_r)) / (m * act_r)``, clipped at 0."""
        fixed = self.eager.fixed_bytes(o.rank, o.dtype, o.optimizer_share)
        return max(0.0, (o.peak_bytes - fixed) / (o.micro_batch * self.unit(o.rank, o.dtype)))

    def curve(self, dtype: str, mode: str) -> BudgetCurve:
        """The pair's own curve, else its scope's pooled (borrowed) one, else the prior."""
        if (own := self.curves.get((dtype, mode))) is not None:
            return own
        pooled = self.pooled_by_scope.get(mode.endswith(REGIONAL_KEY))
        return pooled if pooled is not None else BudgetCurve(budgets=[], fractions=[], exact=[], borrowed=True)

    def _line(self, rank: int, m: int, dtype: str, share: float | None, fraction: float) -> float:
        """``fixed_r + S * q + m * act_r * fraction``."""
        return self.eager.fixed_bytes(rank, dtype, share) + m * self.unit(rank, dtype) * fraction

    def predict(self, *, rank: int, micro_batch: int, budget: float, dtype: str, mode: str,
                optimizer_share: float | None = None) -> float:
        """Estimated peak bytes (no margin), at least the eager model's ``floor_bytes``."""
        line = self._line(rank, micro_batch, dtype, optimizer_share, self.curve(dtype, mode).estimate(budget))
        return max(line, self.eager.floor_bytes(rank, optimizer_share))

    def clamped(self, config: BalanceConfig) -> bool:
        """True when a rank's prediction is impossible as fitted (:func:`below_floor` of the eager
        floor) or built on an eager per-sample term at or below zero: the search proposes nothing."""
        mode = config_compile_key(config)
        return any(self._clamped(r, m, b, config.dtype, mode, q) for r, m, b, q in self._ranks(config))

    def _clamped(self, rank: int, m: int, budget: float, dtype: str, mode: str, share: float | None) -> bool:
        """:meth:`clamped` for one rank."""
        if self.eager.per_sample_bytes(rank, dtype, 0, self.num_layers) <= 0:
            return True
        line = self._line(rank, m, dtype, share, self.curve(dtype, mode).estimate(budget))
        return below_floor(line, self.eager.floor_bytes(rank, share))

    def extrapolated(self, config: BalanceConfig) -> bool:
        """True when a rank's prediction goes beyond the data: a budget outside the pair's own measured
        ones (or a curve borrowed from other pairs), or a micro-batch the eager model extrapolates."""
        curve = self.curves.get((config.dtype, config_compile_key(config)))
        if curve is None or not curve.budgets:
            return True
        return any(not curve.budgets[0] - 1e-6 <= b <= curve.budgets[-1] + 1e-6
                   or self.eager.extrapolated(rank=r, micro_batch=m, checkpointed=0,
                                              num_layers=self.num_layers, dtype=config.dtype)
                   for r, m, b, _ in self._ranks(config))

    @staticmethod
    def _ranks(config: BalanceConfig) -> list[tuple[int, int, float, float | None]]:
        """Per rank: its micro-batch, budget and ``zero1`` share (None: unsharded)."""
        budgets = config.activation_budget or [1.0] * config.world_size
        shares: Sequence[float | None] = config.sharding_shares() or [None] * config.world_size
        ranks = zip(config.micro_batches, budgets, shares, strict=True)
        return [(r, m, float(b), q) for r, (m, b, q) in enumerate(ranks)]

    def sample_bound(self, rank: int, dtype: str, mode: str, budget: float) -> float:
        """One sample's activations at ``budget`` with their extra margin, ``act_r * f(b) * (1 + extra)``."""
        curve = self.curve(dtype, mode)
        return self.unit(rank, dtype) * curve.estimate(budget) * (1.0 + curve.extra_margin(budget))

    def bound(self, *, rank: int, micro_batch: int, budget: float, dtype: str, mode: str,
              optimizer_share: float | None = None) -> float:
        """``fixed_r(q) + m * sample_bound``: the peak :meth:`fits` weighs, before the floor and margin."""
        return (self.eager.fixed_bytes(rank, dtype, optimizer_share)
                + micro_batch * self.sample_bound(rank, dtype, mode, budget))

    def fits(self, *, rank: int, micro_batch: int, budget: float, dtype: str, mode: str, limit: float,
             optimizer_share: float | None = None) -> bool:
        """:meth:`bound` (at least the eager floor) times ``1 + safety_margin`` under ``limit``, never on an
        impossible (:meth:`clamped`) prediction."""
        peak = max(self.bound(rank=rank, micro_batch=micro_batch, budget=budget, dtype=dtype, mode=mode,
                              optimizer_share=optimizer_share), self.eager.floor_bytes(rank, optimizer_share))
        return (peak * (1.0 + self.safety_margin) <= limit
                and not self._clamped(rank, micro_batch, budget, dtype, mode, optimizer_share))

    def largest_budget(self, *, rank: int, micro_batch: int, dtype: str, mode: str, limit: float,
                       optimizer_share: float | None = None) -> float | None:
        """The largest budget of the space's grid predicted to fit (None: not even the smallest)."""
        return next((b for b in budget_grid()
                     if self.fits(rank=rank, micro_batch=micro_batch, budget=b, dtype=dtype, mode=mode,
                                  limit=limit, optimizer_share=optimizer_share)), None)

    def surely_over(self, *, rank: int, micro_batch: int, budget: float, dtype: str, mode: str,
                    limit: float, optimizer_share: float | None = None) -> float | None:
        """The measured lower bound of the peak (the pair's own measured budgets only) when even it
        exceeds ``limit * (1 + margin)``; None otherwise."""
        low = 0.0 if (own := self.curves.get((dtype, mode))) is None else own.lower(budget)
        if low <= 0:
            return None
        peak = self._line(rank, micro_batch, dtype, optimizer_share, low)
        return peak if peak > limit * (1.0 + self.safety_margin) else None

    def over_at_any_budget(self, *, rank: int, micro_batch: int, dtype: str, mode: str, limit: float,
                           optimizer_share: float | None = None) -> float | None:
        """The least peak predicted for ``micro_batch`` on ``rank`` at any budget (the curve at the
        smallest one, no extra margin) when even that exceeds ``limit * (1 + margin)``; else None."""
        peak = self._line(rank, micro_batch, dtype, optimizer_share, self.curve(dtype, mode).estimate(BUDGET_RANGE[0]))
        return peak if peak > limit * (1.0 + self.safety_margin) else None

    def config_peaks(self, config: BalanceConfig) -> list[float]:
        """Estimated peak of each rank of a compiled configuration (its ``zero1`` shares, if any)."""
        mode = config_compile_key(config)
        return [self.predict(rank=r, micro_batch=m, budget=b, dtype=config.dtype, mode=mode, optimizer_share=q)
                for r, m, b, q in self._ranks(config)]

    def _predict_obs(self, o: CompiledObservation) -> float:
        return self.predict(rank=o.rank, micro_batch=o.micro_batch, budget=o.budget, dtype=o.dtype,
                            mode=o.mode, optimizer_share=o.optimizer_share)

    def holdout_error(self, observations: Sequence[CompiledObservation]) -> float:
        """Mean ``|predicted - measured| / measured`` over the successful observations given."""
        ok = [o for o in observations if o.ok and o.peak_bytes > 0]
        if not ok:
            raise UsageError("holdout_error got no successful compiled observation; pass measured compiled trials.")
        return sum(abs(self._predict_obs(o) - o.peak_bytes) / o.peak_bytes for o in ok) / len(ok)

    def correct(self, observation: CompiledObservation) -> bool:
        """:func:`widen_margin` (the eager model's rule) on this new observation."""
        return self.eager.can_predict(observation.dtype) and widen_margin(
            self, measured=observation.peak_bytes, predicted=self._predict_obs(observation), max_margin=MAX_MARGIN)


def measured_peaks(t: FrozenTrial, *, compiled: bool) -> tuple[dict[str, Any], list[Any]] | None:
    """``(config, peaks)`` of a trial of its own (not reused), ok or OOM, compiled as asked; else None."""
    a = t.user_attrs
    cfg, peaks = a.get(TrialAttr.CONFIG), a.get(TrialAttr.PEAK_DEVICE_GIB) or []
    if (t.state != TrialState.COMPLETE or a.get(TrialAttr.STATUS) not in MEASURED_STATUSES or not cfg
            or a.get(TrialAttr.REUSED_FROM) is not None or (cfg.get("compile", "off") != "off") != compiled
            or len(peaks) != len(cfg["micro_batches"])):
        return None
    return cfg, peaks


def compiled_observations(trials: Sequence[FrozenTrial]) -> list[CompiledObservation]:
    """Every rank of each measured compiled trial, and the failing rank of each that ran out of
    memory (a lower bound: at least its capacity). Reused trials are no new evidence."""
    out: list[CompiledObservation] = []
    for t in trials:
        if (found := measured_peaks(t, compiled=True)) is None:
            continue
        a, (cfg, peaks), status = t.user_attrs, found, t.user_attrs[TrialAttr.STATUS]
        if status == Status.OK:
            ranks = [(r, float(p) * GIB) for r, p in enumerate(peaks) if p is not None and p > 0]
        elif (failing := a.get(TrialAttr.FAILING_RANK)) is not None:
            r = int(failing)
            caps = a.get("capacity_gib") or a.get(TrialAttr.USABLE_GIB) or []
            floor = float(caps[r]) if r < len(caps) and caps[r] else 0.0
            ranks = [(r, max(float(peaks[r] or 0.0), floor) * GIB)]
        else:
            continue
        budgets = cfg.get("activation_budget") or [1.0] * len(peaks)
        shares = BalanceConfig.from_dict(cfg).sharding_shares()
        out += [CompiledObservation(rank=r, micro_batch=int(cfg["micro_batches"][r]),
                                    budget=float(budgets[r]), dtype=cfg["dtype"],
                                    mode=config_compile_key(cfg), peak_bytes=peak, ok=status == Status.OK,
                                    trial=t.number, optimizer_share=None if shares is None else shares[r])
                for r, peak in ranks]
    return out

