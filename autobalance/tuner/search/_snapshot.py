"""One decision's view of the study: its trials and attributes read once.

Choosing the next trial asks many questions of the study (the history, the models' fits, the
compile prices, the time budget's forecast for each phase's proposal), and each used to read every
trial from the storage again: ~35 reads of all trials per trial in a 10-minute replay, each a query
(and over the network for a shared PostgreSQL study). :class:`StudySnapshot` answers
``get_trials`` and ``user_attrs`` from one read taken when the decision starts; nothing changes the
trials while the advisor decides (it enqueues its proposal after), and everything else (writing an
attribute, ``enqueue_trial``) goes to the study itself.
"""

from __future__ import annotations

import copy
from collections.abc import Container
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

__all__ = ["StudySnapshot"]


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
