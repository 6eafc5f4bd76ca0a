"""The search's models over one decision (:class:`Decision`): the per-rank memory model and the
compiled memory model fitted from the study's trials, the candidates they rank by predicted
objective (:func:`eager_candidates`, :func:`compiled_candidates`), the dtypes they may propose
(:func:`proposable_dtypes`), when CUDA graphs are tried (:func:`graph_probe`), and what the policy's
phases ask of them (:class:`SearchModels`; a model that under-predicted a trial widens its margin:
:meth:`SearchModels.learn`)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable, Container, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._config import CUDA_GRAPH_MODES, BalanceConfig, split_evenly
from autobalance._errors import ConfigError, UsageError
from autobalance.protocol import (
    FAILED_STATUSES,
    GIB,
    NOT_COUNTED,
    Status,
    StudyAttr,
    TrialAttr,
    best_trial,
    objective_value,
    weighted_objective,
)
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner.search._compiled_model import (
    CompiledMemoryModel,
    compiled_observations,
    measured_peaks,
)
from autobalance.tuner.search._constants import (
    CACHE_TIE,
    GRAPH_GAIN,
    IMPROVES,
    NEIGHBOUR_RANKS,
    SLOW_DTYPE,
    STALL_AFTER,
)
from autobalance.tuner.search._dominance import dominating_over_cap
from autobalance.tuner.search._memory_model import (
    DEFAULT_SAFETY_MARGIN,
    MemoryModel,
    MemoryObservation,
)
from autobalance.tuner.search._model_errors import FIT_ERRORS, ModelErrors, attempt
from autobalance.tuner.search._objective import spread_fraction
from autobalance.tuner.search._sharding import SavingModel, study_savings
from autobalance.tuner.search._solver import (
    SplitPlan,
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
    config_compile_key,
    normalised_shares,
)
from autobalance.tuner.search._timing import (
    CompiledTimeModel,
    StepTimeModel,
    TimeBudget,
    compiled_graphs,
    graph_keys,
)

__all__ = ["HALF_DTYPES", "Candidate", "Decision", "SearchModels", "StudySnapshot", "cache_order",
           "compiled_candidates", "compiled_holdout_error", "eager_candidates",
           "eager_holdout_error", "graph_probe", "graphs_verdict", "observations_from_trials",
           "proposable_dtypes", "proposals_stalled", "saves_errors"]


_Method = TypeVar("_Method", bound=Callable[..., Any])


def saves_errors(method: _Method) -> _Method:
    """After a ``method(study, ...)``: the fit errors it caught saved in the study."""
    @functools.wraps(method)
    def saving(self: Any, study: optuna.Study, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, study, *args, **kwargs)
        finally:
            self.errors.save(study)
    return cast(_Method, saving)


class SearchModels:
    """The models of the decision in progress and what the phases ask of them."""

    def __init__(self, *, space: SearchSpace, settings: TuneSettings) -> None:
        self.space = space
        self.settings = settings
        self.model: MemoryModel | None = None
        """The memory model of the last decision that fitted one (corrected by :meth:`learn`)."""
        self.compiled: CompiledMemoryModel | None = None
        self.savings: SavingModel | None = None
        """What each parameter sharding saves per rank (``_sharding``); None: not searched."""
        self._margin = DEFAULT_SAFETY_MARGIN
        self._compiled_margin: float | None = None
        self.proposed: set[str] = set()
        """The configurations proposed so far (JSON)."""
        self.asks = 0
        """The asks so far (``explore`` paces the sampler by it)."""
        self.errors = ModelErrors()
        """The fits the search fell back from; saved in the study (:func:`saves_errors`)."""
        self.dtype_note = ""
        """Why the last proposals were held to some dtypes (``""``: none held back)."""
        self.decision: Decision | None = None
        """The decision in progress, from the advisor's ``before_ask`` until the next."""

    # ------------------------------------------------------------------ model
    def usable(self, study: optuna.Study) -> list[float] | None:
        capacity = self.settings.caps_bytes() or study.user_attrs.get(StudyAttr.CAPACITY)
        if not capacity:
            return None
        if len(capacity) == 1:
            capacity = capacity * self.space.world_size
        return [float(c) * (1.0 - self.settings.headroom) for c in capacity]

    def refit(self, study: optuna.Study) -> MemoryModel | None:
        """The memory model on ``study``'s trials: fitted once per decision (:attr:`decision`)."""
        decision = self._current(study)
        if decision is None:
            return self._refit(study)
        return decision.fitted(("memory", self._margin), lambda: self._refit(decision.study))

    def _refit(self, study: optuna.Study) -> MemoryModel | None:
        trials = study.get_trials(deepcopy=False)
        obs = observations_from_trials(trials, num_layers=self.space.num_layers)
        self.savings = None if len(self.space.param_shardings) < 2 else study_savings(
            trials, model_facts=study.user_attrs.get(StudyAttr.MODEL), world_size=self.space.world_size,
            num_layers=self.space.num_layers, unsharded=self._fit(obs))
        if self.savings is not None:  # sharded trials join as their unsharded peaks
            obs = observations_from_trials(trials, num_layers=self.space.num_layers, savings=self.savings)
        model = self._fit(obs)
        if model is not None:
            self._margin = model.safety_margin
            self.model = model
        return model

    def _fit(self, obs: list[MemoryObservation]) -> MemoryModel | None:
        """The model of ``obs`` (None: nothing fits, or the fit failed; noted in the errors)."""
        if not any(o.ok for o in obs):
            return None
        return attempt(self.errors, "memory model", MemoryModel.fit, obs,
                       world_size=self.space.world_size, safety_margin=self._margin)

    # ------------------------------------------------------------------ proposals
    def candidates(self, study: optuna.Study) -> list[tuple[float, BalanceConfig]]:
        """Configurations the models predict to fit with their predicted objective, best first."""
        return [(c.score, c.config) for c in self.scored_candidates(study)]

    @saves_errors
    def scored_candidates(self, study: optuna.Study) -> list[Candidate]:
        """:meth:`candidates` with their predictions, in the order of :func:`cache_order`."""
        model = self.refit(study)
        usable = self.usable(study)
        if model is None or usable is None:
            return []
        trials = study.get_trials(deepcopy=False)
        timing = self.decision_for(study).step_time
        reference = 1000 * float(ref) if (ref := study.user_attrs.get(StudyAttr.REFERENCE)) else None
        capacity = [u / (1.0 - self.settings.headroom) for u in usable]
        best = best_trial(study)  # its buckets, else DDP's defaults
        cfg = (best.user_attrs[TrialAttr.CONFIG] if best is not None
               else {"bucket_cap_mb": 25.0, "gradient_as_bucket_view": True})
        bucket, view = float(cfg["bucket_cap_mb"]), bool(cfg["gradient_as_bucket_view"])
        max_spread = self.settings.max_spread_gib * GIB if self.settings.max_spread_gib is not None else None

        def score(cfg: BalanceConfig, peaks: list[float], ms: float) -> float | None:
            return objective_value(spread_fraction(peaks, capacity), ms / (reference or ms),
                                   weight_spread=self.settings.weight_spread, weight_time=self.settings.weight_time)

        out = [] if "off" not in self.space.compile_modes else eager_candidates(
            space=self.space, model=model, timing=timing, usable=usable, bucket=bucket, view=view,
            max_spread=max_spread, score=score, errors=self.errors, savings=self.savings)
        compiled = self.compiled_for(study, model)
        if compiled is not None:
            found = compiled_candidates(space=self.space, trials=trials, memory=compiled, eager_timing=timing,
                                        timing=self.decision_for(study).compiled_time, usable=usable, bucket=bucket,
                                        view=view, max_spread=max_spread, score=score, errors=self.errors)
            # CUDA graphs only where a probe paid (graph_probe), under --compile-mode auto
            probed = "default" in self.space.compile_modes
            pays = {d: graphs_verdict(trials, d) == "pays" for d in self.space.dtypes} if probed else {}
            out += [c for c in found if not probed or c.config.compile not in CUDA_GRAPH_MODES
                    or pays.get(c.config.dtype, False)]
        return cache_order([c for c in out if c.config.dtype in self.allowed_dtypes(study, timing)])

    def allowed_dtypes(self, study: optuna.Study, timing: StepTimeModel | None = None) -> list[str]:
        """The dtypes the models may propose now (:func:`proposable_dtypes`); sets :attr:`dtype_note`."""
        tf32 = bool((study.user_attrs.get(StudyAttr.DEVICE) or {}).get("tf32"))  # the baseline's report
        allowed, self.dtype_note = proposable_dtypes(
            space=self.space, device=self.settings.device, trials=study.get_trials(deepcopy=False), tf32=tf32,
            asked="fp32" in (self.settings.dtypes or []), per_sample_ms=None if timing is None else dict(timing.k))
        return allowed

    def compiled_for(self, study: optuna.Study, model: MemoryModel | None) -> CompiledMemoryModel | None:
        """The compiled model on the study's compiled trials (None: compile not searched, or no ``model``)."""
        if model is None or not self.space.compile_searched:
            return None
        margin = max(model.safety_margin, self._compiled_margin or 0.0)
        self.compiled = self.decision_for(study).fitted(("compiled-memory", id(model), margin), lambda: (
            CompiledMemoryModel.fit(compiled_observations(study.get_trials(deepcopy=False)), eager=model,
                                    num_layers=self.space.num_layers, safety_margin=margin)))
        return self.compiled

    def decision_for(self, study: optuna.Study) -> Decision:
        """The decision in progress when ``study`` is its view, else one of its own (outside ``before_ask``)."""
        return self._current(study) or Decision(study, num_layers=self.space.num_layers, device=self.settings.device,
                                                errors=self.errors)

    def _current(self, study: optuna.Study) -> Decision | None:
        decision = self.decision
        return decision if decision is not None and (study is decision.study or study is decision.source) else None

    # ------------------------------------------------------------------ what the policy's phases ask
    @property
    def study(self) -> optuna.Study:
        assert self.decision is not None, "asked outside before_ask"
        return self.decision.study

    def allowed_dtypes_now(self) -> list[str]:
        return self.allowed_dtypes(self.study)

    def largest_budgets(self, config: BalanceConfig) -> list[float] | None:
        """Per rank, the largest budget the compiled model predicts to fit at ``config``'s micro-batches
        (its scope and dtype); None: a rank fits at none, or nothing to predict from."""
        model = self.refit(self.study)
        usable = self.usable(self.study)
        compiled = self.compiled_for(self.study, model)
        if compiled is None or usable is None or not model or not model.can_predict(config.dtype):
            return None
        key = config_compile_key(config)
        budgets = [compiled.largest_budget(rank=r, micro_batch=m, dtype=config.dtype, mode=key, limit=usable[r])
                   for r, m in enumerate(config.micro_batches)]
        return None if any(b is None for b in budgets) else [float(b) for b in budgets if b is not None]

    def eager_estimate(self) -> tuple[None, float, float] | None:
        """``(None, held GiB, activations GiB per sample)`` of the fullest rank in the first half
        dtype by the memory model (for trials that did not report the held memory)."""
        model = self.refit(self.study)
        half = next((d for d in self.allowed_dtypes_now() if d in HALF_DTYPES), None)
        if model is None or half is None or not model.can_predict(half):
            return None
        ranks = range(self.space.world_size)
        held = max(model.fixed_bytes(r, half) for r in ranks)
        act = max(model.per_sample_bytes(r, half, 0, max(1, self.space.num_layers)) for r in ranks)
        return None, held / GIB, act / GIB

    def predicted_ms(self, config: BalanceConfig) -> float | None:
        """The step-time models' prediction for ``config`` (ms; None: nothing to predict from)."""
        decision = self.decision_for(self.study)
        try:
            timing = decision.step_time
            if config.compile == "off":
                return timing.predict(config) if timing.k else None
            return decision.compiled_time.predict(config)
        except FIT_ERRORS:  # a fit that cannot be made says nothing: the proposal goes without a time
            return None

    def _compiled_now(self, dtype: str) -> CompiledMemoryModel | None:
        """The decision's compiled model (fitted once per decision) if it predicts ``dtype``."""
        compiled = self.decision_for(self.study).fitted(
            "compiled-now", lambda: self.compiled_for(self.study, self.refit(self.study)))
        return compiled if compiled is not None and compiled.eager.can_predict(dtype) else None

    def peak_change(self, config: BalanceConfig, budget: float) -> list[float] | None:
        """Per rank, the compiled model's change of the peak (GiB, no margins) from ``config``'s budgets
        to ``budget`` (None: no model)."""
        compiled = self._compiled_now(config.dtype)
        if compiled is None:
            return None
        other = BalanceConfig.from_dict({**config.to_dict(), "activation_budget": [budget] * config.world_size})
        return [(b - a) / GIB for a, b in zip(compiled.config_peaks(config), compiled.config_peaks(other), strict=True)]

    def compiled_peaks(self, config: BalanceConfig) -> list[float] | None:
        """The compiled model's predicted peaks of ``config``, GiB per rank (None: no model)."""
        compiled = self._compiled_now(config.dtype)
        return None if compiled is None else [p / GIB for p in compiled.config_peaks(config)]

    def unaffordable(self, config: BalanceConfig) -> str | None:
        """Why the time budget would not launch ``config`` (None: it would, or there is no budget)."""
        return self.decision_for(self.study).unaffordable(config)

    def time_holds_compile(self, scope: str | None = None) -> bool:
        """Whether the time budget holds a compile (``scope``: of that scope; ``TimeBudget.holds_compile``)."""
        return not self.space.compile_searched or self.decision_for(self.study).holds_compile(scope)

    def learn(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """A launched trial that OOMed although the model said it fits widens the safety margin; a
        compiled trial whose peak the compiled model under-predicted beyond its margin widens that one."""
        if self.compiled is not None and (trial.user_attrs.get(TrialAttr.CONFIG) or {}).get("compile", "off") != "off":
            for cobs in compiled_observations([trial]):
                self.compiled.correct(cobs)
            self._compiled_margin = self.compiled.safety_margin
            return
        if self.model is None or trial.user_attrs.get(TrialAttr.STATUS) != Status.OOM:
            return
        usable = self.usable(study)
        for obs in observations_from_trials([trial], num_layers=self.space.num_layers):
            self.model.correct(obs, limit=usable[obs.rank] if usable else None)
        self._margin = self.model.safety_margin


# ------------------------------- one decision: the study read once, each model fitted at most once
_T = TypeVar("_T")


class StudySnapshot:
    """``study``'s trials and user attributes as of its creation; every other attribute is the study's."""

    def __init__(self, study: optuna.Study) -> None:
        self._study = study
        self._trials = study.get_trials(deepcopy=False)
        self.user_attrs: dict[str, Any] = study.user_attrs

    def get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        trials = self._trials if states is None else [t for t in self._trials if t.state in states]
        return copy.deepcopy(trials) if deepcopy else list(trials)

    @property
    def trials(self) -> list[FrozenTrial]:
        return self.get_trials()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)


def finished_key(trials: Sequence[FrozenTrial]) -> tuple[tuple[int, int], ...]:
    """What the models are fitted from, in short: each finished trial's number and state (a trial's
    attributes are written before it finishes, and never after)."""
    return tuple((t.number, t.state.value) for t in trials if t.state.is_finished())


class Decision:
    """One choice of the next trial: the study read once (:class:`StudySnapshot`; uncached, ~35 storage
    reads of all trials per trial in a 10-minute replay) and each model fitted from it at most once
    (:meth:`fitted`). The loop rebuilds it only when a trial finished since (``TrialLoop.decision``)."""

    def __init__(self, study: optuna.Study, *, num_layers: int, device: str, errors: ModelErrors | None = None,
                 budget: TimeBudget | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.source = study
        """The study itself (writes go there); :attr:`study` is its :class:`StudySnapshot`."""
        self.study = cast(optuna.Study, StudySnapshot(study))
        self.trials = self.study.get_trials(deepcopy=False)
        self.key = finished_key(self.trials)
        self.num_layers = num_layers
        self.device = device
        self.errors = errors
        """Where a time model's fit notes what it fell back from (None: nowhere)."""
        self.budget = budget
        self.clock = clock
        """The time now (the replay's simulated clock)."""
        self._fits: dict[Hashable, Any] = {}

    def current(self, study: optuna.Study) -> bool:
        """Whether no trial of ``study`` finished since this decision read it."""
        return finished_key(study.get_trials(deepcopy=False)) == self.key

    def fitted(self, key: Hashable, fit: Callable[[], _T]) -> _T:
        """``fit()``'s result, computed once per ``key`` in this decision."""
        if key not in self._fits:
            self._fits[key] = fit()
        return cast(_T, self._fits[key])

    def unaffordable(self, config: BalanceConfig) -> str | None:
        """Why the time budget would not launch ``config`` now, verification's reserve after it
        included (None: it would, or there is no budget)."""
        return None if self.budget is None else self.budget.unaffordable(self, config)

    def holds_compile(self, scope: str | None = None) -> bool:
        """Whether the time left holds the study's median compile (``scope``: of that scope)."""
        return self.budget is None or self.budget.holds_compile(self, scope)

    @property
    def compile_limited(self) -> bool:
        """Whether the time budget limits compiles (it keeps time for verification)."""
        return self.budget is not None and self.budget.compile_left_s is not None

    @property
    def step_time(self) -> StepTimeModel:
        """The eager step-time model on this decision's trials."""
        return self.fitted("step-time", lambda: StepTimeModel.fit(self.trials, num_layers=self.num_layers,
                                                                   device=self.device, errors=self.errors))

    @property
    def compiled_time(self) -> CompiledTimeModel:
        """The compiled step-time model on this decision's trials (built on :attr:`step_time`)."""
        return self.fitted("compiled-time", lambda: CompiledTimeModel.fit(self.trials, eager=self.step_time,
                                                                           device=self.device))


# ------------------------------ which dtypes the models may propose, and when the sampler explores
HALF_DTYPES = ("bf16", "fp16")
"""Half-precision dtypes, in the order they are measured first."""


def _launched(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """Finished trials that ran their configuration (not predicted, not reused), by number."""
    return sorted((t for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
                   and t.user_attrs.get(TrialAttr.CONFIG)
                   and t.user_attrs.get(TrialAttr.STATUS) not in (*NOT_COUNTED, Status.PREDICTED_OOM)
                   and t.user_attrs.get(TrialAttr.REUSED_FROM) is None), key=lambda t: t.number)


def proposable_dtypes(*, space: SearchSpace, device: str, trials: Sequence[FrozenTrial], tf32: bool = False,
                      asked: bool = False, per_sample_ms: dict[str, float] | None = None) -> tuple[list[str], str]:
    """The dtypes the models may propose now, in the space's order, and why in words (``""``: all of
    them). On a CUDA device fp32 without TF32 costs about twice bf16 per sample (one H200: 1331-1340
    ms per step where bf16 ran 170-230 ms; field notes), so: the first half dtype (bf16, else fp16),
    the other once the first was measured or failed, and fp32 only when the space holds no half
    dtype, after the first dtype when ``asked`` (``--dtypes`` names it) or ``tf32`` (the script
    runs TF32), when every half dtype failed unmeasured, or when ``per_sample_ms`` (the step-time
    model's, by dtype) has it faster than every half dtype."""
    half = [d for d in HALF_DTYPES if d in space.dtypes]
    if device != "cuda" or not half:
        return list(space.dtypes), ""
    ran = [(str(a[TrialAttr.CONFIG].get("dtype")), str(a.get(TrialAttr.STATUS)))
           for a in [t.user_attrs for t in _launched(trials)]]
    measured = {d for d, status in ran if status in (Status.OK, Status.PRUNED)}
    failed = {d for d, status in ran if status in FAILED_STATUSES} - measured  # failed, never measured
    first = half[0]
    allowed = {first}
    why = f"{first} first (the dtype prior on a GPU)"
    if first in measured or first in failed:
        allowed |= set(half)
        why = "half precision first (fp32 without TF32 costs about twice bf16 on a GPU)"
    if "fp32" in space.dtypes:
        k = per_sample_ms or {}
        faster = "fp32" in k and any(d in k for d in half) and all(k["fp32"] < k[d] for d in half if d in k)
        if all(d in failed for d in half) or faster or ((tf32 or asked) and len(allowed) > 1):
            allowed.add("fp32")
    out = [d for d in space.dtypes if d in allowed]
    return out, ("" if len(out) == len(space.dtypes) else why)


def proposals_stalled(trials: Sequence[FrozenTrial], objective: dict[str, Any]) -> bool:
    """Whether the last :data:`STALL_AFTER` launched model proposals did not improve the best
    objective of the trials before them (an infeasible trial's value carries its violation, so it
    never improves on a feasible best). False before that many model proposals ran."""
    best = math.inf
    misses = 0
    for t in _launched(trials):
        values = t.values if t.state == TrialState.COMPLETE else None
        value = weighted_objective(values, objective) if values else math.inf
        if t.user_attrs.get("proposed_by") in ("memory-model", "compiled-model"):  # the models' proposals
            improved = value < best - IMPROVES * abs(best) if math.isfinite(best) else math.isfinite(value)
            misses = 0 if improved else misses + 1
        best = min(best, value)
    return misses >= STALL_AFTER


# ------------------------------------ CUDA graphs: probed once against the best default-mode trial
GraphVerdict = Literal["untried", "pays", "no-gain"]


def graphs_verdict(trials: Sequence[FrozenTrial], dtype: str) -> GraphVerdict:
    """Whether CUDA graphs paid in ``dtype``: a measured graph trial at least :data:`GRAPH_GAIN`
    faster than its measured default-mode twin (any such pair: ``pays``; pairs but none:
    ``no-gain``; no pair: ``untried``)."""
    measured: dict[str, tuple[BalanceConfig, float]] = {}  # ok, not reused: by JSON, with step ms
    for t in trials:
        a = t.user_attrs
        raw, ms = a.get(TrialAttr.CONFIG), a.get(TrialAttr.STEP_TIME_MS)
        if (t.state == TrialState.COMPLETE and a.get(TrialAttr.STATUS) == Status.OK and raw
                and isinstance(ms, (int, float)) and a.get(TrialAttr.REUSED_FROM) is None):
            config = BalanceConfig.from_dict(raw)
            measured[config.to_json()] = (config, float(ms))
    verdict: GraphVerdict = "untried"
    for cfg, ms in measured.values():
        if (cfg.compile not in CUDA_GRAPH_MODES or cfg.dtype != dtype
                or (twin := measured.get(dataclasses.replace(cfg, compile="default").to_json())) is None):
            continue
        if ms <= (1.0 - GRAPH_GAIN) * twin[1]:
            return "pays"
        verdict = "no-gain"
    return verdict


def graph_probe(trials: Sequence[FrozenTrial], *, best: FrozenTrial, modes: Sequence[str],
                dtypes: Sequence[str]) -> BalanceConfig | None:
    """The probe: the study's ``best`` trial in the first CUDA-graph mode searched, when it is a
    feasible default-mode compiled trial of an allowed dtype whose graphs are ``untried``; None
    otherwise (graphs not searched, or the probe launched already). Graphs pay only where the host's
    launch time bounds a step, which default-mode trials cannot tell (``docs/compile.md``): they are
    proposed only where a probe paid (:func:`graphs_verdict`)."""
    graph_modes = [m for m in modes if m in CUDA_GRAPH_MODES]
    cfg_dict = best.user_attrs.get(TrialAttr.CONFIG)
    if not graph_modes or "default" not in modes or not cfg_dict or not best.user_attrs.get(TrialAttr.FEASIBLE, True):
        return None
    cfg = BalanceConfig.from_dict(cfg_dict)
    if (cfg.compile != "default" or cfg.compile_scope != "whole" or cfg.dtype not in dtypes
            or graphs_verdict(trials, cfg.dtype) != "untried"):  # CUDA graphs: the whole model only
        return None
    probe = dataclasses.replace(cfg, compile=graph_modes[0])
    tried = {BalanceConfig.from_dict(t.user_attrs[TrialAttr.CONFIG]).to_json() for t in trials
             if t.user_attrs.get(TrialAttr.CONFIG)}
    return None if probe.to_json() in tried else probe


# ------------------------------- what the memory models are fitted from, and their held-out errors


def observations_from_trials(trials: list[FrozenTrial], *, num_layers: int,
                             savings: SavingModel | None = None) -> list[MemoryObservation]:
    """One observation per rank of every measured (ok) or OOMed trial (OOM peaks are lower bounds).
    A trial that sharded parameters is left out, or with ``savings`` taken as the unsharded peaks it
    implies: its peaks (and held memory) plus what it saved on each rank, holding the whole state."""
    obs: list[MemoryObservation] = []
    for t in trials:
        # the model is of eager memory; compiled trials follow their budget instead
        if (found := measured_peaks(t, compiled=False)) is None:
            continue
        attrs, (cfg, peaks), status = t.user_attrs, found, t.user_attrs[TrialAttr.STATUS]
        lift = [0.0] * len(peaks)
        state = attrs.get(TrialAttr.OPTIMIZER_STATE_BYTES) or []
        if cfg.get("param_sharding", "off") != "off":
            if savings is None:
                continue  # the model is of unsharded memory: what sharding saves is _sharding's term
            try:
                sharded = BalanceConfig.from_dict(cfg)
            except ConfigError:  # a damaged attribute
                continue
            lift = [savings.saving(sharded, r) for r in range(len(peaks))]
            # unsharded, each rank holds the whole state
            state = [] if savings.state_total is None else [savings.state_total] * len(peaks)
        measured = len(state) == len(peaks) and all(isinstance(v, (int, float)) for v in state)
        # the whole state: summed over the ranks when sharded, on every rank when not
        zero1 = cfg.get("optimizer_sharding", "off") == "zero1"
        whole = float(sum(state) if zero1 else max(state)) if measured else None
        held = attrs.get(TrialAttr.HELD_GIB) or []
        params = attrs.get(TrialAttr.PARAMETER_BYTES)
        params = float(params) if isinstance(params, (int, float)) and not isinstance(params, bool) else None
        for rank, peak in enumerate(peaks):
            if peak is None or peak <= 0:
                continue
            ob = MemoryObservation(
                rank=rank, micro_batch=int(cfg["micro_batches"][rank]), checkpointed=len(cfg["checkpoint"][rank]),
                num_layers=max(1, num_layers), dtype=cfg["dtype"], peak_bytes=float(peak) * GIB + lift[rank],
                ok=status == Status.OK, optimizer_bytes=float(state[rank]) if measured else None,
                optimizer_total=whole, parameter_bytes=params)
            rank_held = held[rank] if rank < len(held) else None
            if status == Status.OK and isinstance(rank_held, (int, float)) and 0 < rank_held < peak:
                # what the rank holds apart from activations: its fixed part, measured
                obs.append(dataclasses.replace(ob, micro_batch=0, checkpointed=0, held=True,
                                               peak_bytes=float(rank_held) * GIB + lift[rank]))
            obs.append(ob)
    return obs


def eager_holdout_error(study: optuna.Study, *, space: SearchSpace,
                        errors: ModelErrors | None = None) -> float | None:
    """Leave-one-trial-out mean relative error of the peak prediction over measured trials (a fit
    that fails leaves its trial out, noted in ``errors``)."""
    trials = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(TrialAttr.STATUS) == Status.OK
              and t.user_attrs.get(TrialAttr.REUSED_FROM) is None]
    held_out: list[float] = []
    for i, held in enumerate(trials):
        train = observations_from_trials(trials[:i] + trials[i + 1:], num_layers=space.num_layers)
        test = observations_from_trials([held], num_layers=space.num_layers)
        if not train or not test:
            continue
        model = attempt(errors, "holdout", MemoryModel.fit, train, world_size=space.world_size)
        if model is not None and all(model.is_confident(
                rank=o.rank, micro_batch=o.micro_batch, checkpointed=o.checkpointed,
                num_layers=o.num_layers, dtype=o.dtype) for o in test):
            held_out.append(model.holdout_error(test))
    return sum(held_out) / len(held_out) if held_out else None


def compiled_holdout_error(study: optuna.Study, *, space: SearchSpace,
                           errors: ModelErrors | None = None) -> tuple[float, int] | None:
    """Leave-one-trial-out mean relative error of the compiled model's per-rank peaks over the
    measured compiled trials (each predicted from the others), and how many were predicted."""
    if not space.compile_searched:
        return None
    trials = study.get_trials(deepcopy=False)
    obs = observations_from_trials(trials, num_layers=space.num_layers)
    if not any(o.ok for o in obs):
        return None
    eager = attempt(errors, "compiled holdout", MemoryModel.fit, obs, world_size=space.world_size)
    if eager is None:
        return None
    compiled = compiled_observations(trials)
    held_out: list[float] = []
    for number in sorted({o.trial for o in compiled if o.ok}):
        train = [o for o in compiled if o.trial != number]
        test = [o for o in compiled if o.trial == number and o.ok]
        if not train or not test:
            continue
        model = CompiledMemoryModel.fit(train, eager=eager, num_layers=space.num_layers)
        if all(eager.can_predict(o.dtype) for o in test):
            held_out.append(model.holdout_error(test))
    return (sum(held_out) / len(held_out), len(held_out)) if held_out else None


# ---------------------------------------------------------------------- the candidates
@dataclass(kw_only=True)
class Candidate:
    """One proposal with what the models predict for it: its objective (lower is better), peak bytes
    per rank, ms per optimizer step, the graphs no launched trial compiled yet, and whether the
    memory prediction goes beyond the measured data (the trial line says so)."""

    score: float
    config: BalanceConfig
    peaks: list[float]
    step_ms: float | None
    new_graphs: int = 0
    source: str = "memory-model"
    """``memory-model`` (eager) or ``compiled-model``."""
    extrapolated: bool = False


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


Score = Callable[[BalanceConfig, list[float], float], "float | None"]
"""(configuration, predicted per-rank peaks, predicted step ms) -> predicted objective."""


def compiled_candidates(
    *, space: SearchSpace, trials: Sequence[FrozenTrial], memory: CompiledMemoryModel, timing: CompiledTimeModel,
    eager_timing: StepTimeModel, usable: list[float], bucket: float, view: bool, max_spread: float | None,
    score: Score, errors: ModelErrors | None = None,
) -> list[Candidate]:
    """Compiled configurations predicted to fit, unordered; a balanced split the solver fails on is
    left out, noted in ``errors``.

    Per (dtype, compile mode, accumulation), the even split, the splits balancing the compiled peaks
    at budgets 1.0, 0.5 and 0.05 (rank 0 holds extras) and, with up to :data:`NEIGHBOUR_RANKS`
    ranks, their one-sample neighbours. Each rank takes the largest budget of the 0.05 grid
    predicted to fit, or a smaller one already compiled for the same (dtype, mode, buckets,
    micro-batch) within :data:`CACHE_TIE` of its recomputation (the per-study Inductor cache serves
    it). What a launched trial dominates is never proposed, so never compiled; nor is a dtype
    :data:`SLOW_DTYPE` times slower per sample.

    ZeRO-1 (``"zero1"`` searched, the optimizer state ``S`` measured): each split also gets a
    ``zero1`` variant whose shares water-fill ``S`` over the ranks' compiled bounds at budget 1.0
    (:func:`optimizer_shares`, ``base_r = fixed_r(0) + m_r * act_r * f(1) * (1 + extra(1))``): known
    before any budget is chosen, where the unsharded budget may not exist (the case ZeRO-1 is for).
    Each rank then takes its largest budget with ``fixed_r(q_r) = fixed_r + S * q_r``. The splits
    balanced on the fixed parts with the state placed on them alone (``base_r = fixed_r(0)``) get a
    ``zero1`` variant only."""
    modes = [(compile_key(m, scope), m, scope) for m in space.compile_modes if m != "off"
             for scope in space.compile_scopes if scope == "whole" or m not in CUDA_GRAPH_MODES]
    if not modes:
        return []
    world = space.world_size
    done = compiled_graphs(trials)
    seen: set[str] = set()
    out: list[Candidate] = []
    shard = "zero1" in space.shardings and memory.eager.can_shard
    state = memory.eager.optimizer_bytes(None)

    @functools.cache
    def budget_for(rank: int, m: int, dtype: str, mode: str, share: float | None) -> float | None:
        top = memory.largest_budget(rank=rank, micro_batch=m, dtype=dtype, mode=mode,
                                    limit=usable[rank], optimizer_share=share)
        if top is None:
            return None
        same = (dtype, mode, float(bucket), m)
        ready = sorted((g[4] for g in done if g[:4] == same and g[4] <= top), reverse=True)
        tie = timing.recompute_factor(dtype, mode, top) * (1.0 + CACHE_TIE)
        return next((b for b in ready if timing.recompute_factor(dtype, mode, b) <= tie), top)

    def zero_shares(micro: list[int], dtype: str, mode: str) -> list[float]:
        base = [memory.bound(rank=r, micro_batch=m, budget=1.0, dtype=dtype, mode=mode, optimizer_share=0.0)
                for r, m in enumerate(micro)]
        return normalised_shares(optimizer_shares(base=base, state=state, limits=usable))

    def fixed_shares(dtype: str) -> list[float]:
        base = [memory.eager.fixed_bytes(r, dtype, 0.0) for r in range(world)]
        return optimizer_shares(base=base, state=state, limits=usable)

    def consider(micro: list[int], acc: int, dtype: str, target: tuple[str, str, str], zero: bool) -> None:
        mode, compile_mode, scope = target
        placed = attempt(errors, "compiled search", zero_shares, micro, dtype, mode) if zero else None
        if zero and placed is None:
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
        if dominating_over_cap(list(trials), cfg) is not None:
            return  # never compile what a launched trial proves cannot fit
        if memory.clamped(cfg):
            return  # an impossible prediction (below what a rank holds apart from activations): no proposal
        peaks = memory.config_peaks(cfg)
        if max_spread is not None and max(peaks) - min(peaks) > max_spread:
            return
        ms = timing.predict(cfg)
        value = None if ms is None else score(cfg, peaks, ms)
        if value is not None:
            out.append(Candidate(score=value, config=cfg, peaks=peaks, step_ms=ms, source="compiled-model",
                                 new_graphs=len(graph_keys(cfg.to_dict()) - done),
                                 extrapolated=memory.extrapolated(cfg)))

    k = eager_timing.k  # the eager cost per sample by dtype
    for dtype in space.dtypes:
        slow = dtype in k and len(k) > 1 and k[dtype] > SLOW_DTYPE * min(k.values())
        if slow or not memory.eager.can_predict(dtype):
            continue
        for key in modes:
            mode = key[0]
            first = attempt(errors, "compiled search", fixed_shares, dtype) if shard else None
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
    fixed = [memory.eager.fixed_bytes(r, dtype, None if shares is None else shares[r]) for r in range(world)]
    for budget in (1.0, 0.5, 0.05):
        per_sample = [memory.sample_bound(r, dtype, mode, budget) for r in range(world)]
        limits = [u / (1.0 + memory.safety_margin) for u in usable]
        split = attempt(errors, "compiled search", balanced_split, total=total, fixed=fixed,
                        per_sample=per_sample, limits=limits)
        if split is not None:
            bases.append(split)
    out: list[list[int]] = []
    for base in bases:
        for micro in (base, *(neighbours(base) if world <= NEIGHBOUR_RANKS else [])):
            if micro not in out:
                out.append(micro)
    return out


def eager_candidates(*, space: SearchSpace, model: MemoryModel, timing: StepTimeModel, usable: list[float],
                     bucket: float, view: bool, max_spread: float | None, score: Score,
                     errors: ModelErrors | None = None, savings: SavingModel | None = None) -> list[Candidate]:
    """Eager configurations the memory model predicts to fit (its balanced plans per dtype and
    accumulation, the even split and its one-sample neighbours), scored by ``score``; a solver that
    fails on the model's figures gives no plan, noted in ``errors``. With ``savings`` (parameter sharding
    searched, ``_sharding``), the same for each sharding: the model's unsharded peaks less what the
    sharding saves on each rank (its plans solved against the usable memory plus that saving)."""
    layers = max(1, space.num_layers)
    world = space.world_size
    out: list[Candidate] = []
    seen: set[str] = set()

    def consider(micro: Sequence[int], counts: Sequence[int], dtype: str, acc: int, mode: str,
                 saved: list[float], zero: bool = False) -> None:
        micro, counts = list(micro), list(counts)
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
        if mode != "off":
            cfg = BalanceConfig.from_dict({**cfg.to_dict(), "param_sharding": mode})
        key = cfg.to_json()
        if key in seen or not space.contains(cfg):  # e.g. a split the space keeps fixed
            return
        seen.add(key)
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

    def plans(total: int, dtype: str, limits: list[float], shares: list[float] | None = None) -> list[SplitPlan]:
        return attempt(errors, "eager search", plans_from_model, model, total=total, num_layers=layers, dtype=dtype,
                       limits=limits, max_plans=5, recompute_fraction=timing.rho, max_spread_bytes=max_spread,
                       checkpoint_counts=None if space.num_layers > 0 else [0], speeds=timing.speeds,
                       optimizer_shares=shares) or []

    sharded = [m for m in space.param_shardings if m != "off"] if savings is not None else []
    zero1 = "zero1" in space.shardings and model.can_shard
    for mode, dtype, acc in itertools.product(["off", *sharded], space.dtypes, space.accumulations):
        if not model.can_predict(dtype) or (mode != "off" and dtype == "fp16"):  # FSDP refuses fp16
            continue
        shard = zero1 and mode == "off"
        total = space.micro_total(acc)
        saved = [0.0] * world  # per rank, what the parameter sharding saves
        if mode != "off" and savings is not None:
            probe = BalanceConfig.from_dict({"micro_batches": [1] * world, "accumulation": acc,
                                             "global_batch": world * acc, "dtype": dtype, "param_sharding": mode})
            saved = [savings.saving(probe, r) for r in range(world)]
        usable_now = [u + s for u, s in zip(usable, saved, strict=True)]
        for plan in plans(total, dtype, usable_now):
            consider(plan.micro_batches, plan.checkpointed, dtype, acc, mode, saved)
        if shard:  # the same plans, the state placed where memory is left (less on rank 0's extras)
            first = optimizer_shares(base=[model.fixed_bytes(r, dtype, 0.0) for r in range(world)],
                                     state=model.optimizer_bytes(None), limits=usable_now)
            for plan in plans(total, dtype, usable_now, first):
                consider(plan.micro_batches, plan.checkpointed, dtype, acc, mode, saved, zero=True)
        even = attempt(errors, "eager search", balanced_split_for, model, total=total,
                       checkpointed=[0] * world, num_layers=layers, dtype=dtype, limits=usable_now)
        for micro in (even, *neighbours(even)) if even is not None else []:
            consider(micro, [0] * world, dtype, acc, mode, saved)
            if shard:
                consider(micro, [0] * world, dtype, acc, mode, saved, zero=True)
    return out
