"""What the trial loop needs of the parts it is handed: the console (:class:`Reporter`), the search's
advisor (:class:`Advisor`) and the multi-node coordinator (:class:`TrialCoordinator`). Each is a
``typing.Protocol``: ``RichReporter``, ``ModelAdvisor`` and ``launcher.Coordinator`` satisfy them
without naming them, and a test or another front end may hand in anything that has these methods."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

    from autobalance._config import BalanceConfig
    from autobalance.launcher import TrialLaunch, TrialOutcome
    from autobalance.tuner._settings import TuneSettings
    from autobalance.tuner.search import Decision, TrialFigures

__all__ = ["Advisor", "NullReporter", "Reporter", "TrialCoordinator"]


class Reporter(Protocol):
    """The console of a ``tune`` run: told when the study begins, each trial starts, runs and ends."""

    def begin(self, settings: TuneSettings, *, already: int, deadline: float | None = None) -> None: ...
    def start(self, number: int, config: BalanceConfig | None, *, baseline: bool = False, why: str = "") -> None: ...
    def tick(self, number: int, elapsed: float) -> None: ...
    def note(self, text: str) -> None: ...
    def finish(self, trial: FrozenTrial, best: FrozenTrial | None, *, reused: bool = False,
               predicted: bool = False) -> None: ...


class NullReporter:
    """A :class:`Reporter` that says nothing (a ``Tuner`` handed none)."""

    def begin(self, settings: TuneSettings, *, already: int, deadline: float | None = None) -> None: ...
    def start(self, number: int, config: BalanceConfig | None, *, baseline: bool = False, why: str = "") -> None: ...
    def tick(self, number: int, elapsed: float) -> None: ...
    def note(self, text: str) -> None: ...
    def finish(self, trial: FrozenTrial, best: FrozenTrial | None, *, reused: bool = False,
               predicted: bool = False) -> None: ...


class Advisor(Protocol):
    """The search's advisor (the ``model`` strategy): proposes before each ask, predicts a configuration
    that cannot fit, learns from each trial, and says how well its models held out."""

    def before_ask(self, study: optuna.Study, decision: Decision | None = None) -> None:
        """Enqueue the next trial, chosen over ``decision`` (the study read once, the models fitted
        once, the time budget)."""
    def predict_infeasible(self, study: optuna.Study,
                           config: BalanceConfig) -> tuple[TrialFigures, dict[str, Any]] | None: ...
    def after_trial(self, study: optuna.Study, trial: FrozenTrial) -> None: ...
    def holdout_error(self, study: optuna.Study) -> float | None: ...
    def compiled_holdout_error(self, study: optuna.Study) -> tuple[float, int] | None: ...


class TrialCoordinator(Protocol):
    """Runs one trial over several nodes (``launcher.Coordinator``): started once, closed at the end."""

    def start(self) -> None: ...
    def run(self, launch: TrialLaunch, *, on_poll: Callable[[float], bool | None] | None = None) -> TrialOutcome: ...
    def close(self) -> None: ...
