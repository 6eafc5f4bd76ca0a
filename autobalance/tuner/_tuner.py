"""The tuner: an Optuna study whose trials are real torchrun jobs. :meth:`Tuner.run` opens the
study, runs the baseline once, then the trial loop (:mod:`autobalance.tuner._loop`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance._errors import LaunchError, TrialScriptError, UsageError
from autobalance.launcher import TrialOutcome, WarmPool
from autobalance.protocol import Status, StudyAttr, TrialAttr, best_trial
from autobalance.store import heartbeat_interval_s, mask_url, open_storage, trial_id
from autobalance.tuner._baseline import baseline_once
from autobalance.tuner._launching import Stopped, TrialLauncher
from autobalance.tuner._loop import run_trials
from autobalance.tuner._recording import Recorder
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner._study import check_space, counted_trials, open_study
from autobalance.tuner._summary import TuneResult, summarise
from autobalance.tuner._time_spent import TimeBudget, describe_budget
from autobalance.tuner._verify_time import forecast_verification, next_trial_s
from autobalance.tuner._workers import fail_stale_trials
from autobalance.tuner.search import SearchSpace

__all__ = ["MAX_CRASHES_IN_A_ROW", "Tuner"]

MAX_CRASHES_IN_A_ROW = 3


class Tuner:
    """Runs ``settings.trials`` trials of one study (continuing an existing one).

    Its parts: the :class:`TrialLauncher` (slots, warm pools, heartbeats), the :class:`Recorder`
    (what is told to the study), the advisor (``--strategy model``: proposals and predictions).
    Several slots run :func:`~autobalance.tuner._loop.one_trial` at once; ``lock`` serialises what
    they share."""

    counted_trials = staticmethod(counted_trials)

    def __init__(self, *, settings: TuneSettings, reporter: Any = None, pool: WarmPool | None = None,
                 keep_pool: bool = False) -> None:
        """``pool``: a warm pool shared with other tuners of the same script (the caller closes it).
        ``keep_pool``: leave the study's own warm pool running when :meth:`run` ends, as
        :attr:`kept_pool`, for the verification that follows (the caller closes it with
        :meth:`close_kept_pool`)."""
        self.settings = settings
        self.keep_pool = keep_pool
        self.kept_pool: WarmPool | None = None
        self.reporter = reporter or _NullReporter()
        self.storage = open_storage(settings.storage)
        self.lock = threading.RLock()
        self.stop = threading.Event()
        """Set when a slot failed or the tuner was interrupted: every slot stops."""
        self.launcher = TrialLauncher(settings=settings, storage=self.storage, reporter=self.reporter,
                                      stop=self.stop, pool=pool)
        self.recorder = Recorder(settings=settings, storage=self.storage)
        self.advisor: Any = None
        self.running_here: set[int] = set()
        """Trial ids this tuner runs now (other workers' running trials are waited for at the end)."""
        self._in_flight: dict[str, threading.Event] = {}
        self._crashes_in_a_row = 0
        self.budget = TimeBudget(budget_s=settings.time_budget_s, started=time.monotonic())
        """``--time-budget``: started again by :meth:`run`."""

    @property
    def trials_run(self) -> int:
        return self.launcher.trials_run

    def run(self) -> TuneResult:
        s = self.settings
        start = time.monotonic()
        self.budget = TimeBudget(budget_s=s.time_budget_s, started=start)
        self.launcher.slots()  # bad --gpus-per-trial/--cpus-per-trial: an error before anything runs
        if s.nnodes > 1 and not s.rdzv_endpoint:
            raise UsageError(f"--nnodes={s.nnodes} needs --rdzv-endpoint HOST:PORT (a port on this node that the other "
                             "nodes reach); start `autobalance worker` with the same endpoint on each of them.")
        study = open_study(s, self.storage)
        self.recorder.load(study)
        space_dict = study.user_attrs.get(StudyAttr.SPACE)
        space = SearchSpace.from_dict(space_dict) if space_dict else None
        if space is not None:
            check_space(s, space)
        self.reporter.begin(s, already=counted_trials(study), deadline=self.budget.deadline)
        try:
            if space is None or StudyAttr.BASELINE not in study.user_attrs:
                space = baseline_once(study, settings=s, storage=self.storage, launcher=self.launcher,
                                      recorder=self.recorder, reporter=self.reporter)
            self.recorder.launch_settings(study)
            if self.advisor is None and s.strategy == "model":
                self.advisor = _make_advisor(space=space, settings=s)
            run_trials(self, study, space)
        finally:
            self.close()
        base_no = study.user_attrs.get(StudyAttr.BASELINE)
        result = TuneResult(study_name=s.study_name, storage=mask_url(s.storage), trials_run=self.trials_run,
                            baseline=study.trials[base_no] if base_no is not None else None,
                            best=best_trial(study), wall_s=time.monotonic() - start)
        result.time_spent = {"slots": len(self.launcher.slots()), "budget_s": s.time_budget_s,
                             "stopped_by_budget": self.budget.stopped, "trials": counted_trials(study), "of": s.trials,
                             **(self.budget.record() if s.time_budget_s is not None else {})}
        summarise(study, result, cold_note=self.launcher.cold_note, advisor=self.advisor,
                  launched_here=set(self.recorder.launched_here))
        return result

    def more_trials(self, study: optuna.Study) -> bool:
        """Whether to ask for another trial; waits for other workers' running trials at the end
        (one may go stale and need a replacement)."""
        noted = False
        while True:
            if self.stop.is_set():
                return False
            fail_stale_trials(study, self.storage)
            self._reserve(study)
            spent = self.budget.spent(time.monotonic())
            if counted_trials(study) < self.settings.trials:
                if spent:  # Optuna's `timeout`: no trial starts after the budget
                    self._budget_spent(study)
                return not spent
            if spent:  # other workers' running trials are not waited for
                return False
            with self.lock:  # this tuner's own running trials (other slots) are not waited for
                running = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                           if trial_id(t) not in self.running_here]
            if not running:
                return False
            if not noted:
                self.reporter.note(f"Waiting for {len(running)} trial(s) that other workers on this study are running.")
                noted = True
            time.sleep(min(3.0, heartbeat_interval_s() / 2))

    def _reserve(self, study: optuna.Study) -> None:
        """Update what the time budget keeps free: the next trial and the best trial's verification
        as predicted from this study's trials (``_verify_time.py``); nothing without a budget."""
        s = self.settings
        if self.budget.budget_s is None:
            return
        trials = study.get_trials(deepcopy=False)
        self.budget.next_trial_s = next_trial_s(trials)
        if not s.verify or s.nnodes > 1:  # nothing is verified after the study
            return
        space = study.user_attrs.get(StudyAttr.SPACE) or {}
        base_no = study.user_attrs.get(StudyAttr.BASELINE)
        own = next((t.user_attrs.get(TrialAttr.CONFIG) for t in trials if t.number == base_no), None)
        forecast = forecast_verification(trials, baseline=BalanceConfig.from_dict(own) if own else None,
                                         best=best_trial(study), num_layers=int(space.get("num_layers") or 0),
                                         device=s.device)
        self.budget.reserve_s, self.budget.reserve_runs = forecast.seconds, len(forecast.runs)
        if self.advisor is not None and self.budget.deadline is not None:  # no compile the budget cannot hold
            self.advisor.time_left_s = (self.budget.deadline - time.monotonic() - self.budget.reserve_s
                                        - self.budget.next_trial_s)

    def _budget_spent(self, study: optuna.Study) -> None:
        """The first slot to see the budget spent says so; every slot then stops asking."""
        with self.lock:
            if self.budget.stopped:
                return
            self.budget.stopped = True
            left = (self.budget.deadline or 0.0) - time.monotonic()
            self.budget.left_at_stop = left
        budget = describe_budget(self.budget.budget_s or 0.0)
        if left > 0:  # stopped early: the time left holds no further trial with verification after it
            self.reporter.note(
                f"Time budget ({budget}): {left:.0f} s left after {counted_trials(study)} of {self.settings.trials} "
                f"trials, kept for the next trial's {self.budget.next_trial_s:.0f} s and verification's predicted "
                f"{self.budget.reserve_s:.0f} s ({self.budget.reserve_runs} one-step runs): no new trial starts; "
                "running ones finish, then the best is verified and saved.")
            return
        self.reporter.note(f"Time budget ({budget}) spent after {counted_trials(study)} of {self.settings.trials} "
                           "trials: no new trial starts; running ones finish, then the best is verified and saved.")

    @contextlib.contextmanager
    def measuring(self, config: BalanceConfig) -> Iterator[None]:
        """Hold ``config`` while this slot measures it; another slot holding it is waited for first
        (then its result is reused)."""
        key = config.to_json()
        while True:
            with self.lock:
                running = self._in_flight.get(key)
                if running is None:
                    done = self._in_flight[key] = threading.Event()
                    break
            while not running.wait(0.5):
                if self.stop.is_set():
                    raise Stopped
        try:
            yield
        finally:
            with self.lock:
                self._in_flight.pop(key, None)
            done.set()

    def check_stop(self, study: optuna.Study, outcome: TrialOutcome) -> None:
        """Stop the study after too many crashes in a row, or a script error (``--on-error stop``,
        or before any trial was measured)."""
        if outcome.status == Status.CRASH:
            self._crashes_in_a_row += 1
            if self._crashes_in_a_row >= MAX_CRASHES_IN_A_ROW:
                raise LaunchError(
                    f"{self._crashes_in_a_row} trials in a row crashed (last: {outcome.reason}); "
                    f"stopping. Logs in {outcome.trial_dir}."
                )
            return
        self._crashes_in_a_row = 0
        if outcome.status == Status.ERROR:
            any_ok = any(t.user_attrs.get(TrialAttr.STATUS) == Status.OK for t in study.get_trials(deepcopy=False))
            if self.settings.on_error == "stop" or not any_ok:
                raise TrialScriptError(
                    f"trial {study.trials[-1].number} failed in the training script: {outcome.reason}. "
                    f"Logs in {outcome.trial_dir}. (Use --on-error continue to skip such trials.)",
                    traceback_text=outcome.traceback, rank=outcome.failing_rank,
                )

    def close(self) -> None:
        if self.keep_pool:
            self.kept_pool = self.launcher.take_pool()
        self.launcher.close()

    def close_kept_pool(self) -> None:
        if self.kept_pool is not None:
            self.kept_pool.close()
            self.kept_pool = None


def _make_advisor(*, space: SearchSpace, settings: TuneSettings) -> Any:
    try:
        from autobalance.tuner.search import ModelAdvisor
    except ImportError:
        return None
    return ModelAdvisor(space=space, settings=settings)


class _NullReporter:
    def begin(self, settings: TuneSettings, *, already: int, deadline: float | None = None) -> None: ...
    def start(self, number: int, config: BalanceConfig | None, *, baseline: bool = False) -> None: ...
    def tick(self, number: int, elapsed: float) -> None: ...
    def note(self, text: str) -> None: ...
    def finish(self, trial: FrozenTrial, best: FrozenTrial | None, *, reused: bool = False,
               predicted: bool = False) -> None: ...
