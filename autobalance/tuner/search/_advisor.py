"""The default strategy's glue to Optuna: before each ask the search policy's proposal is enqueued
(an ordinary trial, so the study stays a plain Optuna study: dashboard, samplers, resume); the trial
asked is vetoed when it cannot fit (recorded as ``predicted_oom``, not launched: ``_dominance``); after
each trial the models learn from it (``_models``). Where the next trial is chosen: ``_policy``.

On a GPU the first trials are the models' (bf16 first, fp32 only when asked or learned:
``_models.proposable_dtypes``), and the sampler explores once their proposals stop improving.
"""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance.protocol import StudyAttr
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner.search._constants import MAX_PREDICTED_IN_A_ROW
from autobalance.tuner.search._dominance import dominance_veto, dominating_over_cap, model_veto
from autobalance.tuner.search._model_errors import ModelErrors
from autobalance.tuner.search._models import (
    Decision,
    SearchModels,
    compiled_holdout_error,
    eager_holdout_error,
    observations_from_trials,
    saves_errors,
)
from autobalance.tuner.search._objective import TrialFigures
from autobalance.tuner.search._policy import SearchPolicy, TrialHistory
from autobalance.tuner.search._space import SearchSpace

__all__ = ["ModelAdvisor", "observations_from_trials"]


class ModelAdvisor:
    """Enqueues the policy's proposals, vetoes predicted OOMs, and lets the models learn from each trial."""

    def __init__(self, *, space: SearchSpace, settings: TuneSettings) -> None:
        self.space = space
        self.settings = settings
        self.models = SearchModels(space=space, settings=settings)
        """The models of the decision in progress (``_models``)."""
        self.policy = SearchPolicy(space=space, advisor=self.models)
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
