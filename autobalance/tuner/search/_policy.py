"""The search policy: where the next trial is chosen.

:meth:`SearchPolicy.next` walks the phases over a :class:`TrialHistory` (running trials included: parallel
tuners do not propose what another measures); the first that proposes a trial the time budget holds wins;
:class:`ModelAdvisor` enqueues it (a plain Optuna study: dashboard, resume, several workers). The constants
named below live in ``_constants``, with the measurements they come from.

| phase | applies when | proposes |
|---|---|---|
| ``probe`` | GPU, compile searched, nothing compiled yet, no half-precision eager trial without checkpointing measured | one such eager trial at the smallest micro-batch: the held memory and the per-sample activations, in seconds, no compile |
| ``compiled-start`` | GPU, compile searched, nothing compiled yet, the probe measured | the cheapest scope (``regional`` when searched), the first half dtype, budget 1.0, the largest micro-batch predicted to fit (:func:`first_compiled_micro_batch`) among splits of one micro-step size per rank (:func:`one_size`; two sizes only where the space holds none), fewest micro-steps |
| ``explore`` | every :data:`SAMPLER_EVERY`-th ask: on CPU always, on a GPU once the models' proposals stopped improving | the sampler's trial (a dtype held back pinned; eager when no compile fits in the time left) |
| ``compiled-grow`` | a compiled trial fitted, and a split of fewer micro-steps (same scope and dtype) was never tried | from the best compiled trial, the next split of one size per rank whose largest budget predicted to fit is at least :data:`GROW_MIN_BUDGET`, at that budget; once two sizes measured competitive, every split: the fewest micro-steps predicted to fit at 1.0, else one fewer |
| ``raise-budget`` | one rank; the best compiled trial ran below budget 1.0 | that trial at the largest higher budget where its measured peak plus the compiled model's change counted 1 + :data:`RAISE_CHANGE_MARGIN` times stays usable, below any budget that did not fit at that split: the step's time falls steeply with the budget (regional 8 x 4, loss outside, on the H200: 185.8 ms at 0.5, 172.5 at 0.7, 143.3 at 0.85); where only the doubled change leaves no room, one measured budget step (``_budget_step``) |
| ``scope-probe`` | growing stopped; a searched scope never ran, or one of the :data:`SCOPE_TRANSFERS` fastest compiled splits (within :data:`TRANSFER_WITHIN`) never ran in another searched scope; the time budget holds that compile | a scope's first trial: the best split measured in another scope at the largest budget per rank predicted to fit, never below the one it ran at (what fitted in one scope is the best evidence for the other: the kept fractions at 1.0 measured 0.63-0.73 in both); then each fast configuration in the other scope, budget unchanged |
| ``grow-probe`` | growing, raising and the scope probe propose nothing; in a scope, fewer micro-steps measured faster beyond :data:`SAME_WITHIN`; the next split never ran there and fits only below :data:`GROW_MIN_BUDGET` or at no budget | a measured step: that split at the largest budget predicted to fit, else at :data:`LOW_BUDGET`, where the cost per micro-step the two trials measured puts it without recomputation under the best measured step (the recomputation's cost there is outside every model's support: one trial measures it) |
| ``cuda-graphs`` | ``--compile-mode auto``, the best trial is a default-mode compiled one, graphs untried, time holds a compile | the best configuration with CUDA graphs: one compile measures whether they pay (``_models.graph_probe``) |
| ``model`` | the memory and compiled models have fitted | their best-ranked configuration predicted to fit (``compiled-model`` or ``memory-model``); a budget below :data:`LOW_BUDGET` only where a higher one was measured at that micro-batch and scope; compiled, one size per rank unless two sizes measured competitive; a time outside the step-time model's support (:meth:`TrialHistory.time_supported`) ranks last and says it extrapolates |
| ``shard``, ``prior``, ``sampler`` | nothing else proposes | parameter sharding where a rank's fixed part is large and nothing fits (``_sharding``); the least memory the priors know while nothing fits (GPU); else the sampler |
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig, split_evenly
from autobalance._errors import ConfigError, UsageError
from autobalance.protocol import (
    GIB,
    MEASURED_STATUSES,
    Status,
    StudyAttr,
    TrialAttr,
    best_trial,
    best_value,
    memory_text,
)
from autobalance.tuner.search._constants import (
    BUDGET_CEILING,
    EAGER_FIRST,
    FIT_MARGIN,
    GROW_MIN_BUDGET,
    KEEP_AT_FULL_BUDGET,
    LOW_BUDGET,
    MAX_PREDICTED_IN_A_ROW,
    RAISE_CHANGE_MARGIN,
    SAME_WITHIN,
    SAMPLER_EVERY,
    SCOPE_TRANSFERS,
    TRANSFER_WITHIN,
    WORTH,
)
from autobalance.tuner.search._dominance import dominance_veto, dominating_over_cap, model_veto
from autobalance.tuner.search._model_errors import ModelErrors
from autobalance.tuner.search._models import (
    HALF_DTYPES,
    Decision,
    SearchModels,
    compiled_holdout_error,
    eager_holdout_error,
    graph_probe,
    proposals_stalled,
    saves_errors,
)
from autobalance.tuner.search._sharding import sharding_proposal
from autobalance.tuner.search._space import (
    BUDGET_RANGE,
    BUDGET_STEP,
    SearchSpace,
    config_compile_key,
)

if TYPE_CHECKING:
    from autobalance.tuner._settings import TuneSettings
    from autobalance.tuner.search._objective import TrialFigures

__all__ = ["FIT_MARGIN", "KEEP_AT_FULL_BUDGET", "LOW_BUDGET", "ModelAdvisor", "Proposal", "Record",
           "SearchPolicy", "TrialHistory", "first_compiled_micro_batch", "one_size", "proposal_line"]


def one_size(config: BalanceConfig) -> bool:
    """Whether each rank's micro-steps are of one size (two compile a dynamic batch dimension: slow)."""
    return all(len(set(config.micro_step_sizes(r))) == 1 for r in range(config.world_size))


def _low(config: BalanceConfig) -> float:
    return min(config.activation_budget or [1.0])


def _split(config: BalanceConfig) -> tuple[str, str]:
    """``config``'s compile key and micro-batches (as JSON)."""
    return config_compile_key(config), json.dumps(config.micro_batches)


def _with(config: BalanceConfig, **changes: Any) -> BalanceConfig:
    return BalanceConfig.from_dict({**config.to_dict(), **changes})


@dataclass(frozen=True, kw_only=True)
class Record:
    """One trial as the policy reads it."""

    number: int
    config: BalanceConfig | None  # a running trial's from its parameters; None: not known
    status: str | None  # None: running or waiting
    running: bool
    peaks_gib: list[float | None] = field(default_factory=list)
    held_gib: list[float | None] = field(default_factory=list)
    step_ms: float | None = None
    feasible: bool = False
    reused: bool = False

    @property
    def measured(self) -> bool:
        """Launched and measured here (not reused from another trial, not predicted)."""
        return self.status in MEASURED_STATUSES and not self.reused

    @property
    def compiled(self) -> bool:
        return self.config is not None and self.config.compile != "off"


@dataclass(kw_only=True)
class TrialHistory:
    """The study's trials, read once per decision."""

    records: list[Record]
    usable_gib: list[float]  # per rank, the memory a trial may use (cap x (1 - headroom))
    loss_in_model: bool | None = None
    """The baseline's report: the loss computed inside the wrapped model (None: not reported)."""

    @classmethod
    def from_trials(cls, trials: Sequence[FrozenTrial], *, space: SearchSpace, usable: list[float] | None,
                    model_facts: dict[str, Any] | None = None) -> TrialHistory:
        records = []
        for t in trials:
            a = t.user_attrs
            running = t.state in (TrialState.RUNNING, TrialState.WAITING)
            cfg: BalanceConfig | None = None
            try:
                if a.get(TrialAttr.CONFIG):
                    cfg = BalanceConfig.from_dict(a[TrialAttr.CONFIG])
                elif running and t.params:  # another worker's trial being measured: what it runs
                    cfg = space.config_from_params(t.params)
            except (ConfigError, KeyError, TypeError, ValueError):  # damaged, partial params
                cfg = None
            records.append(Record(
                number=t.number, config=cfg, status=None if running else a.get(TrialAttr.STATUS), running=running,
                peaks_gib=list(a.get(TrialAttr.PEAK_DEVICE_GIB) or []), step_ms=a.get(TrialAttr.STEP_TIME_MS),
                held_gib=list(a.get(TrialAttr.HELD_GIB) or []), feasible=bool(a.get(TrialAttr.FEASIBLE)),
                reused=a.get(TrialAttr.REUSED_FROM) is not None))
        loss = (model_facts or {}).get("loss_in_model")
        return cls(records=records, usable_gib=[u / GIB for u in (usable or [])],
                   loss_in_model=loss if isinstance(loss, bool) else None)

    def tried(self) -> set[str]:
        """Every configuration measured, predicted, reused, running or waiting (as JSON)."""
        return {r.config.to_json() for r in self.records if r.config is not None}

    def compiled_tried(self) -> list[Record]:
        """Compiled trials launched, running or waiting (reused and predicted ones left out)."""
        return [r for r in self.records if r.compiled and (r.running or r.measured or r.status == Status.OOM)]

    def ran(self, *, compiled: bool, ok: bool = False) -> list[tuple[Record, BalanceConfig]]:
        """The trials measured here (``ok``: that ran to the end), compiled or eager, with their configs."""
        return [(r, c) for r in self.records if (c := r.config) is not None and r.measured
                and (c.compile != "off") == compiled and (not ok or r.status == Status.OK)]

    def half_eager(self) -> list[tuple[Record, BalanceConfig]]:
        """The half-precision eager trials without checkpointing that ran to the end here."""
        return [(r, c) for r, c in self.ran(compiled=False, ok=True)
                if c.dtype in HALF_DTYPES and not any(c.checkpoint)]

    def eager_probe(self) -> tuple[Record, float, float] | None:
        """``(record, held GiB, activations GiB per sample)`` of a :meth:`half_eager` trial's fullest rank."""
        found = [(r, float(held), (float(peak) - float(held)) / cfg.micro_batches[rank])
                 for r, cfg in self.half_eager()
                 for rank, (peak, held) in enumerate(zip(r.peaks_gib, r.held_gib, strict=False))
                 if peak is not None and held is not None and peak > held]
        return max(found, key=lambda f: f[1], default=None)

    def fastest_compiled(self) -> list[Record]:
        """The feasible compiled trials measured here, fastest first."""
        return sorted((r for r, _ in self.ran(compiled=True) if r.feasible and r.step_ms is not None),
                      key=lambda r: float(r.step_ms or 0.0))

    def best_compiled(self) -> Record | None:
        return next(iter(self.fastest_compiled()), None)

    def two_sizes_compete(self) -> bool:
        """Whether a split of two micro-step sizes in a rank measured within :data:`SAME_WITHIN` of the best."""
        fastest = self.fastest_compiled()
        return any(r.config is not None and not one_size(r.config)
                   and float(r.step_ms or 0.0) <= float(fastest[0].step_ms or 0.0) * (1.0 + SAME_WITHIN)
                   for r in fastest)

    def keyed(self, config: BalanceConfig) -> list[tuple[Record, BalanceConfig]]:
        """The compiled trials measured here in ``config``'s compile key and dtype."""
        key = config_compile_key(config)
        return [(r, c) for r, c in self.ran(compiled=True)
                if config_compile_key(c) == key and c.dtype == config.dtype]

    def time_supported(self, config: BalanceConfig) -> bool:
        """Whether the step-time model was fitted where ``config`` lies: compiled, no budget below and no
        micro-batch outside those measured in its compile key and dtype (44 ms predicted at budget 0.3 from
        trials at 0.55-1.0 for one that ran 164 ms)."""
        if config.compile == "off":
            return True
        ok = [c for r, c in self.keyed(config) if r.status == Status.OK and r.step_ms is not None]
        if not ok:
            return False
        micros = [max(c.micro_batches) for c in ok]
        return (_low(config) >= min(map(_low, ok)) - 1e-9
                and min(micros) <= max(config.micro_batches) <= max(micros))

    def compiled_splits(self) -> set[tuple[str, str]]:
        """:func:`_split` of every compiled trial launched, running or predicted."""
        return {_split(r.config) for r in self.records if r.config is not None and r.compiled and not r.reused}

    def measured_scopes(self) -> set[str]:
        """The compile scopes of the compiled trials that ran to the end here."""
        return {c.compile_scope for _, c in self.ran(compiled=True, ok=True)}

    def budget_ladder(self, config: BalanceConfig) -> list[tuple[float, float, float]]:
        """``config``'s split (one rank) measured to fit here: ``(budget, peak GiB, step ms)``, ascending."""
        out: dict[float, tuple[float, float, float]] = {}
        for r, c in self.keyed(config):
            if (r.feasible and r.step_ms is not None and _split(c) == _split(config)
                    and r.peaks_gib and r.peaks_gib[0] is not None):
                b = round(_low(c), 6)
                out[b] = (b, float(r.peaks_gib[0]), float(r.step_ms))
        return [out[b] for b in sorted(out)]

    def ladder_slope(self, config: BalanceConfig) -> float | None:
        """The largest rise of the peak per unit of budget in :meth:`budget_ladder`, GiB; None: below two."""
        return max((max(0.0, (p1 - p0) / (b1 - b0))
                    for (b0, p0, _), (b1, p1, _) in itertools.pairwise(self.budget_ladder(config))), default=None)

    def low_budget_ok(self, config: BalanceConfig) -> bool:
        """A budget below :data:`LOW_BUDGET` only where a higher one was measured at that micro-batch and key."""
        if config.compile == "off" or _low(config) >= LOW_BUDGET:
            return True
        key, m = config_compile_key(config), max(config.micro_batches)
        return any(_low(c) >= LOW_BUDGET for _, c in self.ran(compiled=True)
                   if config_compile_key(c) == key and max(c.micro_batches) == m)


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """The next trial: what to run, which phase chose it, why, and what it is predicted to do."""

    config: BalanceConfig | None
    """None: the sampler's, ``fixed`` its pinned parameters (a dtype held back; eager when no compile fits)."""
    phase: str
    reason: str
    predicted_ms: float | None = None
    predicted_peak_gib: list[float] | None = None
    fixed: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    """More attributes the trial records (``proposal_new_graphs``, ...)."""

    def user_attrs(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {TrialAttr.PROPOSAL_PHASE: self.phase,
                                 TrialAttr.PROPOSAL_REASON: self.reason, **self.extra}
        if self.config is not None:
            attrs["proposed_config"] = self.config.to_dict()
        if self.predicted_ms is not None:
            attrs["proposal_step_ms"] = round(self.predicted_ms, 3)
        if self.predicted_peak_gib is not None:
            attrs["proposal_peak_gib"] = [round(p, 4) for p in self.predicted_peak_gib]
        return attrs


def proposal_line(attrs: dict[str, Any]) -> str:
    """A trial's phase and prediction on its console line: ``compiled-model: 169 ms, 12.6 GiB predicted``,
    ``sampler`` (empty: nobody proposed it)."""
    phase = attrs.get(TrialAttr.PROPOSAL_PHASE)
    if not phase:
        return ""
    ms, peaks = attrs.get("proposal_step_ms"), attrs.get("proposal_peak_gib")
    parts = [f"{ms:.0f} ms"] if isinstance(ms, (int, float)) else []
    if isinstance(peaks, list) and peaks and all(isinstance(p, (int, float)) for p in peaks):
        parts.append(memory_text(max(peaks)))
    extrapolated = " (extrapolated)" if attrs.get("proposal_extrapolated") and parts else ""
    return f"{phase}: {', '.join(parts)} predicted{extrapolated}" if parts else str(phase)


def first_compiled_micro_batch(*, held_gib: float, act_gib: float, usable_gib: float, keep: float,
                               candidates: Sequence[int]) -> int | None:
    """The largest of ``candidates`` whose peak at budget 1.0, ``held + m * act * keep``, stays :data:`FIT_MARGIN`
    below ``usable``; None: none does."""
    limit = usable_gib * (1.0 - FIT_MARGIN)
    return max((m for m in candidates if held_gib + m * act_gib * keep <= limit), default=None)


class SearchPolicy:
    """The ordered phases (module doc) over the models of the decision in progress."""

    def __init__(self, *, space: SearchSpace, models: SearchModels) -> None:
        self.space = space
        self.models = models

    def next(self, history: TrialHistory) -> Proposal | None:
        """The first phase's proposal that is new (not tried, not running elsewhere) and that the time budget holds
        (its compile and verification's reserve after it); None: the sampler's."""
        tried = history.tried()
        for phase in PHASES:
            proposal = phase(self, history)
            cfg = None if proposal is None else proposal.config
            if proposal is None or (cfg is not None and (
                    cfg.to_json() in tried or self.models.unaffordable(cfg) is not None)):
                continue
            if cfg is not None and proposal.predicted_ms is None:  # every line says its time too
                proposal = dataclasses.replace(proposal, predicted_ms=self.models.predicted_ms(cfg))
            return proposal
        return None

    def _even(self, acc: int, *, dtype: str, compile: str, scope: str = "whole", checkpointed: int = 0,
              budget: float = 1.0, bucket_cap_mb: float = 25.0, view: bool = True) -> BalanceConfig | None:
        """The even split of ``acc`` micro-steps, ``checkpointed`` blocks checkpointed, ``budget`` compiled."""
        world, total = self.space.world_size, self.space.micro_total(acc)
        if total < world:
            return None
        rest: dict[str, Any] = {"dtype": dtype, "compile": compile, "bucket_cap_mb": bucket_cap_mb,
                                "gradient_as_bucket_view": view,
                                "checkpoint": [list(range(checkpointed)) for _ in range(world)]}
        if compile != "off":
            rest.update(compile_scope=scope, activation_budget=[budget] * world)
        try:
            cfg = self.space.config_for(split_evenly(total, [1.0] * world), acc, None, **rest)
        except (ConfigError, UsageError, ValueError):  # a split this space cannot hold
            return None
        return cfg if self.space.contains(cfg) else None

    def _fewer_steps(self, cfg: BalanceConfig, two_sizes: bool) -> Iterator[BalanceConfig]:
        """Even splits of fewer micro-steps than ``cfg`` (one fewer first), its key and dtype; one size a rank
        unless ``two_sizes``."""
        for acc in sorted((a for a in self.space.accumulations if a < cfg.accumulation), reverse=True):
            template = self._even(acc, dtype=cfg.dtype, compile=cfg.compile, scope=cfg.compile_scope)
            if template is not None and (two_sizes or one_size(template)):
                yield template

    def _half_dtype(self) -> str | None:
        return next((d for d in self.models.allowed_dtypes_now() if d in HALF_DTYPES), None)

    # ------------------------------------------------------------------ phases
    def probe(self, history: TrialHistory) -> Proposal | None:
        if (self.models.settings.device != "cuda" or not self.space.compile_searched
                or "off" not in self.space.compile_modes or history.compiled_tried() or history.half_eager()
                or (half := self._half_dtype()) is None):
            return None
        tried = history.tried()
        evens = (self._even(a, dtype=half, compile="off") for a in sorted(self.space.accumulations)[::-1])
        cfg = next((c for c in evens if c is not None and c.to_json() not in tried), None)  # smallest micro
        return None if cfg is None else Proposal(config=cfg, phase="probe", reason=(
            f"eager {half} at the smallest micro-batch ({max(cfg.micro_batches)} x {cfg.accumulation}), "
            "nothing checkpointed: measures the memory held apart from activations and the activations per "
            "sample in seconds, before any compile"))

    def compiled_start(self, history: TrialHistory) -> Proposal | None:
        if self.models.settings.device != "cuda" or not self.space.compile_searched or history.compiled_tried():
            return None
        probe = history.eager_probe() or self.models.eager_estimate()
        half = self._half_dtype()
        if probe is None or half is None or not history.usable_gib:
            return None
        _, held, act = probe
        keep = KEEP_AT_FULL_BUDGET[history.loss_in_model is not False]
        scope = "regional" if "regional" in self.space.compile_scopes else "whole"
        mode = next(m for m in self.space.compile_modes if m != "off")
        splits = [c for acc in sorted(self.space.accumulations)
                  if (c := self._even(acc, dtype=half, compile=mode, scope=scope)) is not None]
        even = [c for c in splits if one_size(c)]
        # one per largest micro-batch, of the fewest micro-steps (reversed: the first one wins)
        by_micro = {max(c.micro_batches): c for c in reversed(even or splits)}
        if not by_micro:
            return None
        usable = min(history.usable_gib)
        m = first_compiled_micro_batch(held_gib=held, act_gib=act, usable_gib=usable, keep=keep,
                                       candidates=list(by_micro)) or min(by_micro)
        cfg = by_micro[m]
        one = "of micro-steps of one size " if even else ""
        return Proposal(config=cfg, phase="compiled-start", predicted_peak_gib=[held + m * act * keep], reason=(
            f"the first compiled trial: {scope} (the cheapest to compile), {cfg.dtype}, budget 1.0, the "
            f"largest micro-batch {one}predicted to fit ({m}: {memory_text(held)} held + {m} x "
            f"{memory_text(act)} x {keep:g} kept at budget 1.0 <= {memory_text(usable)} usable)"))

    def compiled_grow(self, history: TrialHistory) -> Proposal | None:
        base = history.best_compiled()
        if base is None or (cfg := base.config) is None:
            return None
        ran, two_sizes = history.compiled_splits(), history.two_sizes_compete()
        options = [(t, fits) for t in self._fewer_steps(cfg, two_sizes) if _split(t) not in ran
                   and (fits := self.models.largest_budgets(t)) is not None and min(fits) >= GROW_MIN_BUDGET]
        if not options:
            return None
        # fitting at the full budget: straight to the fewest; of one size per rank, the next split already doubles
        # the micro-batch (32: 4 x 8, 8 x 4, 16 x 2): one at a time, as far as the memory model reaches from what
        # was measured (4 x 8 at 1.0 alone put 16 x 2 at 1.0 within the usable memory; it peaked 20.9 GiB of 15.2)
        full = [o for o in options if min(o[1]) >= 1.0]
        template, fits = min(full, key=lambda o: o[0].accumulation) if full and two_sizes else options[0]
        grown = _with(template, activation_budget=fits, bucket_cap_mb=cfg.bucket_cap_mb,
                      gradient_as_bucket_view=cfg.gradient_as_bucket_view)
        return Proposal(config=grown, phase="compiled-grow",
                        predicted_peak_gib=self.models.compiled_peaks(grown), reason=(
            f"fewer micro-steps in {cfg.compile_scope} {cfg.dtype} ({cfg.accumulation} -> "
            f"{template.accumulation}, from trial {base.number}) at the largest budget predicted to fit "
            f"({min(fits):g} >= {GROW_MIN_BUDGET:g}): a micro-step's launches cost the same whatever its "
            "size"))

    def raise_budget(self, history: TrialHistory) -> Proposal | None:
        base = history.best_compiled()
        if base is None or (cfg := base.config) is None or cfg.world_size != 1 or not history.usable_gib:
            return None  # several ranks: the model phase moves each rank's budget
        b = (cfg.activation_budget or [1.0])[0]
        peak = base.peaks_gib[0] if base.peaks_gib else None
        if b >= BUDGET_CEILING or peak is None:
            return None
        # below any budget that ran out of memory or over the usable memory at this split: a higher budget keeps
        # at least as much (where it is not low)
        ceiling = min([BUDGET_CEILING + 1e-9, *(
            _low(c) for r, c in history.keyed(cfg) if _split(c) == _split(cfg) and (r.status == Status.OOM or any(
                p is not None and p > u for p, u in zip(r.peaks_gib, history.usable_gib, strict=False))))])
        limit = history.usable_gib[0]  # the measured peak is known: the margin is on the change
        pick: tuple[float, float] | None = None
        slope = history.ladder_slope(cfg)  # GiB per unit of budget the split's own budgets measured
        nb = round(b + BUDGET_STEP, 3)
        while nb < ceiling and (change := self.models.peak_change(cfg, nb)) is not None:
            # never less than the split's own measurements show: the model's curve is shared by every split (a
            # trial over the memory at another micro-batch lifts it at every budget)
            grow = max(change[0], 0.0, (slope or 0.0) * (nb - b))
            if float(peak) + grow * (1.0 + RAISE_CHANGE_MARGIN) > limit:
                break
            pick = (nb, float(peak) + grow)
            nb = round(nb + BUDGET_STEP, 3)
        if pick is not None and (raised := _with(cfg, activation_budget=[pick[0]])).to_json() not in history.tried():
            own = " (no less than the split's own measured budgets showed)" if slope is not None else ""
            return Proposal(config=raised, phase="raise-budget", predicted_peak_gib=[pick[1]], reason=(
                f"the best compiled trial ({base.number}) at budget {pick[0]:g} instead of {b:g}: its "
                f"measured {memory_text(float(peak))} plus the compiled model's change{own} counted "
                f"{1.0 + RAISE_CHANGE_MARGIN:g}x stays below {memory_text(limit)} usable; less recomputed"))
        return self._budget_step(history, base, cfg, limit=limit, ceiling=ceiling, slope=slope)

    def _budget_step(self, history: TrialHistory, base: Record, cfg: BalanceConfig, *, limit: float,
                     ceiling: float, slope: float | None) -> Proposal | None:
        """``raise-budget``'s measured step; not above a budget measured slower beyond :data:`SAME_WITHIN`."""
        ladder = history.budget_ladder(cfg)
        if not ladder:
            return None
        top_b, top_peak, top_ms = ladder[-1]
        nb = round(top_b + BUDGET_STEP, 3)
        if top_ms > float(base.step_ms or 0.0) * (1.0 + SAME_WITHIN) or nb >= ceiling:
            return None
        if slope is not None:
            step = slope * BUDGET_STEP
            source = (f"the largest change per step its {len(ladder)} measured budgets at this split showed "
                      f"({step:+.2f} GiB)")
        else:
            change = self.models.peak_change(_with(cfg, activation_budget=[top_b]), nb)
            if change is None:
                return None
            step = max(change[0], 0.0)
            source = f"the compiled model's change ({step:+.2f} GiB, counted once)"
        if top_peak + step > limit:
            return None
        return Proposal(config=_with(cfg, activation_budget=[nb]), phase="raise-budget",
                        predicted_peak_gib=[top_peak + step], reason=(
            f"a measured step: trial {base.number}'s split at budget {nb:g}, one step above {top_b:g} "
            f"(measured {memory_text(top_peak)}, {top_ms:.0f} ms); {memory_text(top_peak)} plus {source} "
            f"stays below {memory_text(limit)} usable, where the model's change counted "
            f"{1.0 + RAISE_CHANGE_MARGIN:g}x does not: one trial measures the peak there (the partitioner's "
            "memory rises in plateaus that a line through budgets measured at other splits does not see)"))

    def scope_probe(self, history: TrialHistory) -> Proposal | None:
        if len(self.space.compile_scopes) < 2:
            return None
        ran, measured, fastest = history.compiled_splits(), history.measured_scopes(), history.fastest_compiled()
        if not history.two_sizes_compete():  # two sizes compile dynamic: slow unless measured not
            fastest = [r for r in fastest if r.config is not None and one_size(r.config)]
        for scope in [s for s in self.space.compile_scopes if s not in measured]:  # a new scope
            base = next((r for r in fastest if r.config is not None and r.config.compile_scope != scope), None)
            if base is None or (src := base.config) is None:
                continue
            measured_at = list(src.activation_budget or [1.0] * src.world_size)
            fits = self.models.largest_budgets(src) or measured_at
            budgets = [max(f, b) for f, b in zip(fits, measured_at, strict=True)]
            fitted = _with(src, activation_budget=budgets)
            other = _with(fitted, compile_scope=scope)
            if not self.space.contains(other) or _split(other) in ran or not self.models.time_holds_compile(scope):
                continue
            return Proposal(config=other, phase="scope-probe",
                            predicted_peak_gib=self.models.compiled_peaks(fitted), reason=(
                f"the first {scope} trial: the best split measured in {src.compile_scope} (trial "
                f"{base.number}, {src.accumulation} micro-steps) at the largest budget predicted to fit "
                f"there ({min(budgets):g}): one compile measures whether that scope wins for this script"))
        top = float(fastest[0].step_ms or 0.0) if fastest else 0.0
        for source in fastest[:SCOPE_TRANSFERS]:
            if float(source.step_ms or 0.0) > top * TRANSFER_WITHIN:
                break  # not among the fast ones: another scope's compile would not pay for it
            cfg = source.config
            if cfg is None or cfg.compile != "default":
                continue
            for scope in [s for s in self.space.compile_scopes if s != cfg.compile_scope]:
                other = _with(cfg, compile_scope=scope)
                if not self.space.contains(other) or _split(other) in ran:
                    continue
                if not self.models.time_holds_compile(scope):
                    return None
                new_scope = scope not in measured
                return Proposal(config=other, phase="scope-probe", predicted_peak_gib=None
                                if new_scope else self.models.compiled_peaks(other), reason=(
                    f"trial {source.number} compiled {scope} instead of {cfg.compile_scope}: "
                    + ("one compile measures whether that scope wins for this script" if new_scope
                       else "one of the fastest configurations measured in the other scope, as it "
                       "fitted there (the scopes' optima differ)")))
        return None

    def grow_probe(self, history: TrialHistory) -> Proposal | None:
        """Module doc; why one trial measures it: :data:`GROW_MIN_BUDGET`."""
        best = history.best_compiled()
        if best is None or best.step_ms is None:
            return None
        ran, two_sizes = history.compiled_splits(), history.two_sizes_compete()
        seen: set[tuple[str, str]] = set()
        for base in history.fastest_compiled():
            cfg = base.config
            if cfg is None or base.step_ms is None or (config_compile_key(cfg), cfg.dtype) in seen:
                continue
            seen.add((config_compile_key(cfg), cfg.dtype))  # the fastest of each scope and dtype
            base_ms = float(base.step_ms)
            keyed = history.keyed(cfg)
            slower_ones = [(r, c) for r, c in keyed if r.feasible and r.step_ms is not None
                           and c.accumulation > cfg.accumulation and float(r.step_ms) > base_ms * (1 + SAME_WITHIN)]
            if not slower_ones:
                continue  # no measured evidence that fewer micro-steps pay in this scope
            slower, more = min(slower_ones, key=lambda o: float(o[0].step_ms or 0.0))
            slower_ms = float(slower.step_ms or 0.0)
            # the cost per micro-step the two measured: a line through them, nothing recomputed
            per_step = (slower_ms - base_ms) / (more.accumulation - cfg.accumulation)
            template = next(self._fewer_steps(cfg, two_sizes), None)  # the next split only
            if template is None or _split(template) in ran:
                continue  # tried: growing from it is ``compiled-grow``'s and ``raise-budget``'s
            fits = self.models.largest_budgets(template)
            if fits is not None and not LOW_BUDGET <= min(fits) < GROW_MIN_BUDGET:
                continue  # above: ``compiled-grow`` proposes it; below, memory is not monotone in the budget
            bound = base_ms - per_step * (cfg.accumulation - template.accumulation)
            if bound >= float(best.step_ms):
                continue
            if fits is None and min([1.0, *(_low(c) for _, c in keyed)]) <= LOW_BUDGET + 1e-9:
                continue  # the model's "no budget" rests on a budget measured that low: no prior
            low = min(fits) if fits is not None else LOW_BUDGET
            grown = _with(template, activation_budget=[low] * template.world_size,
                          bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=cfg.gradient_as_bucket_view)
            if not self.space.contains(grown):
                continue
            where = (f"the largest budget the compiled model predicts to fit ({low:g} < {GROW_MIN_BUDGET:g})"
                     if fits is not None else f"{LOW_BUDGET:g}, the least memory proposed unmeasured (the "
                     "compiled model places it at no budget from a curve it never measured that low)")
            return Proposal(config=grown, phase="grow-probe", extra={"proposal_extrapolated": True},
                            predicted_peak_gib=self.models.compiled_peaks(grown), reason=(
                f"a measured step: fewer micro-steps in {cfg.compile_scope} {cfg.dtype} ({cfg.accumulation} "
                f"-> {template.accumulation}, from trial {base.number}, {base_ms:.0f} ms; trial "
                f"{slower.number} with {more.accumulation} ran {slower_ms:.0f} ms) at {where}: without "
                f"recomputation the measured cost per micro-step puts it at {bound:.0f} ms, against the best "
                f"measured {float(best.step_ms):.0f} ms; what recomputing costs at that budget no trial "
                "measured"))
        return None


# ---------------------------------------------------------------------- the phases over the models
def explore_phase(policy: SearchPolicy, history: TrialHistory) -> Proposal | None:
    """``explore`` (module doc): on CPU for bucket sizes and dtypes the models cannot predict yet."""
    models, study = policy.models, policy.models.study
    cpu = models.settings.device != "cuda"
    if models.asks % SAMPLER_EVERY == 0 and (cpu or proposals_stalled(
            study.get_trials(deepcopy=False), study.user_attrs.get(StudyAttr.OBJECTIVE, {}))):
        return sampler_proposal(models, "explore: " + (
            "every third trial on CPU" if cpu else "the models' proposals stopped improving"))
    return None


def model_phase(policy: SearchPolicy, history: TrialHistory) -> Proposal | None:
    """``model`` (module doc): worth a trial (:data:`WORTH`), in a measured scope, a compile the time left holds;
    eager first while the compiled model has too few eager trials of its dtype (:data:`EAGER_FIRST`)."""
    models, study = policy.models, policy.models.study
    candidates = models.scored_candidates(study)
    if not candidates:
        return None
    limited = models.decision_for(study).compile_limited
    if not models.time_holds_compile():  # no new graph that the time budget cannot hold
        candidates = [c for c in candidates if c.new_graphs == 0]
    elif limited:  # nor one of a scope whose compile it cannot hold
        dear = {s for s in models.space.compile_scopes if not models.time_holds_compile(s)}
        candidates = [c for c in candidates if c.new_graphs == 0 or c.config.compile == "off"
                      or c.config.compile_scope not in dear]
    scopes = history.measured_scopes() or {models.space.compile_scopes[-1]}  # regional first
    eager_splits = {(c.accumulation, tuple(c.micro_batches)) for _, c in history.ran(compiled=False, ok=True)}
    if models.settings.device == "cuda" and history.best_compiled() is not None and len(eager_splits) < 3:
        # an eager proposal against a compiled best needs an eager time model of its own (three measured
        # eager splits): with fewer it is proportional and ranks launch-bound small micro-batches too well
        candidates = [c for c in candidates if c.config.compile != "off"]
    if not history.two_sizes_compete():  # compiled: one micro-step size per rank where any fits
        even = [c for c in candidates if c.config.compile == "off" or one_size(c.config)]
        if any(c.config.compile != "off" for c in even):
            candidates = even
    # a time predicted outside the step-time model's support is no reason to propose: ranked last
    inside = {id(c) for c in candidates if history.time_supported(c.config)}
    candidates = sorted(candidates, key=lambda c: id(c) not in inside)
    tried = history.tried() | models.proposed
    fresh = [c for c in candidates if c.config.to_json() not in tried and history.low_budget_ok(c.config)
             and (c.config.compile == "off" or c.config.compile_scope in scopes)]
    if limited and (best := best_value(study)) is not None:  # under a time budget a compile must promise a gain
        fresh = [c for c in fresh if c.new_graphs == 0 or c.score < best]
    if not fresh or fresh[0].score > WORTH * candidates[0].score:
        return None
    pick, note = fresh[0], None
    dtype, model = pick.config.dtype, models.model
    if (pick.source == "compiled-model" and "off" in models.space.compile_modes and model is not None
            and not model.is_fitted_for(dtype) and history.eager_probe() is None
            and sum(c.dtype == dtype for _, c in history.ran(compiled=False, ok=True)) < EAGER_FIRST):
        eager = [c for c in fresh if c.source == "memory-model" and c.config.dtype == dtype]
        if eager:  # a few seconds that teach the compiled model its fixed part before a compile
            pick, note = eager[0], "eager first: teaches the memory model before compiling"
    compiled = pick.source == "compiled-model"
    extra: dict[str, Any] = {"proposal_new_graphs": pick.new_graphs} if compiled else {}
    if pick.extrapolated or id(pick) not in inside:
        extra["proposal_extrapolated"] = True
    reason = note or (f"the {'compiled' if compiled else 'memory'} model's best configuration predicted to "
                      "fit" + (f" ({models.dtype_note})" if models.dtype_note else ""))
    return Proposal(config=pick.config, phase=pick.source, reason=reason, predicted_ms=pick.step_ms,
                    predicted_peak_gib=[p / GIB for p in pick.peaks], extra=extra)


def cuda_graphs_phase(policy: SearchPolicy, history: TrialHistory) -> Proposal | None:
    """``cuda-graphs`` (module doc), at the best trial or the best whole-model one within 2 % of it."""
    models, study = policy.models, policy.models.study
    top = best_trial(study)
    if not models.time_holds_compile() or top is None:
        return None
    if (top.user_attrs.get(TrialAttr.CONFIG) or {}).get("compile_scope", "whole") != "whole":
        best_ms = float(top.user_attrs.get(TrialAttr.STEP_TIME_MS) or 0.0)
        top = min((t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                   if t.user_attrs.get(TrialAttr.FEASIBLE) and t.user_attrs.get(TrialAttr.STEP_TIME_MS)
                   and (c := t.user_attrs.get(TrialAttr.CONFIG) or {}).get("compile") == "default"
                   and c.get("compile_scope", "whole") == "whole"
                   and float(t.user_attrs[TrialAttr.STEP_TIME_MS]) <= 1.02 * best_ms),
                  key=lambda t: float(t.user_attrs[TrialAttr.STEP_TIME_MS]), default=None)
    if top is None:
        return None
    probe = graph_probe(study.get_trials(deepcopy=False), best=top, modes=models.space.compile_modes,
                        dtypes=models.allowed_dtypes(study))
    if probe is None or probe.to_json() in models.proposed or not models.space.contains(probe):
        return None
    return Proposal(config=probe, phase="cuda-graphs", reason=(
        f"CUDA graphs ({probe.compile}) at the best default-mode compiled configuration: one compile "
        "measures whether they pay for this script"))


def fallbacks_phase(policy: SearchPolicy, history: TrialHistory) -> Proposal | None:
    """When no phase proposes: ``shard``, ``prior``, else the sampler (module doc)."""
    models, study = policy.models, policy.models.study
    if len(models.space.param_shardings) > 1:  # searched
        found = sharding_proposal(
            study.get_trials(deepcopy=False), space_shardings=models.space.param_shardings,
            model_facts=study.user_attrs.get(StudyAttr.MODEL), world_size=models.space.world_size,
            usable=models.usable(study), unsharded=models.model, tried=history.tried() | models.proposed,
            num_layers=models.space.num_layers)
        if found is not None:  # the fixed part only (in the reason): no peak predicted
            return Proposal(config=found[0], phase="shard", reason=found[1])
    if (models.settings.device == "cuda" and not any(r.status == Status.OK for r in history.records)
            and (allowed := models.allowed_dtypes(study))):
        # the least memory of the first allowed dtype while nothing fits (every block checkpointed, else
        # the smallest budget), at the baseline's accumulation, then the largest
        number = study.user_attrs.get(StudyAttr.BASELINE)
        own = next((t.user_attrs.get(TrialAttr.CONFIG) or {} for t in study.get_trials(deepcopy=False)
                    if t.number == number), {})
        space = models.space
        mode = "off" if "off" in space.compile_modes else space.compile_modes[0]
        accs = dict.fromkeys([int(own.get("accumulation") or 1), max(space.accumulations)])
        for acc in (a for a in accs if a in space.accumulations):
            probe = policy._even(acc, dtype=allowed[0], compile=mode, budget=BUDGET_RANGE[0],
                                 checkpointed=space.num_layers if mode == "off" else 0,
                                 bucket_cap_mb=float(own.get("bucket_cap_mb") or 25.0),
                                 view=bool(own.get("gradient_as_bucket_view", True)))
            if probe is not None and probe.to_json() not in history.tried() | models.proposed:
                return Proposal(config=probe, phase="prior", reason=(
                    "nothing measured fits yet: the least memory the priors know, in "
                    f"{probe.dtype} ({models.dtype_note or 'the dtype prior on a GPU'})"))
    return sampler_proposal(models, "the sampler's trial: the models propose nothing new worth a trial")


def sampler_proposal(models: SearchModels, why: str) -> Proposal:
    """The sampler's trial; a dtype held back: in the best trial's dtype (when allowed) or the first allowed."""
    study = models.study
    fixed: dict[str, Any] = {}
    notes = [why]
    if not models.time_holds_compile() and "off" in models.space.compile_modes:
        fixed["compile"] = "off"
        notes.append("eager: the time budget holds no compile")
    if models.settings.device == "cuda":
        timing = models.decision_for(study).step_time
        allowed = models.allowed_dtypes(study, timing if timing.k else None)
        if allowed and len(allowed) < len(models.space.dtypes):
            best = best_trial(study)
            dtype = None if best is None else (best.user_attrs.get(TrialAttr.CONFIG) or {}).get("dtype")
            fixed["dtype"] = dtype if dtype in allowed else allowed[0]
            notes.append(f"in {fixed['dtype']}: {models.dtype_note}")
    return Proposal(config=None, phase="sampler", reason="; ".join(notes), fixed=fixed)


PHASES: list[Callable[[SearchPolicy, TrialHistory], Proposal | None]] = [
    SearchPolicy.probe, SearchPolicy.compiled_start, explore_phase, SearchPolicy.compiled_grow,
    SearchPolicy.raise_budget, SearchPolicy.scope_probe, SearchPolicy.grow_probe, cuda_graphs_phase,
    model_phase, fallbacks_phase]
"""The phases in the order they are asked (module doc)."""


# ---------------------------------------------------------------------- the glue to Optuna
class ModelAdvisor:
    """Enqueues the policy's proposals, vetoes predicted OOMs (``_dominance``), lets the models learn."""

    def __init__(self, *, space: SearchSpace, settings: TuneSettings) -> None:
        self.space = space
        self.settings = settings
        self.models = SearchModels(space=space, settings=settings)
        self.policy = SearchPolicy(space=space, models=self.models)
        self.errors: ModelErrors = self.models.errors  # the fits the search fell back from (saved in the study)
        self._predicted_in_a_row = 0

    @saves_errors
    def before_ask(self, study: optuna.Study, decision: Decision | None = None) -> None:
        """Enqueue the policy's next proposal when nothing is waiting. ``decision``: None: one of its own."""
        if decision is None:
            decision = Decision(study, num_layers=self.space.num_layers, device=self.settings.device)
        decision.errors = self.errors
        self.models.decision = decision  # the veto of the trial asked reads it too
        if study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return
        self.models.asks += 1
        view = decision.study
        history = TrialHistory.from_trials(
            view.get_trials(deepcopy=False), space=self.space, usable=self.models.usable(view),
            model_facts=view.user_attrs.get(StudyAttr.MODEL))
        proposal = self.policy.next(history)
        if proposal is not None and proposal.config is not None:
            self.models.proposed.add(proposal.config.to_json())
            study.enqueue_trial(self.space.params_from_config(proposal.config), user_attrs=proposal.user_attrs())
        elif proposal is not None and proposal.fixed:  # the sampler's trial, parameters pinned
            study.enqueue_trial(proposal.fixed, user_attrs=proposal.user_attrs())

    @saves_errors
    def holdout_error(self, study: optuna.Study) -> float | None:
        return eager_holdout_error(study, space=self.space, errors=self.errors)

    @saves_errors
    def compiled_holdout_error(self, study: optuna.Study) -> tuple[float, int] | None:
        return compiled_holdout_error(study, space=self.space, errors=self.errors)

    @saves_errors
    def predict_infeasible(self, study: optuna.Study,
                           config: BalanceConfig) -> tuple[TrialFigures, dict[str, Any]] | None:
        """Figures for a config that will not fit (``_dominance``); None to launch it (always after
        :data:`MAX_PREDICTED_IN_A_ROW` vetoes in a row)."""
        usable = self.models.usable(study)
        if usable is None or self._predicted_in_a_row >= MAX_PREDICTED_IN_A_ROW:
            return None
        headroom = self.settings.headroom
        if (dominated := dominating_over_cap(study.get_trials(deepcopy=False), config)) is not None:
            self._predicted_in_a_row += 1
            return dominance_veto(config, *dominated, usable=usable, headroom=headroom)
        if (model := self.models.refit(study)) is None:
            return None
        compiled = None  # compiled memory follows the budget: the compiled model's bounds
        if config.compile != "off":
            compiled = self.models.compiled or self.models.compiled_for(study, model)
        verdict = model_veto(model, compiled, config, usable=usable, headroom=headroom,
                             num_layers=self.space.num_layers)
        if not isinstance(verdict, tuple):  # True: predicted to fit; None: the models cannot say
            if verdict:
                self._predicted_in_a_row = 0
            return None
        self._predicted_in_a_row += 1
        return verdict

    def after_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """The models learn from ``trial`` (``SearchModels.learn``)."""
        self.models.learn(study, trial)
