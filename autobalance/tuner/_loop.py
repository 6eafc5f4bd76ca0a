"""The trial loop. Read :func:`one_trial` top to bottom: it is what every trial of a study goes
through - ask Optuna, settle it without launching when its result is known or predicted, launch
it, record it. :func:`run_trials` repeats it (on one thread, or one thread per slot)."""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING

import optuna

from autobalance.launcher import interrupts_deferred
from autobalance.protocol import best_trial
from autobalance.store import trial_id
from autobalance.tuner._launching import Stopped
from autobalance.tuner._parallel import Slot
from autobalance.tuner.search import SearchSpace

if TYPE_CHECKING:
    from autobalance.tuner._tuner import Tuner

__all__ = ["one_trial", "run_trials"]


def one_trial(tuner: Tuner, study: optuna.Study, space: SearchSpace) -> None:
    """Ask for one trial, run it (or reuse / predict its result) and record it."""
    # 1. Ask Optuna (the advisor may have queued its proposal); one ask at a time.
    with tuner.lock:
        if tuner.advisor is not None:
            tuner.advisor.before_ask(study)
        trial = study.ask()
        tuner.launcher.beat_now(trial)
        if tuner.recorder.surplus(study, trial):  # another worker took the study's last trial
            return
        tuner.running_here.add(trial_id(trial))
    try:
        config = space.suggest(trial)
        with tuner.measuring(config):  # another slot measuring the same configuration: wait for it
            # 2. A result known (measured before) or predicted (cannot fit): recorded without launching.
            with tuner.lock:
                seen = tuner.recorder.seen(config)
                if seen is not None:
                    frozen = tuner.recorder.reuse(study, trial, seen)
                    tuner.reporter.finish(frozen, best_trial(study), reused=True)
                    return
                prediction = tuner.advisor.predict_infeasible(study, config) if tuner.advisor is not None else None
                if prediction is not None:
                    frozen = tuner.recorder.predicted(study, trial, config, prediction)
                    tuner.reporter.finish(frozen, best_trial(study), predicted=True)
                    return
            # 3. Launch it: a torchrun job (warm pool, cold, or across nodes) that each rank reports on.
            tuner.reporter.start(trial.number, config)
            try:
                outcome = tuner.launcher.launch(study, number=trial.number, config=config, trial=trial)
                # measured again when its steps spread or it would become the best (tuner/_remeasure.py)
                outcome = tuner.launcher.remeasured(study, number=trial.number, config=config, trial=trial,
                                                    outcome=outcome)
            except KeyboardInterrupt as exc:
                tuner.recorder.interrupted(study, trial, config, exc)
                raise
            # 4. Record it: attributes, chart, constraints, tell; then the models learn from it.
            with tuner.lock:  # matplotlib (the trial's chart) and the advisor are not thread-safe
                frozen = tuner.recorder.record(study, trial, config, outcome)
                if tuner.advisor is not None:
                    tuner.advisor.after_trial(study, frozen)
                tuner.reporter.finish(frozen, best_trial(study))
                tuner.check_stop(study, outcome)  # too many crashes, or a script error: stop the study
    except BaseException as exc:
        with contextlib.suppress(Exception):
            tuner.recorder.unfinished(study, trial, exc)  # never leave it RUNNING
        raise
    finally:
        with tuner.lock:
            tuner.running_here.discard(trial_id(trial))


def run_trials(tuner: Tuner, study: optuna.Study, space: SearchSpace) -> None:
    """Trials until the study has ``--trials`` counted ones."""
    slots = tuner.launcher.slots()
    if len(slots) == 1:
        while tuner.more_trials(study):
            one_trial(tuner, study, space)
    else:
        _run_parallel(tuner, study, space, slots)


def _run_parallel(tuner: Tuner, study: optuna.Study, space: SearchSpace, slots: list[Slot]) -> None:
    """One thread per slot, each running :func:`one_trial` until the study is done. A slot that
    fails (a script error that stops the study, too many crashes) or a Ctrl-C stops every slot:
    their running trials are killed and marked interrupted (run again on the next start)."""
    errors: list[BaseException] = []
    tuner.reporter.note(f"{len(slots)} trials at a time: " + "; ".join(slot.describe() for slot in slots) + ".")
    finished = [threading.Event() for _ in slots]

    def work(slot: Slot, done: threading.Event) -> None:
        tuner.launcher.enter_slot(slot)
        try:
            while not tuner.stop.is_set() and tuner.more_trials(study):
                one_trial(tuner, study, space)
        except BaseException as exc:
            errors.append(exc)
            tuner.stop.set()
        finally:
            tuner.launcher.close_slot(slot)
            done.set()

    threads = [threading.Thread(target=work, args=(slot, done), name=f"autobalance-slot-{slot.index}", daemon=True)
               for slot, done in zip(slots, finished, strict=True)]
    for thread in threads:
        thread.start()
    # Events, not Thread.join: a join interrupted by Ctrl-C can mark a running thread as stopped
    # (CPython < 3.13), and the tuner would then exit while a slot still records its trial.
    try:
        while not all(done.is_set() for done in finished):
            for done in finished:
                done.wait(timeout=0.2)
    except KeyboardInterrupt:
        tuner.stop.set()
        with interrupts_deferred():  # the slots kill and mark their trials; a second Ctrl-C waits
            for done in finished:
                done.wait(timeout=120)
        raise
    real = [e for e in errors if not isinstance(e, Stopped)]
    if real:
        raise real[0]
    if errors:
        raise KeyboardInterrupt
