"""The tuner: an Optuna study whose trials are real torchrun jobs. :meth:`Tuner.run` opens the
study, runs the baseline once, then builds and runs the trial loop (:class:`~autobalance.tuner._loop.TrialLoop`)."""

from __future__ import annotations

import contextlib
import time

import optuna

from autobalance._errors import UsageError
from autobalance.launcher import WarmPool
from autobalance.protocol import StudyAttr, best_trial, exchange_rate_text
from autobalance.store import mask_url, open_storage
from autobalance.tuner._baseline import baseline_done, baseline_once
from autobalance.tuner._launching import TrialLauncher
from autobalance.tuner._loop import TrialLoop
from autobalance.tuner._recording import Recorder
from autobalance.tuner._reporter import Advisor, NullReporter, Reporter
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner._study import check_space, counted_trials, open_study
from autobalance.tuner._summary import TuneResult, summarise
from autobalance.tuner.search import ModelAdvisor, SearchSpace, TimeBudget

__all__ = ["Tuner"]


class Tuner:
    """Runs ``settings.trials`` trials of one study (continuing an existing one). Its parts (the
    :class:`TrialLauncher`, the :class:`Recorder`, the advisor, the time budget) are handed to the
    :class:`TrialLoop` (:meth:`trial_loop`), which owns the loop's state."""

    counted_trials = staticmethod(counted_trials)

    def __init__(self, *, settings: TuneSettings, reporter: Reporter | None = None, pool: WarmPool | None = None,
                 keep_pool: bool = False) -> None:
        """``pool``: a warm pool shared with other tuners of the same script (the caller closes it). ``keep_pool``:
        leave the study's own warm pool running when :meth:`run` ends, as :attr:`kept_pool`, for the verification
        that follows (the caller closes it with :meth:`close_kept_pool`)."""
        self.settings = settings
        self.keep_pool = keep_pool
        self.kept_pool: WarmPool | None = None
        self.reporter: Reporter = reporter or NullReporter()
        self.storage = open_storage(settings.storage)
        self.launcher = TrialLauncher(settings=settings, storage=self.storage, reporter=self.reporter, pool=pool)
        self.recorder = Recorder(settings=settings, storage=self.storage)
        self.advisor: Advisor | None = None
        self.budget = TimeBudget(budget_s=settings.time_budget_s, started=time.monotonic())
        """``--time-budget``: started again by :meth:`run`."""

    def run(self) -> TuneResult:
        s = self.settings
        start = time.monotonic()
        self.budget = TimeBudget(budget_s=s.time_budget_s, started=start)
        self.launcher.slots()  # bad --gpus-per-trial/--cpus-per-trial: an error before anything runs
        if s.nnodes > 1 and not s.rdzv_endpoint:
            raise UsageError(f"--nnodes={s.nnodes} needs --rdzv-endpoint HOST:PORT (a port on this node that the other "
                             "nodes reach); start `autobalance worker` with the same endpoint on each of them.")
        created = not _exists(self.storage, s.study_name)
        study = open_study(s, self.storage)
        self.recorder.load(study)
        space_dict = study.user_attrs.get(StudyAttr.SPACE)
        space = SearchSpace.from_dict(space_dict) if space_dict else None
        if space is not None:
            check_space(s, space)
        already = counted_trials(study)
        self.reporter.begin(s, already=already, deadline=self.budget.deadline)
        try:
            if space is not None and baseline_done(study.user_attrs):  # continued: the study's trade, again
                self.reporter.note(exchange_rate_text(study.user_attrs) or "Exchange rate: the first step fixes it.")
            else:
                try:
                    space = baseline_once(study, settings=s, storage=self.storage, launcher=self.launcher,
                                          recorder=self.recorder, reporter=self.reporter)
                except BaseException:
                    if created:  # a baseline that failed before recording a trial leaves no empty study behind
                        _drop_if_empty(study, self.storage)
                    raise
            self.recorder.launch_settings(study, cold=self.launcher.cold)
            if self.advisor is None and s.strategy == "model":
                self.advisor = ModelAdvisor(space=space, settings=s)
            loop = self.trial_loop()
            loop.run(study, space)
        finally:
            self.close()
        base_no = study.user_attrs.get(StudyAttr.BASELINE)
        result = TuneResult(study_name=s.study_name, storage=mask_url(s.storage), trials_run=self.launcher.trials_run,
                            baseline=study.trials[base_no] if base_no is not None else None,
                            best=best_trial(study), wall_s=time.monotonic() - start, already=already, of=s.trials)
        result.time_spent = {"slots": len(self.launcher.slots()), "budget_s": s.time_budget_s,
                             "stopped_by_budget": self.budget.stopped, "trials": counted_trials(study), "of": s.trials,
                             "leaders_s": round(loop.leaders_s, 3),
                             **(self.budget.record() if s.time_budget_s is not None else {})}
        summarise(study, result, cold_note=self.launcher.cold_note, advisor=self.advisor,
                  launched_here=set(self.recorder.launched_here))
        return result

    def trial_loop(self) -> TrialLoop:
        """The trial loop over this tuner's parts (its launcher, recorder, reporter, advisor and time budget)."""
        return TrialLoop(settings=self.settings, storage=self.storage, launcher=self.launcher, recorder=self.recorder,
                         reporter=self.reporter, advisor=self.advisor, budget=self.budget)

    def close(self) -> None:
        if self.keep_pool:
            self.kept_pool = self.launcher.take_pool()
        self.launcher.close()

    def close_kept_pool(self) -> None:
        if self.kept_pool is not None:
            self.kept_pool.close()
            self.kept_pool = None


def _exists(storage: optuna.storages.BaseStorage, name: str) -> bool:
    try:
        storage.get_study_id_from_name(name)
    except KeyError:
        return False
    return True


def _drop_if_empty(study: optuna.Study, storage: optuna.storages.BaseStorage) -> None:
    """Delete ``study`` when it has no trial at all (this run created it and its baseline failed
    before recording one); a study with any trial, another worker's running one included, stays."""
    with contextlib.suppress(Exception):  # the baseline's own error is what the user must see
        if not study.get_trials(deepcopy=False):
            optuna.delete_study(study_name=study.study_name, storage=storage)
