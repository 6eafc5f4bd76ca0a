"""The search's models over one decision: the per-rank memory model and the compiled memory model
fitted from the study's own trials (each once per decision: ``_snapshot.Decision``), the candidates
they rank by predicted objective (``_candidates``: eager ones from the memory model, compiled ones
from the compiled model), and what the policy's phases ask of them (the
``Models`` protocol of ``_policy``). They learn from each trial (:meth:`SearchModels.learn`: a
model that under-predicted widens its margin).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import optuna
from optuna.trial import FrozenTrial

from autobalance._config import CUDA_GRAPH_MODES, BalanceConfig
from autobalance.protocol import (
    Status,
    StudyAttr,
    TrialAttr,
    best_trial,
    objective_value,
)
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner.search._candidates import (
    Candidate,
    cache_order,
    compiled_candidates,
    eager_candidates,
)
from autobalance.tuner.search._compiled_model import CompiledMemoryModel, compiled_observations
from autobalance.tuner.search._cuda_graphs import graphs_verdict
from autobalance.tuner.search._first_trials import proposable_dtypes
from autobalance.tuner.search._holdout import observations_from_trials
from autobalance.tuner.search._memory_model import (
    DEFAULT_SAFETY_MARGIN,
    MemoryModel,
    MemoryObservation,
)
from autobalance.tuner.search._model_errors import FIT_ERRORS, ModelErrors
from autobalance.tuner.search._objective import spread_fraction
from autobalance.tuner.search._sharding import SavingModel, study_savings
from autobalance.tuner.search._snapshot import Decision
from autobalance.tuner.search._space import SearchSpace, config_compile_key
from autobalance.tuner.search._timing import StepTimeModel

__all__ = ["SearchModels", "saves_errors"]

GIB = 2**30
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
        """The compiled memory model, likewise."""
        self.savings: SavingModel | None = None
        """What each parameter sharding saves per rank (``_sharding``), refitted with the model; None: not searched."""
        self._margin = DEFAULT_SAFETY_MARGIN
        self._compiled_margin: float | None = None
        self.proposed: set[str] = set()
        """The configurations proposed so far (JSON)."""
        self.asks = 0
        """The asks so far (``explore`` paces the sampler by it)."""
        self.errors = ModelErrors()
        """The fits the search fell back from; saved in the study after each call that fits (:func:`saves_errors`)."""
        self.dtype_note = ""
        """Why the last proposals were held to some dtypes (``""``: none held back)."""
        self.decision: Decision | None = None
        """The decision in progress (``_snapshot``: the study read once, each model fitted once), from
        the advisor's ``before_ask`` until the next; the veto of the trial asked reads it too."""

    # ------------------------------------------------------------------ model
    def usable(self, study: optuna.Study) -> list[float] | None:
        caps = self.settings.caps_bytes()
        capacity = caps or study.user_attrs.get(StudyAttr.CAPACITY)
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
    def candidates(self, study: optuna.Study) -> list[tuple[float, BalanceConfig]]:
        """Configurations the models predict to fit, scored by the predicted objective (spread from
        the memory models, step time from time models fitted to the study's trials), best first:
        eager ones from the memory model, compiled ones from the compiled model."""
        return [(c.score, c.config) for c in self.scored_candidates(study)]

    @saves_errors
    def scored_candidates(self, study: optuna.Study) -> list[Candidate]:
        """:meth:`candidates` with their predictions, in the order they are proposed (ties go to
        the candidate that compiles fewer new graphs)."""
        model = self.refit(study)
        usable = self.usable(study)
        if model is None or usable is None:
            return []
        trials = study.get_trials(deepcopy=False)
        timing = self.decision_for(study).step_time
        ref = study.user_attrs.get(StudyAttr.REFERENCE)
        reference = 1000 * float(ref) if ref else None
        capacity = [u / (1.0 - self.settings.headroom) for u in usable]
        bucket, view = self._bucket_choice(study)
        max_spread = self.settings.max_spread_gib * GIB if self.settings.max_spread_gib is not None else None

        def score(cfg: BalanceConfig, peaks: list[float], ms: float) -> float | None:
            return objective_value(spread_fraction(peaks, capacity), ms / (reference or ms),
                                   weight_spread=self.settings.weight_spread, weight_time=self.settings.weight_time)

        out = [] if "off" not in self.space.compile_modes else eager_candidates(
            space=self.space, model=model, timing=timing, usable=usable, bucket=bucket, view=view,
            max_spread=max_spread, score=score, errors=self.errors, savings=self.savings)
        compiled = self.compiled_for(study, model)
        if compiled is not None:
            compiled_timing = self.decision_for(study).compiled_time
            found = compiled_candidates(space=self.space, trials=trials, memory=compiled, timing=compiled_timing,
                                        eager_timing=timing, usable=usable, bucket=bucket, view=view,
                                        max_spread=max_spread, score=score, errors=self.errors)
            # CUDA graphs only where a probe measured them paying (_cuda_graphs): the default mode's
            # fit says nothing of the host's launch time they remove
            probed = "default" in self.space.compile_modes  # --compile-mode auto: graphs beside the default mode
            pays = {d: graphs_verdict(trials, d) == "pays" for d in self.space.dtypes} if probed else {}
            out += [c for c in found if not probed or c.config.compile not in CUDA_GRAPH_MODES
                    or pays.get(c.config.dtype, False)]
        allowed = self.allowed_dtypes(study, timing)
        ordered = cache_order([c for c in out if c.config.dtype in allowed])
        return ordered

    def allowed_dtypes(self, study: optuna.Study, timing: StepTimeModel | None = None) -> list[str]:
        """The dtypes the models may propose now (``_first_trials``); sets :attr:`dtype_note`."""
        tf32 = bool((study.user_attrs.get(StudyAttr.DEVICE) or {}).get("tf32"))  # the baseline's report
        allowed, self.dtype_note = proposable_dtypes(
            space=self.space, device=self.settings.device, trials=study.get_trials(deepcopy=False), tf32=tf32,
            asked="fp32" in (self.settings.dtypes or []), per_sample_ms=None if timing is None else dict(timing.k))
        return allowed

    def compiled_for(self, study: optuna.Study, model: MemoryModel | None) -> CompiledMemoryModel | None:
        """The compiled model refitted on the study's compiled trials (None: compile not searched,
        or no eager model yet to build it on)."""
        if model is None or not self.space.compile_searched:
            return None
        margin = max(model.safety_margin, self._compiled_margin or 0.0)
        self.compiled = self.decision_for(study).fitted(("compiled-memory", id(model), margin), lambda: (
            CompiledMemoryModel.fit(compiled_observations(study.get_trials(deepcopy=False)), eager=model,
                                    num_layers=self.space.num_layers, safety_margin=margin)))
        return self.compiled

    def decision_for(self, study: optuna.Study) -> Decision:
        """The decision in progress when ``study`` is its view, else a decision of its own (a call
        outside :meth:`before_ask`)."""
        return self._current(study) or Decision(study, num_layers=self.space.num_layers, device=self.settings.device,
                                                errors=self.errors)

    def _current(self, study: optuna.Study) -> Decision | None:
        """The decision in progress if ``study`` is its study or its view of it (None: no decision)."""
        decision = self.decision
        return decision if decision is not None and (study is decision.study or study is decision.source) else None

    def _bucket_choice(self, study: optuna.Study) -> tuple[float, bool]:
        best = best_trial(study)
        if best is not None:
            cfg = best.user_attrs[TrialAttr.CONFIG]
            return float(cfg["bucket_cap_mb"]), bool(cfg["gradient_as_bucket_view"])
        return 25.0, True

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
        compiled = self.compiled_for(self.study, model) if model is not None else None
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
        model = self.refit(self.study)
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
        decision = self.decision_for(self.study)
        try:
            timing = decision.step_time
            if config.compile == "off":
                return timing.predict(config) if timing.k else None
            return decision.compiled_time.predict(config)
        except FIT_ERRORS:  # a fit that cannot be made says nothing: the proposal goes without a time
            return None

    def _compiled_now(self) -> CompiledMemoryModel | None:
        """The compiled model on the decision's trials, fitted once per decision."""
        def first() -> CompiledMemoryModel | None:
            model = self.refit(self.study)
            return self.compiled_for(self.study, model) if model is not None else None
        return self.decision_for(self.study).fitted("compiled-now", first)

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
            limit = usable[obs.rank] if usable else None
            self.model.correct(obs, limit=limit)
        self._margin = self.model.safety_margin
