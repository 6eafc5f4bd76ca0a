"""``--measure-s auto`` reads the per-trial overhead the trial loop keeps up to date (issue 32): the
loop counts each recorded trial into ``TrialLauncher.overhead`` and a launch reads that figure, never
the study; the figure is what ``per_trial_overhead_s`` gives over the same trials."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import optuna
import pytest

from autobalance.launcher import TrialOutcome
from autobalance.tuner import Tuner, TuneSettings
from autobalance.tuner._launching import AUTO_MEASURE_FACTOR, AUTO_MEASURE_MAX_S, TrialLauncher
from autobalance.tuner._time_spent import per_trial_overhead_s
from tests.test_first_trials import baseline
from tests.test_trial_loop import _outcome
from tests.tune_helpers import GPT


class Launcher(TrialLauncher):
    """Each trial takes a little longer outside its steps; each launch notes the figure it would
    measure by and today's (the study's trials at that moment)."""

    seen: ClassVar[list[tuple[float | None, float | None]]] = []

    def launch(self, study: optuna.Study, *, number: int, config: Any, trial: Any = None,
               again: bool = False) -> TrialOutcome:
        if self.overhead.counted:  # the baseline's launch comes before anything was counted
            self.seen.append((self.overhead.seconds, per_trial_overhead_s(study.get_trials(deepcopy=False))))
        self.trials_run += 1
        outcome = _outcome(config or baseline(), [0.1, 0.1, 0.1, 0.1])
        outcome.wall_s = 1.0 + 0.25 * number
        return outcome


def test_the_loop_keeps_the_overhead_as_the_study_gives_it(tmp_path: Path):
    """Fails if the figure a launch reads differs from ``per_trial_overhead_s`` over the study's
    trials at that launch (today's number), or if the loop does not update it as trials are recorded."""
    settings = TuneSettings(script=GPT, device="cpu", trials=5, nproc_per_node=1, remeasure="off", measure_s=0,
                            prune_factor=0, seed=0, storage=f"sqlite:///{tmp_path}/o.db", runs_dir=str(tmp_path / "r"))
    tuner = Tuner(settings=settings)
    tuner.launcher = Launcher(settings=settings, storage=tuner.storage, reporter=tuner.reporter)
    Launcher.seen = []
    tuner.run()
    assert len(Launcher.seen) >= 3
    for kept, today in Launcher.seen:
        assert kept == today
    figures = [kept for kept, _ in Launcher.seen]
    assert figures[0] is not None and len(set(figures)) > 1  # the baseline counted, then each recorded trial
    study = optuna.load_study(study_name=settings.study_name, storage=settings.storage)
    assert tuner.launcher.overhead.seconds == per_trial_overhead_s(study.get_trials(deepcopy=False))


def _trial(wall: float, steps: float) -> optuna.trial.FrozenTrial:
    return optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=1.0,
                                     user_attrs={"status": "ok", "wall_s": wall, "time_in_steps_s": steps})


def test_measure_s_reads_the_counted_figure_not_the_study():
    """Fails if ``measure_s`` (``auto`` on CUDA) reads the study at a launch once the loop has counted
    its trials, or if it is not today's 7/3 of the overhead (at most 2 s; 0 before any trial)."""
    settings: Any = SimpleNamespace(measure_s="auto", device="cuda", cold=False)
    launcher = TrialLauncher(settings=settings, storage=None, reporter=None)  # type: ignore[arg-type]
    study = optuna.create_study()
    assert launcher.measure_s(study) == 0.0 and launcher.overhead.counted  # the first launch counts the study
    study.add_trial(_trial(1.0, 0.7))
    assert launcher.measure_s(study) == 0.0  # not counted yet: the loop counts a trial when it records it
    launcher.count_trials(study)
    assert launcher.overhead.seconds == per_trial_overhead_s(study.get_trials()) == pytest.approx(0.3)
    assert launcher.measure_s(study) == pytest.approx(AUTO_MEASURE_FACTOR * 0.3)
    study.add_trial(_trial(10.0, 0.5))
    launcher.count_trials(study)
    assert launcher.measure_s(study) == AUTO_MEASURE_MAX_S
    settings.device = "cpu"
    assert launcher.measure_s(study) == 0.0
    settings.measure_s = 1.5
    assert launcher.measure_s(study) == 1.5
