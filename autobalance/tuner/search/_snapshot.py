"""One decision's view of the study: its trials and attributes read once.

Choosing the next trial asks many questions of the study (the history, the models' fits, the
compile prices, the time budget's forecast for each phase's proposal), and each used to read every
trial from the storage again: ~35 reads of all trials per trial in a 10-minute replay, each a query
(and over the network for a shared PostgreSQL study). :class:`StudySnapshot` answers
``get_trials`` and ``user_attrs`` from one read taken when the decision starts; nothing changes the
trials while the advisor decides (it enqueues its proposal after), and everything else (writing an
attribute, ``enqueue_trial``) goes to the study itself.

A :class:`Decision` is one choice of the next trial: the study read once and the models fitted from
it at most once, however many phases, vetoes and budget checks ask. The loop builds it at the head
of each trial (``TrialLoop.decision``) and hands it to the advisor; it is rebuilt only when a trial
finished since (another worker's included), so the verification forecast that the stop rule reads,
the policy's phases and the check of the configuration asked all use one fit of each model.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Container, Hashable, Sequence
from typing import Any, Protocol, TypeVar, cast

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance.tuner.search._model_errors import ModelErrors
from autobalance.tuner.search._timing import CompiledTimeModel, StepTimeModel

__all__ = ["Budget", "Decision", "StudySnapshot", "finished_key"]

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


class Budget(Protocol):
    """What a decision asks of ``--time-budget`` (``tuner._time_spent.TimeBudget``, the one place a
    stop for time is decided)."""

    compile_left_s: float | None

    def unaffordable(self, decision: Decision, config: BalanceConfig) -> str | None: ...
    def holds_compile(self, decision: Decision, scope: str | None = None) -> bool: ...


class Decision:
    """One choice of the next trial: the study's trials read once and each model fitted from them at
    most once (:meth:`fitted`; :attr:`step_time` and :attr:`compiled_time` here, the advisor's memory
    models through :meth:`fitted` with their own key)."""

    def __init__(self, study: optuna.Study, *, num_layers: int, device: str, errors: ModelErrors | None = None,
                 budget: Budget | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.source = study
        """The study itself (writes go there)."""
        self.study = cast(optuna.Study, StudySnapshot(study))
        """The study as of this decision (:class:`StudySnapshot`)."""
        self.trials = self.study.get_trials(deepcopy=False)
        self.key = finished_key(self.trials)
        self.num_layers = num_layers
        self.device = device
        self.errors = errors
        """Where a time model's fit notes what it fell back from (the advisor's; None: nowhere)."""
        self.budget = budget
        """``--time-budget`` (None: no budget)."""
        self.clock = clock
        """The time now (``time.monotonic``; the replay's simulated clock)."""
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
