"""The default strategy: a per-rank memory model fitted from the study's own trials proposes
balanced splits (water-filling, per-rank checkpointing) and predicts OOMs before they are launched.
With compile searched, the compiled model (``_compiled_model``) proposes compiled configurations
(``_compiled_search``): ranked with the eager ones by predicted objective, after a few cheap eager
trials have taught the memory model what compiled peaks are built on.

The wrapped Optuna sampler still proposes everything the model does not; every proposal is an
ordinary enqueued trial, so the study stays a plain Optuna study (dashboard, samplers, resume).
On a GPU the first trials are the models' (bf16 first, fp32 only when asked or learned:
``_first_trials``), and the sampler explores once their proposals stop improving.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, TypeVar, cast

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._config import CUDA_GRAPH_MODES, BalanceConfig, split_evenly
from autobalance.protocol import (
    Status,
    StudyAttr,
    TrialAttr,
    best_trial,
    memory_text,
    objective_value,
    weighted_objective,
)
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner.search._compile import compile_times
from autobalance.tuner.search._compiled_model import (
    CompiledMemoryModel,
    CompiledTimeModel,
    compiled_observations,
)
from autobalance.tuner.search._compiled_search import Candidate, cache_order, compiled_candidates
from autobalance.tuner.search._cuda_graphs import graph_probe, graphs_verdict
from autobalance.tuner.search._dominance import activation_budget, dominating_over_cap
from autobalance.tuner.search._eager_search import eager_candidates
from autobalance.tuner.search._first_trials import proposable_dtypes, proposals_stalled
from autobalance.tuner.search._holdout import (
    compiled_holdout_error,
    eager_holdout_error,
    observations_from_trials,
)
from autobalance.tuner.search._memory_model import MemoryModel, MemoryObservation
from autobalance.tuner.search._model_errors import FIT_ERRORS, ModelErrors
from autobalance.tuner.search._objective import TrialFigures, spread_fraction
from autobalance.tuner.search._policy import (
    LOW_BUDGET,
    Proposal,
    Record,
    SearchPolicy,
    TrialHistory,
)
from autobalance.tuner.search._sharding import SavingModel, sharding_proposal, study_savings
from autobalance.tuner.search._snapshot import StudySnapshot
from autobalance.tuner.search._solver import (
    predict_config_feasible,
)
from autobalance.tuner.search._space import BUDGET_RANGE, SearchSpace, config_compile_key
from autobalance.tuner.search._step_time import StepTimeModel

__all__ = ["ModelAdvisor", "observations_from_trials"]

GIB = 2**30
_MAX_PREDICTED_IN_A_ROW = 25
SAMPLER_EVERY = 3
_WORTH = 1.5
VETO_MARGIN = 0.05
"""The margin a memory-model veto judges at (the models' default, :data:`DEFAULT_SAFETY_MARGIN`): a
configuration is recorded as ``predicted_oom`` without launching only when its predicted peak plus this
exceeds the usable memory, whatever the margin proposals have widened to."""
EAGER_FIRST = 3
"""With compile searched, a dtype's compiled proposals wait until this many eager trials of it were
measured (or its eager memory model is fully determined): eager trials take seconds and give the
compiled model its fixed part and activation unit; a compile takes tens of seconds."""


def predicted_oom(*, headroom: float, usable: list[float], rank: int, peak: float | None,
                  attrs: dict[str, Any]) -> tuple[TrialFigures, dict[str, Any]]:
    """The figures and attributes of a trial recorded as ``predicted_oom`` without launching: rank
    ``rank`` is known to need at least ``peak`` bytes; ``attrs`` say who predicted it and why."""
    peaks: list[float | None] = [None] * len(usable)
    peaks[rank] = peak
    figures = TrialFigures(status=Status.PREDICTED_OOM, peak_device=peaks, peak_allocated=[None] * len(peaks),
                           peak_reserved=[None] * len(peaks), outside_pytorch=[None] * len(peaks),
                           capacity=[u / (1.0 - headroom) for u in usable], step_time_s=None, samples_per_s=None,
                           startup_s=None)
    return figures, {**figures.user_attrs(headroom), "status": Status.PREDICTED_OOM, "predicted": True, **attrs,
                     "baseline": False}


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _saves_errors(method: _Method) -> _Method:
    """After the advisor's ``method(study, ...)``: the fit errors it caught saved in the study."""
    @functools.wraps(method)
    def saving(self: ModelAdvisor, study: optuna.Study, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, study, *args, **kwargs)
        finally:
            self.errors.save(study)
    return cast(_Method, saving)


class ModelAdvisor:
    """Enqueues model-balanced configurations and vetoes predicted OOMs."""

    def __init__(self, *, space: SearchSpace, settings: TuneSettings) -> None:
        self.space = space
        self.settings = settings
        self.model: MemoryModel | None = None
        self.savings: SavingModel | None = None
        """What each parameter sharding saves per rank (``_sharding``), refitted with the model; None: not searched."""
        self._proposed: set[str] = set()
        self._predicted_in_a_row = 0
        self._margin = 0.05
        self._compiled_margin: float | None = None
        self.compiled: CompiledMemoryModel | None = None
        self._asks = 0
        self._predictions: dict[str, Candidate] = {}
        self.errors = ModelErrors()
        """The fits the search fell back from; saved in the study after each call that fits (:func:`_saves_errors`)."""
        self.dtype_note = ""
        """Why the last proposals were held to some dtypes (``""``: none held back)."""
        self.policy = SearchPolicy(space=space, advisor=self)
        """Where the next trial is chosen (``_policy``)."""
        self._study: optuna.Study | None = None
        self._decision_compiled: tuple[CompiledMemoryModel | None] | None = None
        """The compiled model fitted once for the decision in progress (None: not fitted yet)."""
        """The study of the :meth:`before_ask` call in progress (the policy's phases read it)."""
        self.time_left_s: float | None = None
        """Seconds ``--time-budget`` leaves for a compile once verification's predicted time and a
        usual trial are kept (set by the tuner before each ask; None: no budget): a proposal that
        compiles new graphs is made only when the study's median compile fits in it, and only when
        it is predicted to beat the best trial (a compile predicted to lose is not worth its time)."""
        self.over_budget: Callable[[optuna.Study, BalanceConfig], str | None] | None = None
        """Why the tuner would not launch a configuration under ``--time-budget`` (its compile and
        verification's reserve after it priced from the study: ``_verify_time``), or None; set by the
        tuner (None: no budget). The policy skips a proposal the budget cannot hold."""

    # ------------------------------------------------------------------ model
    def _usable(self, study: optuna.Study) -> list[float] | None:
        caps = self.settings.caps_bytes()
        capacity = caps or study.user_attrs.get(StudyAttr.CAPACITY)
        if not capacity:
            return None
        if len(capacity) == 1:
            capacity = capacity * self.space.world_size
        return [float(c) * (1.0 - self.settings.headroom) for c in capacity]

    def refit(self, study: optuna.Study) -> MemoryModel | None:
        trials = study.get_trials(deepcopy=False)
        obs = observations_from_trials(trials, num_layers=self.space.num_layers)
        self.savings = None
        if len(self.space.param_shardings) > 1:  # sharded trials join as the unsharded peaks they imply (_sharding)
            self.savings = study_savings(trials, model_facts=study.user_attrs.get(StudyAttr.MODEL),
                                         world_size=self.space.world_size, num_layers=self.space.num_layers,
                                         unsharded=self._fit_quietly(obs))
            if self.savings is not None:
                obs = observations_from_trials(trials, num_layers=self.space.num_layers, savings=self.savings)
        if not any(o.ok for o in obs):
            return None
        try:
            model = MemoryModel.fit(obs, world_size=self.space.world_size, safety_margin=self._margin)
        except FIT_ERRORS as exc:
            self.errors.caught("memory model", exc)
            return None
        self._margin = model.safety_margin
        self.model = model
        return model

    def _fit_quietly(self, obs: list[MemoryObservation]) -> MemoryModel | None:
        """The model of ``obs`` alone (None: nothing fits, or the fit failed; noted in the errors)."""
        if not any(o.ok for o in obs):
            return None
        try:
            return MemoryModel.fit(obs, world_size=self.space.world_size, safety_margin=self._margin)
        except FIT_ERRORS as exc:
            self.errors.caught("memory model", exc)
            return None

    # ------------------------------------------------------------------ proposals
    def _reference_ms(self, study: optuna.Study) -> float | None:
        ref = study.user_attrs.get(StudyAttr.REFERENCE)
        return 1000 * float(ref) if ref else None

    def candidates(self, study: optuna.Study) -> list[tuple[float, BalanceConfig]]:
        """Configurations the models predict to fit, scored by the predicted objective (spread from
        the memory models, step time from time models fitted to the study's trials), best first:
        eager ones from the memory model, compiled ones from the compiled model."""
        return [(c.score, c.config) for c in self.scored_candidates(study)]

    @_saves_errors
    def scored_candidates(self, study: optuna.Study) -> list[Candidate]:
        """:meth:`candidates` with their predictions, in the order they are proposed (ties go to
        the candidate that compiles fewer new graphs)."""
        model = self.refit(study)
        usable = self._usable(study)
        if model is None or usable is None:
            return []
        trials = study.get_trials(deepcopy=False)
        timing = StepTimeModel.fit(trials, num_layers=self.space.num_layers, device=self.settings.device,
                                   errors=self.errors)
        reference = self._reference_ms(study)
        bucket, view = self._bucket_choice(study)
        max_spread = self.settings.max_spread_gib * GIB if self.settings.max_spread_gib is not None else None

        def score(cfg: BalanceConfig, peaks: list[float], ms: float) -> float | None:
            return self._objective(peaks, usable, ms, reference)

        out = [] if "off" not in self.space.compile_modes else eager_candidates(
            space=self.space, model=model, timing=timing, usable=usable, bucket=bucket, view=view,
            max_spread=max_spread, score=score, errors=self.errors, savings=self.savings)
        compiled = self._compiled_for(study, model)
        if compiled is not None:
            compiled_timing = CompiledTimeModel.fit(trials, eager=timing, device=self.settings.device)
            found = compiled_candidates(space=self.space, trials=trials, memory=compiled, timing=compiled_timing,
                                        eager_timing=timing, usable=usable, bucket=bucket, view=view,
                                        max_spread=max_spread, score=score, errors=self.errors)
            # CUDA graphs only where a probe measured them paying (_cuda_graphs): the default mode's
            # fit says nothing of the host's launch time they remove
            probed = "default" in self.space.compile_modes  # --compile-mode auto: graphs beside the default mode
            pays = {d: graphs_verdict(trials, d) == "pays" for d in self.space.dtypes} if probed else {}
            out += [c for c in found if not probed or c.config.compile not in CUDA_GRAPH_MODES
                    or pays.get(c.config.dtype, False)]
        allowed = self._allowed_dtypes(study, timing)
        ordered = cache_order([c for c in out if c.config.dtype in allowed])
        self._predictions = {c.config.to_json(): c for c in ordered}
        return ordered

    def _allowed_dtypes(self, study: optuna.Study, timing: StepTimeModel | None = None) -> list[str]:
        """The dtypes the models may propose now (``_first_trials``); sets :attr:`dtype_note`."""
        tf32 = bool((study.user_attrs.get(StudyAttr.DEVICE) or {}).get("tf32"))  # the baseline's report
        allowed, self.dtype_note = proposable_dtypes(
            space=self.space, device=self.settings.device, trials=study.get_trials(deepcopy=False), tf32=tf32,
            asked="fp32" in (self.settings.dtypes or []), per_sample_ms=None if timing is None else dict(timing.k))
        return allowed

    def _objective(self, peaks: list[float], usable: list[float], ms: float, reference_ms: float | None) -> float:
        capacity = [u / (1.0 - self.settings.headroom) for u in usable]
        return objective_value(spread_fraction(peaks, capacity), ms / (reference_ms or ms),
                               weight_spread=self.settings.weight_spread, weight_time=self.settings.weight_time)

    def predicted_objective(self, cfg: BalanceConfig, peaks: list[float], usable: list[float],
                            timing: StepTimeModel | CompiledTimeModel, reference_ms: float | None) -> float | None:
        t = timing.predict(cfg)
        return None if t is None else self._objective(peaks, usable, t, reference_ms)

    def _compiled_for(self, study: optuna.Study, model: MemoryModel | None) -> CompiledMemoryModel | None:
        """The compiled model refitted on the study's compiled trials (None: compile not searched,
        or no eager model yet to build it on)."""
        if model is None or not self.space.compile_searched:
            return None
        margin = max(model.safety_margin, self._compiled_margin or 0.0)
        self.compiled = CompiledMemoryModel.fit(compiled_observations(study.get_trials(deepcopy=False)),
                                                eager=model, num_layers=self.space.num_layers, safety_margin=margin)
        return self.compiled

    def _eager_first(self, study: optuna.Study, dtype: str) -> bool:
        """Whether ``dtype``'s compiled proposals wait for more eager trials (:data:`EAGER_FIRST`)."""
        if "off" not in self.space.compile_modes or self.model is None or self.model.is_fitted_for(dtype):
            return False
        eager = sum(1 for t in study.get_trials(deepcopy=False)
                    if t.user_attrs.get(TrialAttr.STATUS) == Status.OK and t.user_attrs.get(TrialAttr.REUSED_FROM) is None
                    and (t.user_attrs.get(TrialAttr.CONFIG) or {}).get("compile", "off") == "off"
                    and (t.user_attrs.get(TrialAttr.CONFIG) or {}).get("dtype") == dtype)
        return eager < EAGER_FIRST

    def _bucket_choice(self, study: optuna.Study) -> tuple[float, bool]:
        best = best_trial(study)
        if best is not None:
            cfg = best.user_attrs[TrialAttr.CONFIG]
            return float(cfg["bucket_cap_mb"]), bool(cfg["gradient_as_bucket_view"])
        return 25.0, True

    @_saves_errors
    def before_ask(self, study: optuna.Study) -> None:
        """Enqueue the search policy's next proposal when nothing is waiting (``_policy``: the one
        place the next trial is chosen); no proposal: the sampler's trial."""
        if study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return
        self._asks += 1
        view = cast(optuna.Study, StudySnapshot(study))  # the trials read once for the whole decision
        self._study = view
        self._decision_compiled = None
        try:
            history = TrialHistory.from_trials(
                view.get_trials(deepcopy=False), space=self.space, usable=self._usable(view),
                device=self.settings.device, model_facts=view.user_attrs.get(StudyAttr.MODEL))
            proposal = self.policy.next(history)
        finally:
            self._study = None
        if proposal is None:
            return
        if proposal.config is None:  # the sampler's trial, some parameters pinned
            if proposal.fixed:
                study.enqueue_trial(proposal.fixed, user_attrs=proposal.user_attrs())
            return
        self._proposed.add(proposal.config.to_json())
        study.enqueue_trial(self.space.params_from_config(proposal.config), user_attrs=proposal.user_attrs())

    # ------------------------------------------------------------------ what the policy's phases ask
    @property
    def study(self) -> optuna.Study:
        assert self._study is not None, "asked outside before_ask"
        return self._study

    def allowed_dtypes_now(self) -> list[str]:
        return self._allowed_dtypes(self.study)

    def best_record(self, history: TrialHistory) -> Record | None:
        top = best_trial(self.study)
        return None if top is None else next((r for r in history.records if r.number == top.number), None)

    def largest_budgets(self, config: BalanceConfig) -> list[float] | None:
        """Per rank, the largest budget the compiled model predicts to fit at ``config``'s micro-batches
        (its scope and dtype); None: a rank fits at none, or nothing to predict from."""
        model = self.model if self.model is not None else self.refit(self.study)
        usable = self._usable(self.study)
        compiled = self._compiled_for(self.study, model) if model is not None else None
        if compiled is None or usable is None or not model or not model.can_predict(config.dtype):
            return None
        key = config_compile_key(config)
        out = []
        for rank, m in enumerate(config.micro_batches):
            b = compiled.largest_budget(rank=rank, micro_batch=m, dtype=config.dtype, mode=key, limit=usable[rank])
            if b is None:
                return None
            out.append(float(b))
        return out

    def eager_estimate(self) -> tuple[None, float, float] | None:
        """``(None, held GiB, activations GiB per sample)`` of the fullest rank from the memory model's
        fit in the first half dtype, when trials did not report the held memory (runtimes from before)."""
        model = self.model if self.model is not None else self.refit(self.study)
        dtypes = [d for d in self.allowed_dtypes_now() if d in ("bf16", "fp16")]
        if model is None or not dtypes or not model.can_predict(dtypes[0]):
            return None
        layers = max(1, self.space.num_layers)
        ranks = range(self.space.world_size)
        held = max(model.fixed_bytes(r, dtypes[0]) for r in ranks)
        act = max(model.per_sample_bytes(r, dtypes[0], 0, layers) for r in ranks)
        return None, held / GIB, act / GIB

    def predicted_ms(self, config: BalanceConfig) -> float | None:
        """The step-time models' prediction for ``config`` (ms; None: nothing to predict from)."""
        trials = self.study.get_trials(deepcopy=False)
        try:
            timing = StepTimeModel.fit(trials, num_layers=self.space.num_layers, device=self.settings.device)
            if config.compile == "off":
                return timing.predict(config) if timing.k else None
            return CompiledTimeModel.fit(trials, eager=timing, device=self.settings.device).predict(config)
        except FIT_ERRORS:  # a fit that cannot be made says nothing: the proposal goes without a time
            return None

    def _compiled_now(self) -> CompiledMemoryModel | None:
        """The compiled model on the decision's trials, fitted once per decision."""
        if self._decision_compiled is None:
            model = self.model if self.model is not None else self.refit(self.study)
            self._decision_compiled = (self._compiled_for(self.study, model) if model is not None else None,)
        return self._decision_compiled[0]

    def peak_change(self, config: BalanceConfig, budget: float) -> list[float] | None:
        """Per rank, the compiled model's change of the peak (GiB, no margins) from ``config``'s budgets
        to ``budget`` (None: no model)."""
        compiled = self._compiled_now()
        if compiled is None or not compiled.can_predict(config.dtype):
            return None
        other = BalanceConfig.from_dict({**config.to_dict(), "activation_budget": [budget] * config.world_size})
        return [(b - a) / GIB for a, b in zip(compiled.config_peaks(config), compiled.config_peaks(other), strict=True)]

    def compiled_peaks(self, config: BalanceConfig) -> list[float] | None:
        """The compiled model's predicted peaks of ``config``, GiB per rank (None: no model)."""
        compiled = self._compiled_now()
        if compiled is None or not compiled.can_predict(config.dtype):
            return None
        return [p / GIB for p in compiled.config_peaks(config)]

    def graph_proposal(self) -> Proposal | None:
        return self._graph_probe(self.study)

    def unaffordable(self, config: BalanceConfig) -> str | None:
        """Why the time budget would not launch ``config`` (None: it would, or there is no budget)."""
        return None if self.over_budget is None else self.over_budget(self.study, config)

    def time_holds_compile(self, scope: str | None = None) -> bool:
        return not self._no_time_to_compile(self.study, scope)

    def explore(self, history: TrialHistory) -> Proposal | None:
        """The sampler's trial every ``SAMPLER_EVERY``-th ask: on CPU always (it explores what the
        models do not: bucket sizes, dtypes they cannot predict yet), on a GPU only once the models'
        proposals stopped improving (``_first_trials.proposals_stalled``)."""
        study = self.study
        if self._asks % SAMPLER_EVERY == 0 and (
                self.settings.device != "cuda"
                or proposals_stalled(study.get_trials(deepcopy=False), study.user_attrs.get(StudyAttr.OBJECTIVE, {}))):
            return self._sampler_proposal("explore: " + ("every third trial on CPU" if self.settings.device != "cuda"
                                                         else "the models' proposals stopped improving"))
        return None

    def model_proposal(self, history: TrialHistory) -> Proposal | None:
        """The models' best new candidate (eager from the memory model, compiled from the compiled
        model), when it is worth a trial: under a time budget a compile must fit in the time left and
        promise a gain; a budget below ``LOW_BUDGET`` only where a higher one was measured at that
        micro-batch and scope; a compile scope only once a trial of it was measured (the scope probe
        brings in another: no borrowing across scopes); an eager candidate first while the compiled model has too few eager
        trials of its dtype (``EAGER_FIRST``)."""
        study = self.study
        candidates = self.scored_candidates(study)
        if not candidates:
            return None
        tried = history.tried() | self._proposed
        if self._no_time_to_compile(study):  # no new graph that the time budget cannot hold
            candidates = [c for c in candidates if c.new_graphs == 0]
        elif self.time_left_s is not None:  # nor one of a scope whose compile it cannot hold
            dear = {scope for scope in self.space.compile_scopes if self._no_time_to_compile(study, scope)}
            candidates = [c for c in candidates if c.new_graphs == 0 or c.config.compile == "off"
                          or c.config.compile_scope not in dear]
        scopes = history.measured_scopes() or {self.space.compile_scopes[-1]}  # regional first when searched
        if self.settings.device == "cuda" and history.best_compiled() is not None and not self._eager_timed(history):
            # an eager proposal against a compiled best needs an eager time model of its own (three measured
            # eager splits): with fewer it is proportional and ranks launch-bound small micro-batches too well
            candidates = [c for c in candidates if c.config.compile != "off"]
        fresh = [c for c in candidates if c.config.to_json() not in tried and self._low_budget_ok(history, c.config)
                 and (c.config.compile == "off" or c.config.compile_scope in scopes)]
        best = self._best_value(study)
        if self.time_left_s is not None and best is not None:  # under a time budget a compile must promise a gain
            fresh = [c for c in fresh if c.new_graphs == 0 or c.score < best]
        if not fresh or fresh[0].score > _WORTH * candidates[0].score:
            return None
        pick, note = fresh[0], None
        if pick.source == "compiled-model" and self._eager_first(study, pick.config.dtype) and (
                history.eager_probe() is None):
            eager = [c for c in fresh if c.source == "memory-model" and c.config.dtype == pick.config.dtype]
            if eager:  # a few seconds that teach the compiled model its fixed part before a compile
                pick, note = eager[0], "eager first: teaches the memory model before compiling"
        extra: dict[str, Any] = {}
        if pick.source == "compiled-model":
            extra["proposal_new_graphs"] = pick.new_graphs
        reason = note or ("the compiled model's best configuration predicted to fit" if pick.source == "compiled-model"
                          else "the memory model's best configuration predicted to fit")
        if self.dtype_note and not note:
            reason += f" ({self.dtype_note})"
        return Proposal(config=pick.config, phase=pick.source, reason=reason, predicted_ms=pick.step_ms,
                        predicted_peak_gib=[p / GIB for p in pick.peaks], extra=extra)

    @staticmethod
    def _eager_timed(history: TrialHistory) -> bool:
        """Whether three distinct eager splits were measured (the eager time model's fixed terms are then seen)."""
        return len({json.dumps([r.config.accumulation, r.config.micro_batches]) for r in history.records
                    if r.measured and r.status == Status.OK and r.config is not None and r.config.compile == "off"}) >= 3

    def _low_budget_ok(self, history: TrialHistory, config: BalanceConfig) -> bool:
        """A budget below ``LOW_BUDGET`` only where a higher one was measured at that micro-batch and scope."""
        if config.compile == "off" or min(config.activation_budget or [1.0]) >= LOW_BUDGET:
            return True
        measured = history.measured_budget(config_compile_key(config), max(config.micro_batches))
        return measured is not None and measured >= LOW_BUDGET

    def fallback_proposal(self, history: TrialHistory) -> Proposal | None:
        """When no phase proposes: the least memory the priors know while nothing fits (on a GPU), else
        the sampler."""
        study = self.study
        shard = self._sharding_proposal(history)
        if shard is not None:
            return shard
        if self.settings.device == "cuda" and not any(r.status == Status.OK for r in history.records):
            probe = self._probe(study)
            if probe is not None:
                return Proposal(config=probe, phase="prior", reason=(
                    "nothing measured fits yet: the least memory the priors know, in "
                    f"{probe.dtype} ({self.dtype_note or 'the dtype prior on a GPU'})"))
        return self._sampler_proposal("the sampler's trial: the models propose nothing new worth a trial")

    def _sharding_proposal(self, history: TrialHistory) -> Proposal | None:
        """Parameter sharding where a rank's fixed part is large and nothing fits (``_sharding``)."""
        study = self.study
        found = sharding_proposal(study.get_trials(deepcopy=False), space_shardings=self.space.param_shardings,
                                  model_facts=study.user_attrs.get(StudyAttr.MODEL), world_size=self.space.world_size,
                                  usable=self._usable(study), unsharded=self.model, tried=history.tried() | self._proposed,
                                  num_layers=self.space.num_layers)
        if found is None:
            return None
        config, reason, _fixed = found  # the fixed part only (in the reason): no peak predicted
        return Proposal(config=config, phase="shard", reason=reason)

    def _graph_probe(self, study: optuna.Study) -> Proposal | None:
        """The CUDA-graph probe (:func:`graph_probe`) when there is one and the time budget holds a
        compile. Asked once the models promise nothing better than the best trial, and only when that
        is a default-mode compiled one: the probe measures graphs where the default mode's optimum is."""
        if self._no_time_to_compile(study):
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
        probe = graph_probe(study.get_trials(deepcopy=False), best=top, modes=self.space.compile_modes,
                            dtypes=self._allowed_dtypes(study))
        if probe is None or probe.to_json() in self._proposed or not self.space.contains(probe):
            return None
        return Proposal(config=probe, phase="cuda-graphs", reason=(
            f"CUDA graphs ({probe.compile}) at the best default-mode compiled configuration: one compile "
            "measures whether they pay for this script"))

    def _probe(self, study: optuna.Study) -> BalanceConfig | None:
        """With nothing measured that fits (the script's own configuration ran out of memory): the
        least-memory configurations of the first allowed dtype, which the priors expect to fit - every
        block checkpointed (compiled only: the smallest budget), at the baseline's accumulation, then
        at the largest; None once both were tried."""
        trials = study.get_trials(deepcopy=False)
        if any(t.user_attrs.get(TrialAttr.STATUS) == Status.OK for t in trials):
            return None
        allowed = self._allowed_dtypes(study)
        if not allowed:
            return None
        number = study.user_attrs.get(StudyAttr.BASELINE)
        own = next((t.user_attrs.get(TrialAttr.CONFIG) or {} for t in trials if t.number == number), {})
        tried = {json.dumps(t.user_attrs.get(TrialAttr.CONFIG), sort_keys=True)
                 for t in trials if t.user_attrs.get(TrialAttr.CONFIG)} | self._proposed
        world = self.space.world_size
        mode = "off" if "off" in self.space.compile_modes else self.space.compile_modes[0]
        layers = self.space.num_layers if mode == "off" else 0
        for acc in dict.fromkeys([int(own.get("accumulation") or 1), max(self.space.accumulations)]):
            if acc not in self.space.accumulations:
                continue
            micro = split_evenly(self.space.micro_total(acc), [1.0] * world)
            cfg = self.space.config_for(
                micro, acc, None, checkpoint=[list(range(layers)) for _ in range(world)], dtype=allowed[0],
                bucket_cap_mb=float(own.get("bucket_cap_mb") or 25.0),
                gradient_as_bucket_view=bool(own.get("gradient_as_bucket_view", True)), compile=mode,
                activation_budget=None if mode == "off" else [BUDGET_RANGE[0]] * world)
            if self.space.contains(cfg) and cfg.to_json() not in tried:
                return cfg
        return None

    def _best_value(self, study: optuna.Study) -> float | None:
        """The best feasible trial's objective (weighted on a Pareto front); None before one."""
        best = best_trial(study)
        if best is None or not best.values:
            return None
        return weighted_objective(best.values, study.user_attrs.get(StudyAttr.OBJECTIVE, {}))

    def _no_time_to_compile(self, study: optuna.Study, scope: str | None = None) -> bool:
        """Whether the time budget leaves less than the study's median compile (:attr:`time_left_s`);
        ``scope``: a compile of that scope (``compile_times``)."""
        if self.time_left_s is None or not self.space.compile_searched:
            return False
        _, compile_s = compile_times(study.get_trials(deepcopy=False), device=self.settings.device, scope=scope)
        return compile_s > self.time_left_s

    def _sampler_proposal(self, why: str) -> Proposal:
        """The sampler's trial. While some dtype is held back, its dtype is fixed to the best trial's
        (when allowed) or the first allowed one; when the time budget holds no compile, it runs eager
        (the sampler picks the rest)."""
        study = self.study
        fixed: dict[str, Any] = {}
        notes = [why]
        if self._no_time_to_compile(study) and "off" in self.space.compile_modes:
            fixed["compile"] = "off"
            notes.append("eager: the time budget holds no compile")
        if self.settings.device == "cuda":
            allowed = self._allowed_dtypes(study, self._timing(study))
            if allowed and len(allowed) < len(self.space.dtypes):
                best = best_trial(study)
                dtype = (best.user_attrs.get(TrialAttr.CONFIG) or {}).get("dtype") if best is not None else None
                fixed["dtype"] = dtype if dtype in allowed else allowed[0]
                notes.append(f"in {fixed['dtype']}: {self.dtype_note}")
        return Proposal(config=None, phase="sampler", reason="; ".join(notes), fixed=fixed)

    def _timing(self, study: optuna.Study) -> StepTimeModel | None:
        """The step-time model on the study's trials (None: nothing measured yet)."""
        timing = StepTimeModel.fit(study.get_trials(deepcopy=False), num_layers=self.space.num_layers,
                                   device=self.settings.device, errors=self.errors)
        return timing if timing.k else None

    @_saves_errors
    def holdout_error(self, study: optuna.Study) -> float | None:
        return eager_holdout_error(study, space=self.space, errors=self.errors)

    @_saves_errors
    def compiled_holdout_error(self, study: optuna.Study) -> tuple[float, int] | None:
        return compiled_holdout_error(study, space=self.space, errors=self.errors)

    # ------------------------------------------------------------------ vetoes
    @_saves_errors
    def predict_infeasible(self, study: optuna.Study, config: BalanceConfig) -> tuple[TrialFigures, dict[str, Any]] | None:
        """Figures for a config that will not fit (a measured trial it dominates did not, or the
        model is confident); None to launch it."""
        usable = self._usable(study)
        if usable is None or self._predicted_in_a_row >= _MAX_PREDICTED_IN_A_ROW:
            return None
        dominated = dominating_over_cap(study.get_trials(deepcopy=False), config)
        if dominated is not None:
            self._predicted_in_a_row += 1
            return self._dominance_figures(config, usable, *dominated)
        model = self.model if self.model is not None else self.refit(study)
        if model is None:
            return None
        if config.compile != "off":  # compiled memory follows the budget: the compiled model's measured bounds
            return self._compiled_veto(study, model, config, usable)
        if config.param_sharding != "off":  # the model is of unsharded memory: launched (dominance above still vetoes)
            return None
        counts = [len(c) for c in config.checkpoint]
        if not model.can_predict(config.dtype) or not all(
            model.is_confident(rank=r, micro_batch=m, checkpointed=c, num_layers=max(1, self.space.num_layers),
                               dtype=config.dtype)
            for r, (m, c) in enumerate(zip(config.micro_batches, counts, strict=True))
        ):
            return None
        # the veto judges at the default margin, not the self-widened one the proposals use: a widened margin
        # (up to 50 %) vetoed configurations that fit (issue 41: predicted 9.28 MiB +50 % > 12.2 MiB usable,
        # measured 9.2-10.0 MiB); proposing stays conservative, not launching needs the central estimate over
        feasible, peaks = predict_config_feasible(model, config, num_layers=max(1, self.space.num_layers),
                                                  limits=usable, margin=VETO_MARGIN)
        if feasible:
            self._predicted_in_a_row = 0
            return None
        self._predicted_in_a_row += 1
        capacity = [u / (1.0 - self.settings.headroom) for u in usable]
        worst = max(range(len(peaks)), key=lambda r: peaks[r] / usable[r])
        figures = TrialFigures(status=Status.PREDICTED_OOM, peak_device=list(peaks), peak_allocated=[None] * len(peaks),
                               peak_reserved=[None] * len(peaks), outside_pytorch=[None] * len(peaks),
                               capacity=capacity, step_time_s=None, samples_per_s=None, startup_s=None)
        attrs = {
            **figures.user_attrs(self.settings.headroom),
            "status": Status.PREDICTED_OOM,
            "predicted": True,
            "predicted_by": "memory-model",
            "reason": (f"not launched: the memory model predicts rank {worst} at {memory_text(peaks[worst] / GIB)} "
                       f"(+{100 * VETO_MARGIN:.0f}% margin) > usable {memory_text(usable[worst] / GIB)}"),
            "baseline": False,
        }
        return figures, attrs

    def _compiled_veto(self, study: optuna.Study, model: MemoryModel, config: BalanceConfig,
                       usable: list[float]) -> tuple[TrialFigures, dict[str, Any]] | None:
        """Figures for a compiled configuration that the pair's measured budgets prove cannot fit on
        some rank (whose eager fixed part the memory model is sure of); None to launch it."""
        compiled = self.compiled if self.compiled is not None else self._compiled_for(study, model)
        if compiled is None or not model.can_predict(config.dtype):
            return None
        budgets = config.activation_budget or [1.0] * config.world_size
        key = config_compile_key(config)
        layers = max(1, self.space.num_layers)
        own = config.sharding_shares()  # zero1: each rank's share of the state (None: unsharded)
        shares: list[float | None] = [None] * config.world_size if own is None else list(own)
        for rank, (m, b) in enumerate(zip(config.micro_batches, budgets, strict=True)):
            if not model.is_confident(rank=rank, micro_batch=m, checkpointed=0, num_layers=layers, dtype=config.dtype):
                continue
            low = compiled.surely_over(rank=rank, micro_batch=m, budget=b, dtype=config.dtype, mode=key,
                                       limit=usable[rank], optimizer_share=shares[rank])
            why = "the compiled model's measured budgets put"
            if low is None:  # not even the least any budget keeps fits (a tiny budget does not save it)
                low = compiled.over_at_any_budget(rank=rank, micro_batch=m, dtype=config.dtype, mode=key,
                                                  limit=usable[rank], optimizer_share=shares[rank])
                why = "at any budget the compiled model predicts"
            if low is None:
                continue
            self._predicted_in_a_row += 1
            return predicted_oom(headroom=self.settings.headroom, usable=usable, rank=rank, peak=low, attrs={
                "predicted_by": "compiled-model",
                "reason": (f"not launched (not compiled): {why} rank {rank} at "
                           f"least at {memory_text(low / GIB)} with micro-batch {m}, budget {b:g} "
                           f"(+{100 * compiled.safety_margin:.0f}% margin) > usable {memory_text(usable[rank] / GIB)}"),
            })
        self._predicted_in_a_row = 0
        return None

    def _dominance_figures(self, config: BalanceConfig, usable: list[float], trial: FrozenTrial,
                           rank: int) -> tuple[TrialFigures, dict[str, Any]]:
        seen = (trial.user_attrs.get(TrialAttr.PEAK_DEVICE_GIB) or [None] * config.world_size)[rank]
        other = trial.user_attrs[TrialAttr.CONFIG]
        what = (f"budget {activation_budget(other, rank):g}" if other.get("compile", "off") != "off"
                else f"{len(other['checkpoint'][rank])} checkpointed blocks")
        return predicted_oom(  # the peak is a lower bound: this one needs at least what that trial saw
            headroom=self.settings.headroom, usable=usable, rank=rank, peak=None if seen is None else float(seen) * GIB,
            attrs={
                "predicted_by": "dominance",
                "dominated_by": trial.number,
                "reason": (f"not launched: trial {trial.number} exceeded rank {rank}'s usable memory "
                           f"({memory_text(usable[rank] / GIB)}) with micro-batch {other['micro_batches'][rank]}, {what}; this "
                           "configuration needs at least as much there (same dtype and compile mode, no smaller "
                           "micro-batch, no more recomputation, no smaller bucket)"),
            })

    def after_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """A launched trial that OOMed although the model said it fits widens the safety margin; a
        compiled trial whose peak the compiled model under-predicted beyond its margin widens that one."""
        if self.compiled is not None and (trial.user_attrs.get(TrialAttr.CONFIG) or {}).get("compile", "off") != "off":
            for cobs in compiled_observations([trial]):
                self.compiled.correct(cobs)
            self._compiled_margin = self.compiled.safety_margin
            return
        if self.model is None or trial.user_attrs.get(TrialAttr.STATUS) != Status.OOM:
            return
        usable = self._usable(study)
        for obs in observations_from_trials([trial], num_layers=self.space.num_layers):
            limit = usable[obs.rank] if usable else None
            self.model.correct(obs, limit=limit)
        self._margin = self.model.safety_margin
