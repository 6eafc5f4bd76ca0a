"""The trial loop's stop rules, read at the head of its loop (``TrialLoop.more_trials``): each ends
the loop with its reason in one line; a trial's stopping verdict is raised there, before the next
ask (no torchrun: the loop's head only)."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from autobalance import LaunchError, TrialScriptError
from autobalance.launcher import TrialOutcome
from autobalance.protocol import Status, TrialAttr
from autobalance.tuner import TuneSettings
from autobalance.tuner.search import MAX_CRASHES_IN_A_ROW

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt" / "train.py")


class Notes:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def note(self, text: str) -> None:
        self.lines.append(text)


def _loop(tmp_path: Path, **kwargs):
    from autobalance.tuner import Tuner

    tmp_path.mkdir(parents=True, exist_ok=True)
    settings = TuneSettings(script=GPT, device="cpu", storage=f"sqlite:///{tmp_path}/h.db",
                            runs_dir=str(tmp_path / "runs"), **{"trials": 2, **kwargs})
    notes = Notes()
    tuner = Tuner(settings=settings, reporter=notes)
    study = optuna.create_study(study_name=settings.study_name, storage=tuner.storage)
    return tuner, tuner.trial_loop(), study, notes


def _finished(study: optuna.Study, status: str = Status.OK) -> None:
    trial = study.ask()
    trial.set_user_attr(TrialAttr.STATUS, status)
    study.tell(trial, 1.0)


def test_trials_and_the_stop_signal_end_the_loop_each_with_its_line(tmp_path: Path):
    tuner, loop, study, notes = _loop(tmp_path)
    try:
        assert loop.more_trials(study) and loop.ended is None
        _finished(study)
        _finished(study)
        assert not loop.more_trials(study)
        assert loop.ended == "the study has its 2 trials"
        assert notes.lines == []  # nothing said that the study does not already say
    finally:
        tuner.close()
    tuner, loop, study, _ = _loop(tmp_path / "b")
    try:
        loop.stop.set()
        assert not loop.more_trials(study) and loop.ended.startswith("stopped: ")
    finally:
        tuner.close()


def test_the_time_budget_ends_the_loop_at_its_head(tmp_path: Path):
    tuner, loop, study, notes = _loop(tmp_path, time_budget="1h")
    try:
        assert loop.more_trials(study)
        tuner.budget.started -= 3600
        assert not loop.more_trials(study) and not loop.more_trials(study)
        assert loop.ended == "the time budget holds no further trial with verification after it"
        assert len(notes.lines) == 1 and notes.lines[0].startswith("Time budget (1h) spent after 0 of 2 trials")
    finally:
        tuner.close()


@pytest.mark.parametrize("status", [Status.CRASH, Status.ERROR])
def test_a_trial_that_stops_the_study_is_raised_at_the_head_before_the_next_ask(tmp_path: Path, status: str):
    tuner, loop, study, _ = _loop(tmp_path, trials=50)
    try:
        outcome = TrialOutcome(status=status, reason="boom", reports={}, wall_s=1.0, trial_dir=str(tmp_path))
        times = MAX_CRASHES_IN_A_ROW if status == Status.CRASH else 1
        for _ in range(times):
            _finished(study, status)
            loop.check_stop(study, outcome)  # kept, not raised: the trial is recorded first
        asked = len(study.trials)
        with pytest.raises(LaunchError if status == Status.CRASH else TrialScriptError, match="boom"):
            loop.more_trials(study)
        assert len(study.trials) == asked and loop.ended.startswith("stopped by a trial: ")
        with pytest.raises((LaunchError, TrialScriptError)):  # every slot's head stops
            loop.more_trials(study)
    finally:
        tuner.close()
