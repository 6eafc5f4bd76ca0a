"""The search policy: where the next trial is chosen.

:meth:`SearchPolicy.next` reads the study once as a :class:`TrialHistory` (the policy's only reader of
the trials' attributes; other workers' running trials included, so parallel tuners do not propose
what another is measuring) and walks its phases in order: the first that applies proposes the next
trial as a :class:`Proposal` (configuration, phase, reason, prediction); a proposal the time budget
cannot hold (its compile priced per scope, verification's reserve after it) gives way to the next
phase's. :class:`ModelAdvisor` (at the end of this module, the glue to Optuna) enqueues it, so
the study stays a plain Optuna study (dashboard, resume, several workers); when no phase proposes,
the trial is the sampler's. Every trial line and the dashboard show the phase and its prediction.

| phase | applies when | proposes |
|---|---|---|
| ``probe`` | GPU, compile searched, nothing compiled yet, and no half-precision eager trial without checkpointing has measured what the model holds apart from activations | one such eager trial at the smallest micro-batch the space holds: the held memory and the per-sample activations, in seconds, no compile |
| ``compiled-start`` | GPU, compile searched, nothing compiled yet, the probe measured | the cheapest scope to compile (``regional`` when searched), the first half dtype, budget 1.0, the largest micro-batch predicted to fit (:func:`first_compiled_micro_batch`) among splits of one micro-step size per rank (:func:`one_size`; two sizes only where the space holds none), fewest micro-steps |
| ``explore`` | every third ask: on CPU always, on a GPU once the models' proposals stopped improving (``_models.proposals_stalled``) | the sampler's trial (a dtype held back pinned; eager when no compile fits in the time left) |
| ``compiled-grow`` | a compiled trial fitted, and a split of fewer micro-steps (same scope and dtype) was never tried | from the best compiled trial, the next split of one micro-step size per rank whose largest budget predicted to fit is at least :data:`GROW_MIN_BUDGET`, at that budget; once a two-size split measured within :data:`SAME_WITHIN` of the best, every split: the fewest micro-steps predicted to fit at budget 1.0 (straight there), else one micro-step fewer |
| ``raise-budget`` | one rank; the best compiled trial ran below budget 1.0 and its measured peak leaves room | that trial at the largest higher budget whose peak, its measured one plus the compiled model's change from its budget counted 1 + :data:`RAISE_CHANGE_MARGIN` times, stays within the usable memory (the margin on what is predicted, not on what was measured), and below any budget that did not fit at that split: the partitioner recomputes less, and the step's time falls steeply with the budget (regional 8 x 4, loss outside, on the H200: 185.8 ms at 0.5, 172.5 at 0.7, 143.3 at 0.85); where only the doubled change leaves no room, a measured step: one budget step above the highest budget measured to fit at that split (unless it ran slower than the best beyond :data:`SAME_WITHIN`), while its measured peak plus the change of one step fits - the change the split's own measured budgets showed, or with one measured there the compiled model's, counted once |
| ``scope-probe`` | growing stopped; a searched scope never ran, or one of the :data:`SCOPE_TRANSFERS` fastest compiled splits (within :data:`TRANSFER_WITHIN` of the fastest) never ran in another searched scope; the time budget holds a compile of that scope | a scope's first trial: the best split measured in another scope (one micro-step size per rank unless two sizes measured competitive) at the largest budget per rank the models predict to fit there, never below the one it ran at (what fitted in one scope is the best evidence for the other); then each fast configuration in the other scope, budget unchanged: whether, and where, that scope wins |
| ``grow-probe`` | growing, raising and the scope probe propose nothing; in a scope, fewer micro-steps measured faster beyond :data:`SAME_WITHIN`; the next split of one size per rank never ran there and fits only below :data:`GROW_MIN_BUDGET` or at no budget the model's prior curve allows | a measured step: that split at the largest budget predicted to fit (at least :data:`LOW_BUDGET`), else at :data:`LOW_BUDGET`, where without recomputation the cost per micro-step the two trials measured puts it under the best measured step (the recomputation's cost at that budget is outside every model's support: one trial measures it; ``raise-budget`` climbs from there) |
| ``cuda-graphs`` | ``--compile-mode auto``, the best trial is a default-mode compiled one, graphs untried, time holds a compile | the best configuration with CUDA graphs: one compile measures whether they pay (``_models.graph_probe``) |
| ``model`` | the memory and compiled models have fitted | their best-ranked configuration predicted to fit (``compiled-model`` or ``memory-model``); a budget below :data:`LOW_BUDGET` only where a higher one was measured at that micro-batch and scope; compiled, one micro-step size per rank unless two sizes measured competitive; a compiled time predicted outside the step-time model's support (:meth:`TrialHistory.time_supported`) ranks after every one inside it, and the trial says it extrapolates |
| ``prior``, ``sampler`` | nothing else proposes | the least memory the priors know while nothing fits (GPU); else the sampler |

The policy's constants (:data:`KEEP_AT_FULL_BUDGET`, :data:`FIT_MARGIN`, :data:`LOW_BUDGET`, ...) live
with every other decision constant in ``_constants``, each with the measurement it comes from.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Sequence
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
    from autobalance.tuner.search._timing import StepTimeModel

__all__ = ["BUDGET_CEILING", "FIT_MARGIN", "GROW_MIN_BUDGET", "HALF_DTYPES", "KEEP_AT_FULL_BUDGET", "LOW_BUDGET",
           "PHASES", "SCOPE_TRANSFERS", "ModelAdvisor", "Proposal", "Record", "SearchPolicy", "TrialHistory",
           "first_compiled_micro_batch", "one_size", "proposal_line"]

HALF_DTYPES = ("bf16", "fp16")


def one_size(config: BalanceConfig) -> bool:
    """Whether each rank's micro-steps are of one size (its samples divided evenly among them): compiled,
    a static batch dimension; two sizes compile it dynamic, which ran 1.6-1.7x slower on one H200
    (5,5,5,5,4,4,4: 255-275 ms where 8 x 4 ran 159 ms)."""
    return all(len(set(config.micro_step_sizes(r))) == 1 for r in range(config.world_size))


@dataclass(frozen=True, kw_only=True)
class Record:
    """One trial as the policy reads it."""

    number: int
    config: BalanceConfig | None
    """Its configuration (for a running trial: from its parameters; None: not known)."""
    status: str | None
    """Its :class:`Status` (None: running or waiting)."""
    running: bool
    peaks_gib: list[float | None] = field(default_factory=list)
    held_gib: list[float | None] = field(default_factory=list)
    step_ms: float | None = None
    feasible: bool = False
    reused: bool = False
    phase: str | None = None

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
    usable_gib: list[float]
    """Per rank, the memory a trial may use (cap x (1 - headroom))."""
    device: str
    loss_in_model: bool | None = None
    """The baseline's report: the loss computed inside the wrapped model (None: not reported)."""

    @classmethod
    def from_trials(cls, trials: Sequence[FrozenTrial], *, space: SearchSpace, usable: list[float] | None,
                    device: str, model_facts: dict[str, Any] | None = None) -> TrialHistory:
        records = []
        for t in trials:
            a = t.user_attrs
            running = t.state in (TrialState.RUNNING, TrialState.WAITING)
            cfg: BalanceConfig | None = None
            raw = a.get(TrialAttr.CONFIG)
            try:
                if raw:
                    cfg = BalanceConfig.from_dict(raw)
                elif running and t.params:  # another worker's trial being measured: what it runs
                    cfg = space.config_from_params(t.params)
            except (ConfigError, KeyError, TypeError, ValueError):  # a damaged attribute or partial params
                cfg = None
            records.append(Record(
                number=t.number, config=cfg, status=None if running else a.get(TrialAttr.STATUS), running=running,
                peaks_gib=list(a.get(TrialAttr.PEAK_DEVICE_GIB) or []), held_gib=list(a.get(TrialAttr.HELD_GIB) or []),
                step_ms=a.get(TrialAttr.STEP_TIME_MS), feasible=bool(a.get(TrialAttr.FEASIBLE)),
                reused=a.get(TrialAttr.REUSED_FROM) is not None, phase=a.get(TrialAttr.PROPOSAL_PHASE)))
        facts = model_facts or {}
        return cls(records=records, usable_gib=[u / GIB for u in (usable or [])], device=device,
                   loss_in_model=facts.get("loss_in_model") if isinstance(facts.get("loss_in_model"), bool) else None)

    def tried(self) -> set[str]:
        """Every configuration measured, predicted, reused, running or waiting (as JSON)."""
        return {r.config.to_json() for r in self.records if r.config is not None}

    def compiled_tried(self) -> list[Record]:
        """Compiled trials launched, running or waiting (reused and predicted ones left out)."""
        return [r for r in self.records if r.compiled and (r.running or r.measured or r.status == Status.OOM)]

    def eager_probe(self) -> tuple[Record, float, float] | None:
        """The half-precision eager measurement without checkpointing that gives the held memory and
        per-sample activations, ``(record, held GiB, activations GiB per sample)`` of its fullest rank;
        None before one."""
        best: tuple[Record, float, float] | None = None
        for r in self.records:
            cfg = r.config
            if (not r.measured or r.status != Status.OK or cfg is None or cfg.compile != "off"
                    or cfg.dtype not in HALF_DTYPES or any(cfg.checkpoint)):
                continue
            for rank, (peak, held) in enumerate(zip(r.peaks_gib, r.held_gib, strict=False)):
                if peak is None or held is None or peak <= held:
                    continue
                act = (float(peak) - float(held)) / cfg.micro_batches[rank]
                if best is None or held > best[1]:
                    best = (r, float(held), act)
        return best

    def eager_half_measured(self) -> bool:
        """Whether a half-precision eager trial without checkpointing ran to the end here."""
        return any(r.measured and r.status == Status.OK and r.config is not None and r.config.compile == "off"
                   and r.config.dtype in HALF_DTYPES and not any(r.config.checkpoint) for r in self.records)

    def fastest_compiled(self, n: int) -> list[Record]:
        """The ``n`` fastest feasible compiled trials measured here, fastest first."""
        ok = [r for r in self.records if r.measured and r.compiled and r.feasible and r.step_ms is not None]
        return sorted(ok, key=lambda r: float(r.step_ms or 0.0))[:n]

    def best_compiled(self) -> Record | None:
        """The fastest feasible compiled trial measured here (None: none)."""
        ok = [r for r in self.records if r.measured and r.compiled and r.feasible and r.step_ms is not None]
        return min(ok, key=lambda r: float(r.step_ms or 0.0)) if ok else None

    def two_sizes_compete(self) -> bool:
        """Whether a compiled split of two micro-step sizes in a rank was measured here within
        :data:`SAME_WITHIN` of the best compiled trial (then such splits are proposed like any other)."""
        best = self.best_compiled()
        if best is None or best.step_ms is None:
            return False
        return any(r.measured and r.compiled and r.feasible and r.step_ms is not None and r.config is not None
                   and not one_size(r.config) and float(r.step_ms) <= float(best.step_ms) * (1.0 + SAME_WITHIN)
                   for r in self.records)

    def time_supported(self, config: BalanceConfig) -> bool:
        """Whether the step-time model's prediction for ``config`` lies inside what it was fitted on:
        eager always (its terms are per sample and per micro-step); compiled, a trial of its compile
        key and dtype measured, its lowest budget at or above the lowest measured there (below, the
        recomputation term is extrapolated: 44 ms predicted at budget 0.3 from trials at 0.55-1.0 for a
        configuration that ran 164 ms), and its largest micro-batch within the measured ones' range."""
        if config.compile == "off":
            return True
        key = config_compile_key(config)
        budgets, micros = [], []
        for r in self.records:
            c = r.config
            if (not r.measured or r.status != Status.OK or r.step_ms is None or c is None or c.compile == "off"
                    or config_compile_key(c) != key or c.dtype != config.dtype):
                continue
            budgets.append(min(c.activation_budget or [1.0]))
            micros.append(max(c.micro_batches))
        if not budgets:
            return False
        m = max(config.micro_batches)
        return min(config.activation_budget or [1.0]) >= min(budgets) - 1e-9 and min(micros) <= m <= max(micros)

    def compiled_splits(self) -> set[tuple[str, str]]:
        """(compile key, micro-batches as JSON) of every compiled trial launched, running or predicted."""
        return {(config_compile_key(r.config), json.dumps(r.config.micro_batches)) for r in self.records
                if r.config is not None and r.config.compile != "off" and not r.reused}

    def measured_scopes(self) -> set[str]:
        """The compile scopes of the compiled trials measured here (that ran to the end)."""
        return {r.config.compile_scope for r in self.records
                if r.measured and r.status == Status.OK and r.config is not None and r.config.compile != "off"}

    def over_budgets(self, config: BalanceConfig) -> list[float]:
        """Budgets at which ``config``'s split (its compile key, dtype and micro-batches) ran out of
        memory or over the usable memory: a higher budget keeps at least as much (the partitioner's
        budget is monotone where it is not low)."""
        key, split = config_compile_key(config), json.dumps(config.micro_batches)
        out = []
        for r in self.records:
            c = r.config
            if (not r.measured or c is None or c.compile == "off" or config_compile_key(c) != key
                    or c.dtype != config.dtype or json.dumps(c.micro_batches) != split):
                continue
            over = r.status == Status.OOM or (bool(self.usable_gib) and any(
                p is not None and p > u for p, u in zip(r.peaks_gib, self.usable_gib, strict=False)))
            if over:
                out.append(min(c.activation_budget or [1.0]))
        return out

    def slower_with_more_steps(self, base: Record) -> Record | None:
        """A measured feasible trial of ``base``'s compile key and dtype with more micro-steps that ran
        slower than ``base`` beyond :data:`SAME_WITHIN` (None: none): fewer micro-steps measured faster."""
        cfg = base.config
        if cfg is None or base.step_ms is None:
            return None
        key = config_compile_key(cfg)
        out = [r for r in self.records if r.measured and r.feasible and r.step_ms is not None and r.config is not None
               and r.config.compile != "off" and config_compile_key(r.config) == key and r.config.dtype == cfg.dtype
               and r.config.accumulation > cfg.accumulation
               and float(r.step_ms) > float(base.step_ms) * (1.0 + SAME_WITHIN)]
        return min(out, key=lambda r: float(r.step_ms or 0.0)) if out else None

    def lowest_budget(self, config: BalanceConfig) -> float:
        """The lowest budget measured (fitted or not) in ``config``'s compile key and dtype, any split (1.0:
        none below it)."""
        key = config_compile_key(config)
        return min([1.0, *(min(r.config.activation_budget or [1.0]) for r in self.records
                           if r.measured and r.config is not None and r.config.compile != "off"
                           and config_compile_key(r.config) == key and r.config.dtype == config.dtype)])

    def budget_ladder(self, config: BalanceConfig) -> list[tuple[float, float, float]]:
        """``config``'s split (compile key, dtype, micro-batches, one rank) as measured to fit here:
        ``(budget, peak GiB, step ms)`` per budget, ascending (a budget measured twice: its later trial)."""
        key, split = config_compile_key(config), json.dumps(config.micro_batches)
        out: dict[float, tuple[float, float, float]] = {}
        for r in self.records:
            c = r.config
            if (not r.measured or not r.feasible or r.step_ms is None or c is None or c.compile == "off"
                    or config_compile_key(c) != key or c.dtype != config.dtype or json.dumps(c.micro_batches) != split
                    or not r.peaks_gib or r.peaks_gib[0] is None):
                continue
            b = round(min(c.activation_budget or [1.0]), 6)
            out[b] = (b, float(r.peaks_gib[0]), float(r.step_ms))
        return [out[b] for b in sorted(out)]

    def ladder_slope(self, config: BalanceConfig) -> float | None:
        """The largest rise of the measured peak per unit of budget between two budgets measured to fit at
        ``config``'s split (:meth:`budget_ladder`), GiB; None: fewer than two measured there."""
        ladder = self.budget_ladder(config)
        if len(ladder) < 2:
            return None
        return max(max(0.0, (p1 - p0) / (b1 - b0)) for (b0, p0, _), (b1, p1, _) in itertools.pairwise(ladder))

    def measured_budget(self, key: str, micro_batch: int) -> float | None:
        """The highest budget measured at ``micro_batch`` (largest on any rank) for the compile key ``key``."""
        out: float | None = None
        for r in self.records:
            cfg = r.config
            if not r.measured or cfg is None or cfg.compile == "off" or config_compile_key(cfg) != key:
                continue
            if max(cfg.micro_batches) != micro_batch:
                continue
            b = min(cfg.activation_budget or [1.0])
            out = b if out is None else max(out, b)
        return out


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """The next trial: what to run, which phase chose it, why, and what it is predicted to do."""

    config: BalanceConfig | None
    """None: the sampler's trial (``fixed`` may pin some of its parameters)."""
    phase: str
    reason: str
    predicted_ms: float | None = None
    predicted_peak_gib: list[float] | None = None
    fixed: dict[str, Any] = field(default_factory=dict)
    """For the sampler's trial: parameters pinned (a dtype held back, eager when no compile fits in time)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """More attributes the trial records (``proposal_new_graphs``, ...)."""

    def prediction_text(self) -> str:
        """``131 ms, 13.9 GiB predicted`` (empty without a prediction)."""
        parts = []
        if self.predicted_ms is not None:
            parts.append(f"{self.predicted_ms:.0f} ms")
        if self.predicted_peak_gib:
            parts.append(memory_text(max(self.predicted_peak_gib)))
        return ", ".join(parts) + " predicted" if parts else ""

    def user_attrs(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {TrialAttr.PROPOSAL_PHASE: self.phase, TrialAttr.PROPOSAL_REASON: self.reason,
                                 **self.extra}
        if self.config is not None:
            attrs["proposed_config"] = self.config.to_dict()
        if self.predicted_ms is not None:
            attrs["proposal_step_ms"] = round(self.predicted_ms, 3)
        if self.predicted_peak_gib is not None:
            attrs["proposal_peak_gib"] = [round(p, 4) for p in self.predicted_peak_gib]
        return attrs


def proposal_line(attrs: dict[str, Any]) -> str:
    """A trial's phase and prediction as its console line shows them, from its attributes:
    ``compiled-grow: 13.6 GiB predicted``, ``compiled-model: 169 ms, 12.6 GiB predicted``, ``sampler``
    (empty: nobody proposed it, as for a trial from before the policy)."""
    phase = attrs.get(TrialAttr.PROPOSAL_PHASE)
    if not phase:
        return ""
    parts = []
    ms = attrs.get("proposal_step_ms")
    if isinstance(ms, (int, float)):
        parts.append(f"{ms:.0f} ms")
    peaks = attrs.get("proposal_peak_gib")
    if isinstance(peaks, list) and peaks and all(isinstance(p, (int, float)) for p in peaks):
        parts.append(memory_text(max(peaks)))
    extrapolated = " (extrapolated)" if attrs.get("proposal_extrapolated") and parts else ""
    return f"{phase}: {', '.join(parts)} predicted{extrapolated}" if parts else str(phase)


def first_compiled_micro_batch(*, held_gib: float, act_gib: float, usable_gib: float, keep: float,
                               candidates: Sequence[int]) -> int | None:
    """The largest of ``candidates`` (largest micro-batches of the space's splits) whose predicted
    peak at budget 1.0, ``held + m * act * keep``, stays :data:`FIT_MARGIN` below ``usable``; None:
    none does."""
    limit = usable_gib * (1.0 - FIT_MARGIN)
    fits = [m for m in candidates if held_gib + m * act_gib * keep <= limit]
    return max(fits) if fits else None


Phase = Callable[["SearchPolicy", TrialHistory], "Proposal | None"]


class SearchPolicy:
    """The ordered phases (module doc) over the models of the decision in progress (``_models.SearchModels``)."""

    def __init__(self, *, space: SearchSpace, models: SearchModels) -> None:
        self.space = space
        self.models = models

    @property
    def on_gpu_compiling(self) -> bool:
        return self.models.settings.device == "cuda" and self.space.compile_searched

    def half_dtypes(self) -> list[str]:
        """The half dtypes the first trials may use (``_models.proposable_dtypes``' order, bf16 first)."""
        allowed = self.models.allowed_dtypes_now()
        return [d for d in allowed if d in HALF_DTYPES]

    def next(self, history: TrialHistory) -> Proposal | None:
        """The first phase's proposal that is new (not tried, not running elsewhere) and that the time
        budget holds (its compile and verification's reserve after it: a phase whose trial the budget
        cannot hold gives way to the next, cheaper one); None: the sampler's trial."""
        tried = history.tried()
        for phase in PHASES:
            proposal = phase(self, history)
            if proposal is None:
                continue
            if proposal.config is not None and (proposal.config.to_json() in tried
                                                 or self.models.unaffordable(proposal.config) is not None):
                continue
            if proposal.config is not None and proposal.predicted_ms is None:  # every line says its time too
                proposal = dataclasses.replace(proposal, predicted_ms=self.models.predicted_ms(proposal.config))
            return proposal
        return None

    # ------------------------------------------------------------------ phases
    def probe(self, history: TrialHistory) -> Proposal | None:
        if not self.on_gpu_compiling or "off" not in self.space.compile_modes or history.compiled_tried():
            return None
        if history.eager_probe() is not None or history.eager_half_measured():
            return None
        dtypes = self.half_dtypes()
        if not dtypes:
            return None
        acc = max(self.space.accumulations)
        tried = {r.config.to_json() for r in history.records if r.config is not None}
        for a in sorted(self.space.accumulations, reverse=True):  # the smallest micro-batch not yet tried
            cfg = _even_config(self.space, a, dtype=dtypes[0], compile="off")
            if cfg is not None and cfg.to_json() not in tried:
                acc = a
                break
        else:
            return None
        return Proposal(config=cfg, phase="probe", reason=(
            f"eager {dtypes[0]} at the smallest micro-batch ({max(cfg.micro_batches)} x {acc}), nothing checkpointed: "
            "measures the memory held apart from activations and the activations per sample in seconds, "
            "before any compile"))

    def compiled_start(self, history: TrialHistory) -> Proposal | None:
        if not self.on_gpu_compiling or history.compiled_tried():
            return None
        probe = history.eager_probe() or self.models.eager_estimate()
        dtypes = self.half_dtypes()
        if probe is None or not dtypes or not history.usable_gib:
            return None
        _, held, act = probe
        keep = KEEP_AT_FULL_BUDGET[history.loss_in_model is not False]
        scope = "regional" if "regional" in self.space.compile_scopes else "whole"
        mode = next(m for m in self.space.compile_modes if m != "off")
        splits = [c for c in (_even_config(self.space, acc, dtype=dtypes[0], compile=mode, scope=scope)
                              for acc in sorted(self.space.accumulations)) if c is not None]
        even = [c for c in splits if one_size(c)]
        by_micro: dict[int, BalanceConfig] = {}
        for cfg in even or splits:  # fewest micro-steps first: one per largest micro-batch; one size per rank
            by_micro.setdefault(max(cfg.micro_batches), cfg)  # when the space holds one (``one_size``)
        m = first_compiled_micro_batch(held_gib=held, act_gib=act, usable_gib=min(history.usable_gib), keep=keep,
                                       candidates=list(by_micro))
        if m is None:
            m = min(by_micro) if by_micro else None
        if m is None:
            return None
        cfg = by_micro[m]
        peak = held + m * act * keep
        return Proposal(config=cfg, phase="compiled-start", predicted_peak_gib=[peak], reason=(
            f"the first compiled trial: {scope} (the cheapest to compile), {cfg.dtype}, budget 1.0, the largest "
            f"micro-batch {'of micro-steps of one size ' if even else ''}predicted to fit ({m}: {memory_text(held)} held + {m} x {memory_text(act)} x {keep:g} "
            f"kept at budget 1.0 <= {memory_text(min(history.usable_gib))} usable)"))

    def compiled_grow(self, history: TrialHistory) -> Proposal | None:
        base = history.best_compiled()
        if base is None or base.config is None:
            return None
        cfg = base.config
        ran = history.compiled_splits()
        two_sizes = history.two_sizes_compete()
        options: list[tuple[int, BalanceConfig, list[float]]] = []
        for acc in sorted((a for a in self.space.accumulations if a < cfg.accumulation), reverse=True):  # one fewer first
            template = _even_config(self.space, acc, dtype=cfg.dtype, compile=cfg.compile, scope=cfg.compile_scope)
            if template is None or (config_compile_key(template), json.dumps(template.micro_batches)) in ran:
                continue
            if not two_sizes and not one_size(template):  # two sizes compile dynamic: slow unless measured not
                continue
            fits = self.models.largest_budgets(template)
            if fits is not None and min(fits) >= GROW_MIN_BUDGET:
                options.append((acc, template, fits))
        if not options:
            return None
        full = [o for o in options if min(o[2]) >= 1.0]  # fitting at the full budget: straight to the fewest
        # of one size per rank, the next split already doubles the micro-batch (32: 4 x 8, 8 x 4, 16 x 2):
        # one at a time, as far as the memory model reaches from what was measured (4 x 8 at 1.0 alone put
        # 16 x 2 at 1.0 within the usable memory; it peaked 20.9 GiB of 15.2)
        acc, template, fits = min(full, key=lambda o: o[0]) if full and two_sizes else options[0]
        grown = BalanceConfig.from_dict({**template.to_dict(), "activation_budget": fits,
                                         "bucket_cap_mb": cfg.bucket_cap_mb,
                                         "gradient_as_bucket_view": cfg.gradient_as_bucket_view})
        return Proposal(config=grown, phase="compiled-grow", predicted_peak_gib=self.models.compiled_peaks(grown),
                        reason=(
            f"fewer micro-steps in {cfg.compile_scope} {cfg.dtype} ({cfg.accumulation} -> {acc}, "
            f"from trial {base.number}) at the largest budget predicted to fit ({min(fits):g} >= {GROW_MIN_BUDGET:g}): "
            "a micro-step's launches cost the same whatever its size"))

    def raise_budget(self, history: TrialHistory) -> Proposal | None:
        base = history.best_compiled()
        if base is None or base.config is None or base.config.world_size != 1 or not history.usable_gib:
            return None  # several ranks: the model phase moves each rank's budget
        cfg = base.config
        b = (cfg.activation_budget or [1.0])[0]
        peak = base.peaks_gib[0] if base.peaks_gib else None
        if b >= BUDGET_CEILING or peak is None:
            return None
        ceiling = min([BUDGET_CEILING + 1e-9, *history.over_budgets(cfg)])
        limit = history.usable_gib[0]  # the measured peak is known: the margin is on the predicted change
        pick: tuple[float, float] | None = None
        slope = history.ladder_slope(cfg)  # GiB per unit of budget the split's own budgets measured (None: < 2)
        nb = round(b + BUDGET_STEP, 3)
        while nb < ceiling:
            change = self.models.peak_change(cfg, nb)
            if change is None:
                break
            # never less than the split's own measurements show: the model's curve is shared by every split
            # (a trial over the memory at another micro-batch lifts it at every budget above)
            grow = max(change[0], 0.0, (slope or 0.0) * (nb - b))
            if float(peak) + grow * (1.0 + RAISE_CHANGE_MARGIN) > limit:
                break
            pick = (nb, float(peak) + grow)
            nb = round(nb + BUDGET_STEP, 3)
        other = None if pick is None else BalanceConfig.from_dict({**cfg.to_dict(), "activation_budget": [pick[0]]})
        if pick is not None and other is not None and other.to_json() not in history.tried():
            return Proposal(config=other, phase="raise-budget", predicted_peak_gib=[pick[1]], reason=(
                f"the best compiled trial ({base.number}) at budget {pick[0]:g} instead of {b:g}: its measured "
                f"{memory_text(float(peak))} plus the compiled model's change"
                + (" (no less than the split's own measured budgets showed)" if slope is not None else "")
                + f" counted {1.0 + RAISE_CHANGE_MARGIN:g}x stays below {memory_text(history.usable_gib[0])} usable; "
                "less recomputed"))
        return _budget_step(self.models, history, base, limit=limit, ceiling=ceiling)

    def scope_probe(self, history: TrialHistory) -> Proposal | None:
        if len(self.space.compile_scopes) < 2:
            return None
        ran = history.compiled_splits()
        measured = history.measured_scopes()
        for scope in self.space.compile_scopes:  # a scope not measured yet: where it most likely wins
            if scope in measured:
                continue
            first = self._scope_start(history, scope, ran)
            if first is not None:
                return first
        fastest = history.fastest_compiled(len(history.records))
        if not history.two_sizes_compete():  # two sizes compile dynamic: slow unless measured not (``one_size``)
            fastest = [r for r in fastest if r.config is not None and one_size(r.config)]
        top = float(fastest[0].step_ms or 0.0) if fastest else 0.0
        for source in fastest[:SCOPE_TRANSFERS]:
            if float(source.step_ms or 0.0) > top * TRANSFER_WITHIN:
                break  # not among the fast ones: another scope's compile would not pay for it
            cfg = source.config
            if cfg is None or cfg.compile != "default":
                continue
            for scope in self.space.compile_scopes:
                if scope == cfg.compile_scope:
                    continue
                other = BalanceConfig.from_dict({**cfg.to_dict(), "compile_scope": scope})
                if not self.space.contains(other) or (config_compile_key(other), json.dumps(other.micro_batches)) in ran:
                    continue
                if not self.models.time_holds_compile(scope):
                    return None
                new_scope = scope not in measured
                return Proposal(config=other, phase="scope-probe", predicted_peak_gib=None if new_scope else
                                self.models.compiled_peaks(other), reason=(
                    f"trial {source.number} compiled {scope} instead of {cfg.compile_scope}: "
                    + ("one compile measures whether that scope wins for this script" if new_scope else
                       "one of the fastest configurations measured in the other scope, as it fitted there (the "
                       "scopes' optima differ)")))
        return None

    def grow_probe(self, history: TrialHistory) -> Proposal | None:
        """``compiled-grow``'s measured step below :data:`GROW_MIN_BUDGET`, once growing, raising and the
        scope probe are done: the split of fewer micro-steps than the fastest one measured in a scope, at
        the largest budget the compiled model predicts to fit there, or at :data:`LOW_BUDGET` (the least
        memory the policy proposes where no higher budget was measured) when the model places it at no
        budget from a curve it never measured that low. Whether a larger micro-batch at a low budget beats
        a smaller one at a higher budget is the recomputation's cost, which no trial of the study has
        measured there (the step-time model's prior; on the H200 it ranged 0.1-0.7 of a step across
        scopes and placements): a prediction outside the model's support is no reason to propose, and no
        reason not to either, so one trial measures it. Proposed only where the measurements point that
        way - in that scope fewer micro-steps measured faster beyond the noise (:data:`SAME_WITHIN`) - and
        where it can win: the split without recomputation (the most it can gain), at the cost per micro-step
        those two trials measured (:func:`_micro_step_trend`), is faster than the best measured trial.
        ``raise-budget`` then climbs from its measured peak."""
        best = history.best_compiled()
        if best is None or best.step_ms is None:
            return None
        ran = history.compiled_splits()
        two_sizes = history.two_sizes_compete()
        seen: set[tuple[str, str]] = set()
        for base in history.fastest_compiled(len(history.records)):
            cfg = base.config
            if cfg is None or base.step_ms is None or (config_compile_key(cfg), cfg.dtype) in seen:
                continue
            seen.add((config_compile_key(cfg), cfg.dtype))  # the fastest of each scope and dtype
            slower = history.slower_with_more_steps(base)
            if slower is None:
                continue  # no measured evidence that fewer micro-steps pay in this scope
            for acc in sorted((a for a in self.space.accumulations if a < cfg.accumulation), reverse=True):
                template = _even_config(self.space, acc, dtype=cfg.dtype, compile=cfg.compile, scope=cfg.compile_scope)
                if template is None or (not two_sizes and not one_size(template)):
                    continue
                if (config_compile_key(template), json.dumps(template.micro_batches)) in ran:
                    break  # that split was tried: growing from it is ``compiled-grow``'s and ``raise-budget``'s
                fits = self.models.largest_budgets(template)
                if fits is not None and min(fits) >= GROW_MIN_BUDGET:
                    break  # ``compiled-grow`` proposes it
                bound = _micro_step_trend(base, slower, acc)  # budget 1.0: nothing recomputed
                if bound is None or bound >= float(best.step_ms):
                    break
                if fits is None and history.lowest_budget(template) <= LOW_BUDGET + 1e-9:
                    break  # the model's "no budget" rests on a budget measured that low: not a prior
                if fits is not None and min(fits) < LOW_BUDGET:
                    break  # it fits only where memory is not monotone in the budget (``LOW_BUDGET``)
                low = min(fits) if fits is not None else LOW_BUDGET
                budget = [low] * template.world_size
                grown = BalanceConfig.from_dict({**template.to_dict(), "activation_budget": budget,
                                                 "bucket_cap_mb": cfg.bucket_cap_mb,
                                                 "gradient_as_bucket_view": cfg.gradient_as_bucket_view})
                if not self.space.contains(grown):
                    break
                where = (f"the largest budget the compiled model predicts to fit ({low:g} < {GROW_MIN_BUDGET:g})"
                         if fits is not None and min(fits) >= LOW_BUDGET else
                         f"{LOW_BUDGET:g}, the least memory proposed unmeasured (the compiled model places it at no "
                         "budget from a curve it never measured that low)")
                return Proposal(config=grown, phase="grow-probe", predicted_peak_gib=self.models.compiled_peaks(grown),
                                extra={"proposal_extrapolated": True}, reason=(
                    f"a measured step: fewer micro-steps in {cfg.compile_scope} {cfg.dtype} ({cfg.accumulation} -> {acc}, "
                    f"from trial {base.number}, {float(base.step_ms):.0f} ms; trial {slower.number} with "
                    f"{slower.config.accumulation if slower.config else '?'} ran {float(slower.step_ms or 0.0):.0f} ms) "
                    f"at {where}: without recomputation the measured cost per micro-step puts it at {bound:.0f} ms, "
                    f"against the best measured {float(best.step_ms):.0f} ms; what recomputing costs at that budget no "
                    "trial measured"))
        return None

    def _scope_start(self, history: TrialHistory, scope: str, ran: set[tuple[str, str]]) -> Proposal | None:
        """The first trial of ``scope``: the best split measured in another scope (one micro-step size per
        rank unless two sizes measured competitive: :meth:`TrialHistory.two_sizes_compete`), at the largest
        budget per rank the models predict to fit at that split (no lower than the budget it ran at: what
        fitted in one scope is the best evidence for the other; the kept fractions at 1.0 measured
        0.63-0.73 in both scopes with the loss inside); None: no such split, or it ran in ``scope``."""
        fastest = history.fastest_compiled(len(history.records))
        if not history.two_sizes_compete():
            fastest = [r for r in fastest if r.config is not None and one_size(r.config)]
        base = next((r for r in fastest if r.config is not None and r.config.compile_scope != scope), None)
        if base is None or base.config is None:
            return None
        cfg = base.config
        measured_at = list(cfg.activation_budget or [1.0] * cfg.world_size)
        fits = self.models.largest_budgets(cfg) or measured_at
        budgets = [max(f, b) for f, b in zip(fits, measured_at, strict=True)]
        source = BalanceConfig.from_dict({**cfg.to_dict(), "activation_budget": budgets})
        other = BalanceConfig.from_dict({**source.to_dict(), "compile_scope": scope})
        if not self.space.contains(other) or (config_compile_key(other), json.dumps(other.micro_batches)) in ran:
            return None
        if not self.models.time_holds_compile(scope):
            return None
        peaks = self.models.compiled_peaks(source)
        return Proposal(config=other, phase="scope-probe", predicted_peak_gib=peaks, reason=(
            f"the first {scope} trial: the best split measured in {cfg.compile_scope} (trial {base.number}, "
            f"{cfg.accumulation} micro-steps) at the largest budget predicted to fit there ({min(budgets):g}): "
            "one compile measures whether that scope wins for this script"))

# ---------------------------------------------------------------------- the policy's helpers
def _budget_step(models: SearchModels, history: TrialHistory, base: Record, *, limit: float,
                 ceiling: float) -> Proposal | None:
    """``raise-budget``'s measured step, where the change counted 1 + :data:`RAISE_CHANGE_MARGIN` times
    leaves no room: one step of the budget grid above the highest budget measured to fit at the best
    trial's split (scope, dtype, micro-batches), when that one ran within :data:`SAME_WITHIN` of the
    best (a higher budget measured slower beyond the noise is the direction measured against it) and
    its measured peak plus the change of one step stays within the usable memory - the change the
    split's own measured budgets showed (the largest per step between two of them), else, with one
    budget measured there, the compiled model's central prediction. The margin guards a jump the
    model draws through budgets it never measured at this split; a single step is a measurement
    instead: when it fits, the next decision steps from its measured peak; when it does not, it caps
    the split's budget (:meth:`TrialHistory.over_budgets`) and costs one trial."""
    cfg = base.config
    if cfg is None or base.step_ms is None:
        return None
    ladder = history.budget_ladder(cfg)  # (budget, peak GiB, step ms), ascending budgets, fitted
    if not ladder:
        return None
    top_b, top_peak, top_ms = ladder[-1]
    if top_ms > float(base.step_ms) * (1.0 + SAME_WITHIN):
        return None  # the higher budget ran slower beyond the noise
    nb = round(top_b + BUDGET_STEP, 3)
    if nb >= ceiling:
        return None
    slope = history.ladder_slope(cfg)
    if slope is not None:
        step = slope * BUDGET_STEP
        source = (f"the largest change per step its {len(ladder)} measured budgets at this split showed "
                  f"({step:+.2f} GiB)")
    else:
        change = models.peak_change(BalanceConfig.from_dict({**cfg.to_dict(), "activation_budget": [top_b]}), nb)
        if change is None:
            return None
        step = max(change[0], 0.0)
        source = f"the compiled model's change ({step:+.2f} GiB, counted once)"
    if top_peak + step > limit:
        return None
    other = BalanceConfig.from_dict({**cfg.to_dict(), "activation_budget": [nb]})
    return Proposal(config=other, phase="raise-budget", predicted_peak_gib=[top_peak + step], reason=(
        f"a measured step: trial {base.number}'s split at budget {nb:g}, one step above {top_b:g} (measured "
        f"{memory_text(top_peak)}, {top_ms:.0f} ms); {memory_text(top_peak)} plus {source} stays below "
        f"{memory_text(limit)} usable, where the model's change counted {1.0 + RAISE_CHANGE_MARGIN:g}x does not: "
        "one trial measures the peak there (the partitioner's memory rises in plateaus that a line through "
        "budgets measured at other splits does not see)"))


def _even_config(space: SearchSpace, acc: int, *, dtype: str, compile: str,
                 scope: str = "whole") -> BalanceConfig | None:
    """The even split of ``acc`` micro-steps, nothing checkpointed, budget 1.0 when compiled."""
    world = space.world_size
    total = space.micro_total(acc)
    if total < world:
        return None
    micro = split_evenly(total, [1.0] * world)
    rest: dict[str, Any] = {"checkpoint": [[] for _ in range(world)], "dtype": dtype, "bucket_cap_mb": 25.0,
                            "gradient_as_bucket_view": True, "compile": compile}
    if compile != "off":
        rest.update(compile_scope=scope, activation_budget=[1.0] * world)
    try:
        cfg = space.config_for(micro, acc, None, **rest)
    except (ConfigError, UsageError, ValueError):  # a split this space cannot hold
        return None
    return cfg if space.contains(cfg) else None


# ---------------------------------------------------------------------- the phases over the models' proposals
def _eager_first(models: SearchModels, study: optuna.Study, dtype: str) -> bool:
    """Whether ``dtype``'s compiled proposals wait for more eager trials (:data:`EAGER_FIRST`)."""
    if "off" not in models.space.compile_modes or models.model is None or models.model.is_fitted_for(dtype):
        return False
    eager = sum(1 for t in study.get_trials(deepcopy=False)
                if t.user_attrs.get(TrialAttr.STATUS) == Status.OK and t.user_attrs.get(TrialAttr.REUSED_FROM) is None
                and (t.user_attrs.get(TrialAttr.CONFIG) or {}).get("compile", "off") == "off"
                and (t.user_attrs.get(TrialAttr.CONFIG) or {}).get("dtype") == dtype)
    return eager < EAGER_FIRST


def explore_phase(policy: SearchPolicy, history: TrialHistory) -> Proposal | None:
    """The sampler's trial every ``SAMPLER_EVERY``-th ask: on CPU always (it explores what the
    models do not: bucket sizes, dtypes they cannot predict yet), on a GPU only once the models'
    proposals stopped improving (``_models.proposals_stalled``)."""
    models = policy.models
    study = models.study
    if models.asks % SAMPLER_EVERY == 0 and (
            models.settings.device != "cuda"
            or proposals_stalled(study.get_trials(deepcopy=False), study.user_attrs.get(StudyAttr.OBJECTIVE, {}))):
        return sampler_proposal(models, "explore: " + ("every third trial on CPU" if models.settings.device != "cuda"
                                                     else "the models' proposals stopped improving"))
    return None


def model_phase(policy: SearchPolicy, history: TrialHistory) -> Proposal | None:
    """The models' best new candidate (eager from the memory model, compiled from the compiled
    model), when it is worth a trial: under a time budget a compile must fit in the time left and
    promise a gain; a budget below ``LOW_BUDGET`` only where a higher one was measured at that
    micro-batch and scope; a compile scope only once a trial of it was measured (the scope probe
    brings in another: no borrowing across scopes); an eager candidate first while the compiled model has too few eager
    trials of its dtype (``EAGER_FIRST``)."""
    models = policy.models
    study = models.study
    candidates = models.scored_candidates(study)
    if not candidates:
        return None
    tried = history.tried() | models.proposed
    if _no_time_to_compile(models, study):  # no new graph that the time budget cannot hold
        candidates = [c for c in candidates if c.new_graphs == 0]
    elif models.decision_for(study).compile_limited:  # nor one of a scope whose compile it cannot hold
        dear = {scope for scope in models.space.compile_scopes if _no_time_to_compile(models, study, scope)}
        candidates = [c for c in candidates if c.new_graphs == 0 or c.config.compile == "off"
                      or c.config.compile_scope not in dear]
    scopes = history.measured_scopes() or {models.space.compile_scopes[-1]}  # regional first when searched
    if models.settings.device == "cuda" and history.best_compiled() is not None and not _eager_timed(history):
        # an eager proposal against a compiled best needs an eager time model of its own (three measured
        # eager splits): with fewer it is proportional and ranks launch-bound small micro-batches too well
        candidates = [c for c in candidates if c.config.compile != "off"]
    if not history.two_sizes_compete():  # compiled: one micro-step size per rank (``one_size``) where any fits
        even = [c for c in candidates if c.config.compile == "off" or one_size(c.config)]
        if any(c.config.compile != "off" for c in even) or not any(c.config.compile != "off" for c in candidates):
            candidates = even
    # a time predicted outside the step-time model's support is no reason to propose: those rank last
    inside = {id(c) for c in candidates if history.time_supported(c.config)}
    candidates = [c for c in candidates if id(c) in inside] + [c for c in candidates if id(c) not in inside]
    if not candidates:
        return None
    fresh = [c for c in candidates if c.config.to_json() not in tried and _low_budget_ok(history, c.config)
             and (c.config.compile == "off" or c.config.compile_scope in scopes)]
    best = best_value(study)
    if models.decision_for(study).compile_limited and best is not None:  # under a time budget a compile must promise a gain
        fresh = [c for c in fresh if c.new_graphs == 0 or c.score < best]
    if not fresh or fresh[0].score > WORTH * candidates[0].score:
        return None
    pick, note = fresh[0], None
    if pick.source == "compiled-model" and _eager_first(models, study, pick.config.dtype) and (
            history.eager_probe() is None):
        eager = [c for c in fresh if c.source == "memory-model" and c.config.dtype == pick.config.dtype]
        if eager:  # a few seconds that teach the compiled model its fixed part before a compile
            pick, note = eager[0], "eager first: teaches the memory model before compiling"
    extra: dict[str, Any] = {}
    if pick.source == "compiled-model":
        extra["proposal_new_graphs"] = pick.new_graphs
    if pick.extrapolated or id(pick) not in inside:
        extra["proposal_extrapolated"] = True
    reason = note or ("the compiled model's best configuration predicted to fit" if pick.source == "compiled-model"
                      else "the memory model's best configuration predicted to fit")
    if models.dtype_note and not note:
        reason += f" ({models.dtype_note})"
    return Proposal(config=pick.config, phase=pick.source, reason=reason, predicted_ms=pick.step_ms,
                    predicted_peak_gib=[p / GIB for p in pick.peaks], extra=extra)


def _micro_step_trend(base: Record, slower: Record, acc: int) -> float | None:
    """``base``'s measured step with ``acc`` micro-steps instead of its own, at the cost per micro-step
    that ``base`` and ``slower`` (same scope and dtype, more micro-steps) measured between them: a line
    through two measurements, nothing recomputed (the budget's cost is not in it). None: no such cost."""
    if base.config is None or slower.config is None or base.step_ms is None or slower.step_ms is None:
        return None
    steps = slower.config.accumulation - base.config.accumulation
    if steps <= 0:
        return None
    per_step = (float(slower.step_ms) - float(base.step_ms)) / steps
    return float(base.step_ms) - per_step * (base.config.accumulation - acc)


def _eager_timed(history: TrialHistory) -> bool:
    """Whether three distinct eager splits were measured (the eager time model's fixed terms are then seen)."""
    return len({json.dumps([r.config.accumulation, r.config.micro_batches]) for r in history.records
                if r.measured and r.status == Status.OK and r.config is not None and r.config.compile == "off"}) >= 3


def _low_budget_ok(history: TrialHistory, config: BalanceConfig) -> bool:
    """A budget below ``LOW_BUDGET`` only where a higher one was measured at that micro-batch and scope."""
    if config.compile == "off" or min(config.activation_budget or [1.0]) >= LOW_BUDGET:
        return True
    measured = history.measured_budget(config_compile_key(config), max(config.micro_batches))
    return measured is not None and measured >= LOW_BUDGET


def fallbacks_phase(policy: SearchPolicy, history: TrialHistory) -> Proposal | None:
    """When no phase proposes: the least memory the priors know while nothing fits (on a GPU), else
    the sampler."""
    models = policy.models
    study = models.study
    shard = _sharding_proposal(models, study, history)
    if shard is not None:
        return shard
    if models.settings.device == "cuda" and not any(r.status == Status.OK for r in history.records):
        probe = _probe(models, study)
        if probe is not None:
            return Proposal(config=probe, phase="prior", reason=(
                "nothing measured fits yet: the least memory the priors know, in "
                f"{probe.dtype} ({models.dtype_note or 'the dtype prior on a GPU'})"))
    return sampler_proposal(models, "the sampler's trial: the models propose nothing new worth a trial")


def _sharding_proposal(models: SearchModels, study: optuna.Study, history: TrialHistory) -> Proposal | None:
    """Parameter sharding where a rank's fixed part is large and nothing fits (``_sharding``)."""
    if len(models.space.param_shardings) <= 1:  # not searched
        return None
    found = sharding_proposal(study.get_trials(deepcopy=False), space_shardings=models.space.param_shardings,
                              model_facts=study.user_attrs.get(StudyAttr.MODEL), world_size=models.space.world_size,
                              usable=models.usable(study), unsharded=models.model,
                              tried=history.tried() | models.proposed, num_layers=models.space.num_layers)
    if found is None:
        return None
    config, reason, _fixed = found  # the fixed part only (in the reason): no peak predicted
    return Proposal(config=config, phase="shard", reason=reason)


def _graph_probe(models: SearchModels, study: optuna.Study) -> Proposal | None:
    """The CUDA-graph probe (:func:`graph_probe`) when there is one and the time budget holds a
    compile. Asked once the models promise nothing better than the best trial, and only when that
    is a default-mode compiled one: the probe measures graphs where the default mode's optimum is."""
    if _no_time_to_compile(models, study):
        return None
    top = best_trial(study)
    if top is None:
        return None
    if (top.user_attrs.get(TrialAttr.CONFIG) or {}).get("compile_scope", "whole") != "whole":
        # CUDA graphs capture the whole model: probed at the best whole-model trial within 2 % of the best
        whole = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                 if t.user_attrs.get(TrialAttr.FEASIBLE) and t.user_attrs.get(TrialAttr.STEP_TIME_MS)
                 and (t.user_attrs.get(TrialAttr.CONFIG) or {}).get("compile") == "default"
                 and (t.user_attrs.get(TrialAttr.CONFIG) or {}).get("compile_scope", "whole") == "whole"]
        best_ms = float(top.user_attrs.get(TrialAttr.STEP_TIME_MS) or 0.0)
        close = [t for t in whole if float(t.user_attrs[TrialAttr.STEP_TIME_MS]) <= 1.02 * best_ms]
        if not close:
            return None
        top = min(close, key=lambda t: float(t.user_attrs[TrialAttr.STEP_TIME_MS]))
    probe = graph_probe(study.get_trials(deepcopy=False), best=top, modes=models.space.compile_modes,
                        dtypes=models.allowed_dtypes(study))
    if probe is None or probe.to_json() in models.proposed or not models.space.contains(probe):
        return None
    return Proposal(config=probe, phase="cuda-graphs", reason=(
        f"CUDA graphs ({probe.compile}) at the best default-mode compiled configuration: one compile "
        "measures whether they pay for this script"))


def _probe(models: SearchModels, study: optuna.Study) -> BalanceConfig | None:
    """With nothing measured that fits (the script's own configuration ran out of memory): the
    least-memory configurations of the first allowed dtype, which the priors expect to fit - every
    block checkpointed (compiled only: the smallest budget), at the baseline's accumulation, then
    at the largest; None once both were tried."""
    trials = study.get_trials(deepcopy=False)
    if any(t.user_attrs.get(TrialAttr.STATUS) == Status.OK for t in trials):
        return None
    allowed = models.allowed_dtypes(study)
    if not allowed:
        return None
    number = study.user_attrs.get(StudyAttr.BASELINE)
    own = next((t.user_attrs.get(TrialAttr.CONFIG) or {} for t in trials if t.number == number), {})
    tried = {json.dumps(t.user_attrs.get(TrialAttr.CONFIG), sort_keys=True)
             for t in trials if t.user_attrs.get(TrialAttr.CONFIG)} | models.proposed
    world = models.space.world_size
    mode = "off" if "off" in models.space.compile_modes else models.space.compile_modes[0]
    layers = models.space.num_layers if mode == "off" else 0
    for acc in dict.fromkeys([int(own.get("accumulation") or 1), max(models.space.accumulations)]):
        if acc not in models.space.accumulations:
            continue
        micro = split_evenly(models.space.micro_total(acc), [1.0] * world)
        cfg = models.space.config_for(
            micro, acc, None, checkpoint=[list(range(layers)) for _ in range(world)], dtype=allowed[0],
            bucket_cap_mb=float(own.get("bucket_cap_mb") or 25.0),
            gradient_as_bucket_view=bool(own.get("gradient_as_bucket_view", True)), compile=mode,
            activation_budget=None if mode == "off" else [BUDGET_RANGE[0]] * world)
        if models.space.contains(cfg) and cfg.to_json() not in tried:
            return cfg
    return None


def _no_time_to_compile(models: SearchModels, study: optuna.Study, scope: str | None = None) -> bool:
    """Whether the time budget leaves less than the study's median compile (``TimeBudget.holds_compile``);
    ``scope``: a compile of that scope (``compile_times``)."""
    return models.space.compile_searched and not models.decision_for(study).holds_compile(scope)


def sampler_proposal(models: SearchModels, why: str) -> Proposal:
    """The sampler's trial. While some dtype is held back, its dtype is fixed to the best trial's
    (when allowed) or the first allowed one; when the time budget holds no compile, it runs eager
    (the sampler picks the rest)."""
    study = models.study
    fixed: dict[str, Any] = {}
    notes = [why]
    if _no_time_to_compile(models, study) and "off" in models.space.compile_modes:
        fixed["compile"] = "off"
        notes.append("eager: the time budget holds no compile")
    if models.settings.device == "cuda":
        allowed = models.allowed_dtypes(study, _timing(models, study))
        if allowed and len(allowed) < len(models.space.dtypes):
            best = best_trial(study)
            dtype = (best.user_attrs.get(TrialAttr.CONFIG) or {}).get("dtype") if best is not None else None
            fixed["dtype"] = dtype if dtype in allowed else allowed[0]
            notes.append(f"in {fixed['dtype']}: {models.dtype_note}")
    return Proposal(config=None, phase="sampler", reason="; ".join(notes), fixed=fixed)


def _timing(models: SearchModels, study: optuna.Study) -> StepTimeModel | None:
    """The step-time model on the study's trials (None: nothing measured yet)."""
    timing = models.decision_for(study).step_time
    return timing if timing.k else None


def cuda_graphs_phase(policy: SearchPolicy, history: TrialHistory) -> Proposal | None:
    """The CUDA-graph probe (:func:`_graph_probe`)."""
    return _graph_probe(policy.models, policy.models.study)


PHASES: list[Phase] = [SearchPolicy.probe, SearchPolicy.compiled_start, explore_phase, SearchPolicy.compiled_grow,
                       SearchPolicy.raise_budget, SearchPolicy.scope_probe, SearchPolicy.grow_probe, cuda_graphs_phase,
                       model_phase,
                       fallbacks_phase]
"""The phases in the order they are asked (module doc)."""

# ---------------------------------------------------------------------- the glue to Optuna
# The ``model`` strategy's glue: before each ask the policy's proposal is enqueued (an ordinary trial,
# so the study stays a plain Optuna study: dashboard, samplers, resume); the trial asked is vetoed when
# it cannot fit (recorded as ``predicted_oom``, not launched: ``_dominance``); after each trial the
# models learn from it (``_models``).


class ModelAdvisor:
    """Enqueues the policy's proposals, vetoes predicted OOMs, and lets the models learn from each trial."""

    def __init__(self, *, space: SearchSpace, settings: TuneSettings) -> None:
        self.space = space
        self.settings = settings
        self.models = SearchModels(space=space, settings=settings)
        """The models of the decision in progress (``_models``)."""
        self.policy = SearchPolicy(space=space, models=self.models)
        """Where the next trial is chosen (``_policy``)."""
        self._predicted_in_a_row = 0

    @property
    def errors(self) -> ModelErrors:
        """The fits the search fell back from (saved in the study after each call that fits)."""
        return self.models.errors

    @saves_errors
    def before_ask(self, study: optuna.Study, decision: Decision | None = None) -> None:
        """Enqueue the search policy's next proposal when nothing is waiting (``_policy``: the one
        place the next trial is chosen); no proposal: the sampler's trial. ``decision``: the loop's
        (the study read once, each model fitted once); None: one of its own."""
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
            device=self.settings.device, model_facts=view.user_attrs.get(StudyAttr.MODEL))
        proposal = self.policy.next(history)
        if proposal is None:
            return
        if proposal.config is None:  # the sampler's trial, some parameters pinned
            if proposal.fixed:
                study.enqueue_trial(proposal.fixed, user_attrs=proposal.user_attrs())
            return
        self.models.proposed.add(proposal.config.to_json())
        study.enqueue_trial(self.space.params_from_config(proposal.config), user_attrs=proposal.user_attrs())

    @saves_errors
    def holdout_error(self, study: optuna.Study) -> float | None:
        return eager_holdout_error(study, space=self.space, errors=self.errors)

    @saves_errors
    def compiled_holdout_error(self, study: optuna.Study) -> tuple[float, int] | None:
        return compiled_holdout_error(study, space=self.space, errors=self.errors)

    # ------------------------------------------------------------------ vetoes
    @saves_errors
    def predict_infeasible(self, study: optuna.Study, config: BalanceConfig) -> tuple[TrialFigures, dict[str, Any]] | None:
        """Figures for a config that will not fit (a measured trial it dominates did not, or the
        models are confident: ``_dominance``); None to launch it. After :data:`MAX_PREDICTED_IN_A_ROW`
        vetoes in a row the next configuration is launched whatever the models say."""
        usable = self.models.usable(study)
        if usable is None or self._predicted_in_a_row >= MAX_PREDICTED_IN_A_ROW:
            return None
        headroom = self.settings.headroom
        dominated = dominating_over_cap(study.get_trials(deepcopy=False), config)
        if dominated is not None:
            verdict: tuple[TrialFigures, dict[str, Any]] | bool | None = dominance_veto(
                config, *dominated, usable=usable, headroom=headroom)
        else:
            model = self.models.refit(study)
            if model is None:
                return None
            compiled = None
            if config.compile != "off":  # compiled memory follows the budget: the compiled model's measured bounds
                compiled = self.models.compiled if self.models.compiled is not None else self.models.compiled_for(study, model)
            verdict = model_veto(model, compiled, config, usable=usable, headroom=headroom,
                                 num_layers=self.space.num_layers)
        if verdict is None:  # the models cannot say
            return None
        if verdict is True:  # predicted to fit
            self._predicted_in_a_row = 0
            return None
        assert verdict is not False
        self._predicted_in_a_row += 1
        return verdict

    def after_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """The models learn from ``trial`` (``SearchModels.learn``)."""
        self.models.learn(study, trial)
