"""The trial loop: :meth:`TrialLoop.one_trial` (ask, settle without launching, launch, measure
again, record) repeated by :meth:`TrialLoop.run` (on one thread, or one per slot) while
:meth:`TrialLoop.more_trials`, the head of the loop, finds no stop rule met."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance._errors import LaunchError, TrialScriptError
from autobalance.launcher import TrialOutcome, interrupts_deferred
from autobalance.protocol import (
    MEASURED_STATUSES,
    Status,
    StudyAttr,
    TrialAttr,
    best_trial,
    would_be_best,
)
from autobalance.store import heartbeat_interval_s, study_id, trial_id
from autobalance.tuner._launching import Slot, Stopped, TrialLauncher, best_step_s
from autobalance.tuner._recording import Recorder, feasible
from autobalance.tuner._remeasure import (
    close_leaders,
    leader_candidates,
    leader_run_s,
    leaders_line,
    least_plan,
    merge_outcomes,
    plan_leaders,
    remeasure_leaders,
    remeasure_reason,
)
from autobalance.tuner._reporter import Advisor, Reporter
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner._study import RunningClaim, counted_trials, fail_stale_trials
from autobalance.tuner._time_spent import describe_budget
from autobalance.tuner.search import (
    MAX_CRASHES_IN_A_ROW,
    Decision,
    SearchSpace,
    TimeBudget,
    TrialFigures,
    proposal_line,
)

__all__ = ["TrialLoop"]


class TrialLoop:
    """Runs trials until the study has ``settings.trials`` counted ones. Several slots run
    :meth:`one_trial` at once; ``lock`` serialises what they share."""

    def __init__(self, *, settings: TuneSettings, storage: optuna.storages.RDBStorage, launcher: TrialLauncher,
                 recorder: Recorder, reporter: Reporter, advisor: Advisor | None, budget: TimeBudget) -> None:
        self.settings = settings
        self.storage = storage
        self.launcher = launcher
        self.recorder = recorder
        self.reporter = reporter
        self.advisor = advisor
        self.budget = budget  # --time-budget: the loop stops asking once it is spent
        if budget is not None:  # verification's runs are reserved only when the study's best is verified
            budget.verify = settings.verify and settings.nnodes <= 1
            if self.remeasure_on() and settings.nnodes <= 1:  # and the leaders' re-measure
                budget.leaders = least_plan
        self.lock = threading.RLock()
        self.stop = launcher.stop  # a slot failed or the tuner was interrupted: every slot stops
        self.running_here: set[int] = set()  # trial ids this loop runs now
        self._in_flight: dict[str, threading.Event] = {}  # the configurations being measured
        self._crashes_in_a_row = 0
        self._halt: Exception | None = None  # a trial's verdict that stops the study (check_stop)
        self.ended: str | None = None  # why the loop ended: the stop rule more_trials found met
        self._decision: Decision | None = None
        self.leaders_s = 0.0  # seconds the leaders' re-measure took

    def decision(self, study: optuna.Study) -> Decision:
        """The next trial's ``search.Decision``: the last one while no trial finished since, else a new one."""
        with self.lock:
            decision = self._decision
            if decision is None or not decision.current(study):
                space = study.user_attrs.get(StudyAttr.SPACE) or {}
                decision = self._decision = Decision(
                    study, num_layers=int(space.get("num_layers") or 0), device=self.settings.device,
                    errors=getattr(self.advisor, "errors", None),
                    budget=self.budget if self.budget.budget_s is not None else None, clock=time.monotonic)
            return decision

    # ------------------------------------------------------------------ one trial
    def one_trial(self, study: optuna.Study, space: SearchSpace) -> None:
        """Ask for one trial, run it (or reuse / predict its result) and record it."""
        # 1. Ask Optuna (the advisor may have queued its proposal); one ask at a time.
        with self.lock:
            if self.advisor is not None:
                self.advisor.before_ask(study, self.decision(study))
            trial = study.ask()
            self.launcher.beat_now(trial)
            if self.recorder.surplus(study, trial):  # another worker took the study's last trial
                return
            self.running_here.add(trial_id(trial))
        claim: RunningClaim | None = None
        try:
            config = space.suggest(trial)
            with self.measuring(config):  # another slot measuring the same configuration: wait for it
                # 2. A result known (measured before) or predicted (cannot fit): recorded without launching.
                with self.lock:
                    if (seen := self.recorder.seen(config)) is not None:
                        frozen = self.recorder.reuse(study, trial, seen)
                        return self._settled(study, frozen, reused=True)
                    prediction = self.advisor.predict_infeasible(study, config) if self.advisor is not None else None
                    if prediction is not None:
                        frozen = self.recorder.predicted(study, trial, config, prediction)
                        return self._settled(study, frozen, predicted=True)
                    if (late := self.over_budget(study, config)) is not None:  # the reserve must hold after it
                        self.recorder.not_started(study, trial, config, late)
                        self._budget_spent(study)
                        return
                # Another worker on the study launching it: wait for its trial, then reuse its result.
                claim, done = self.claim(study, trial, config)
                if done is not None:
                    with self.lock:
                        frozen = self.recorder.reuse(study, trial, done)
                        return self._settled(study, frozen, reused=True)
                # 3. Launch it: a torchrun job (warm pool, cold, or across nodes) that each rank reports on.
                self.reporter.start(trial.number, config, why=proposal_line(trial.user_attrs))
                try:
                    outcome = self.launcher.launch(study, number=trial.number, config=config, trial=trial)
                    figures = self.recorder.figures(study, outcome)
                    # 4. Measured again when its steps spread or it would become the best (tuner/_remeasure.py).
                    reason = self.remeasure_reason(study, outcome, figures)
                    if reason is not None:
                        second = self.launcher.launch(study, number=trial.number, config=config, trial=trial,
                                                      again=True)
                        outcome = merge_outcomes(outcome, second, reason=reason)
                        figures = self.recorder.figures(study, outcome)
                except KeyboardInterrupt as exc:
                    self.recorder.interrupted(study, trial, config, exc)
                    raise
                # 5. Record it: attributes, chart, constraints, tell; then the models learn from it.
                with self.lock:  # matplotlib (the trial's chart) and the advisor are not thread-safe
                    frozen = self.recorder.record(study, trial, config, outcome, figures=figures)
                    self.launcher.count_trials(study)  # the per-trial overhead the next launch measures by
                    if self.advisor is not None:
                        self.advisor.after_trial(study, frozen)
                    self.reporter.finish(frozen, best_trial(study))
                    self.check_stop(study, outcome)  # too many crashes, or a script error: the head stops the study
        except BaseException as exc:
            with contextlib.suppress(Exception):
                self.recorder.unfinished(study, trial, exc)  # never leave it RUNNING
            raise
        finally:
            if claim is not None:
                claim.release()
            with self.lock:
                self.running_here.discard(trial_id(trial))

    def _settled(self, study: optuna.Study, frozen: FrozenTrial, **how: bool) -> None:
        """A trial recorded without launching (reused or predicted): counted and said."""
        self.launcher.count_trials(study)
        self.reporter.finish(frozen, best_trial(study), **how)

    def claim(self, study: optuna.Study, trial: optuna.Trial,
              config: BalanceConfig) -> tuple[RunningClaim, FrozenTrial | None]:
        """Claim ``config`` across the study's workers, waiting while another worker's trial holds it
        (a dead worker's goes stale); then the trial that measured it meanwhile, to reuse, or None."""
        claim = RunningClaim(self.storage, study_id(study, self.storage), config_json=config.to_json(),
                             trial_id=trial_id(trial))
        noted = False
        while (holder := claim.try_acquire()) is not None:
            if self.stop.is_set():
                raise Stopped
            if not noted:
                self.reporter.note(f"trial {trial.number}: another worker's trial "
                                   f"{self.storage.get_trial(holder).number} runs the same configuration; "
                                   "waiting for its result.")
                noted = True
            self.launcher.beat_now(trial)
            fail_stale_trials(study, self.storage)
            time.sleep(min(3.0, heartbeat_interval_s() / 2))
        key = config.to_json()
        done = next((t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                     if t.user_attrs.get(TrialAttr.STATUS) in MEASURED_STATUSES
                     and BalanceConfig.from_dict(t.user_attrs.get(TrialAttr.CONFIG) or {}).to_json() == key), None)
        return claim, done

    def remeasure_reason(self, study: optuna.Study, outcome: TrialOutcome, figures: TrialFigures) -> str | None:
        """Why a measured trial runs once more (``_remeasure.remeasure_reason``), or None."""
        s = self.settings
        if outcome.status != Status.OK or not self.remeasure_on():
            return None
        best = feasible(figures, s, outcome.status) and would_be_best(study, figures.values(
            reference_step_s=study.user_attrs.get(StudyAttr.REFERENCE), weight_spread=s.weight_spread,
            weight_time=s.weight_time, multi_objective=s.multi_objective))
        return remeasure_reason(outcome, step_time_s=figures.step_time_s, would_be_best=best,
                                best_step_s=best_step_s(study))

    def remeasure_on(self) -> bool:
        """``--remeasure``: ``on``, or ``auto`` on CUDA (where one run's step time is not to be trusted)."""
        s = self.settings
        return s.remeasure == "on" or (s.remeasure == "auto" and s.device == "cuda")

    # ------------------------------------------------------------------ the loop
    def run(self, study: optuna.Study, space: SearchSpace) -> None:
        """Trials until the study has ``--trials`` counted ones; then the leaders re-measured."""
        self.launcher.count_trials(study)  # the baseline's and a resumed study's trials
        slots = self.launcher.slots()
        if len(slots) == 1:
            while self.more_trials(study):
                self.one_trial(study, space)
        else:
            self._run_parallel(study, space, slots)
        self.remeasure_leaders(study)

    def remeasure_leaders(self, study: optuna.Study) -> None:
        """Before saving: the best trial and those within its measured noise run again, as many runs as
        the time left holds with verification's reserve kept (``_remeasure.py``)."""
        s = self.settings
        if self.stop.is_set() or s.nnodes > 1 or not self.remeasure_on():
            return
        leaders, why = close_leaders(leader_candidates(study))
        if not leaders:
            return
        decision = self.decision(study)
        left: float | None = None
        if self.budget.deadline is not None:
            forecast = self.budget.largest_forecast(decision, leaders)
            left = self.budget.deadline - time.monotonic() - (forecast.reserve_s if forecast is not None else 0.0)
        plan = plan_leaders(leaders, run_s=lambda t: leader_run_s(decision.trials, t, device=s.device),
                            time_left_s=left, why=why)
        self.reporter.note(plan.reason)
        if plan.runs == 0:
            return
        started = time.monotonic()
        record = remeasure_leaders(plan, launch=lambda t: self.launcher.launch(
            study, number=t.number, config=BalanceConfig.from_dict(t.user_attrs[TrialAttr.CONFIG]),
            again=True), objective=study.user_attrs.get(StudyAttr.OBJECTIVE) or {},
            reference_s=study.user_attrs.get(StudyAttr.REFERENCE))
        self.leaders_s = time.monotonic() - started
        record["wall_s"] = round(self.leaders_s, 3)
        study.set_user_attr(StudyAttr.LEADERS, record)
        best = best_trial(study)
        self.reporter.note(leaders_line(record, was=leaders[0].number, now=None if best is None else best.number))

    def _run_parallel(self, study: optuna.Study, space: SearchSpace, slots: list[Slot]) -> None:
        """One thread per slot, each running :meth:`one_trial` until the study is done. A slot that
        fails or a Ctrl-C stops every slot: their running trials are killed and marked interrupted."""
        errors: list[BaseException] = []
        self.reporter.note(f"{len(slots)} trials at a time: " + "; ".join(slot.describe() for slot in slots) + ".")
        finished = [threading.Event() for _ in slots]

        def work(slot: Slot, done: threading.Event) -> None:
            self.launcher.enter_slot(slot)
            try:
                while not self.stop.is_set() and self.more_trials(study):
                    self.one_trial(study, space)
            except BaseException as exc:
                errors.append(exc)
                self.stop.set()
            finally:
                self.launcher.close_slot(slot)
                done.set()

        for slot, done in zip(slots, finished, strict=True):
            threading.Thread(target=work, args=(slot, done), name=f"autobalance-slot-{slot.index}",
                             daemon=True).start()
        # Events, not Thread.join: a join interrupted by Ctrl-C can mark a running thread as stopped
        # (CPython < 3.13), and the tuner would then exit while a slot still records its trial.
        try:
            while not all(done.is_set() for done in finished):
                for done in finished:
                    done.wait(timeout=0.2)
        except KeyboardInterrupt:
            self.stop.set()
            with interrupts_deferred():  # the slots kill and mark their trials; a second Ctrl-C waits
                for done in finished:
                    done.wait(timeout=120)
            raise
        if real := [e for e in errors if not isinstance(e, Stopped)]:
            raise real[0]
        if errors:
            raise KeyboardInterrupt

    # ------------------------------------------------------------------ the head of the loop: every stop rule
    def more_trials(self, study: optuna.Study) -> bool:
        """The head of the loop, read before every ask: whether to ask for another trial. Every rule that
        ends the loop is here, in order, its reason kept as :attr:`ended`. With ``--trials`` counted,
        other workers' running trials are waited for (one may go stale and need a replacement) unless
        the time budget is spent. The models' veto limit (``MAX_PREDICTED_IN_A_ROW``) ends no loop."""
        noted = False
        while True:
            if self._halt is not None:
                self.ended = f"stopped by a trial: {self._halt}"
                raise self._halt
            if self.stop.is_set():
                return self._end("stopped: a slot failed or the tuner was interrupted")
            fail_stale_trials(study, self.storage)
            if self.budget.budget_s is not None:  # what the budget keeps free, brought up to date
                self.budget.refresh(self.decision(study), time.monotonic())
            spent = self.budget.spent(time.monotonic())
            if counted_trials(study) < self.settings.trials:
                if not spent:
                    return True
                self._budget_spent(study)  # Optuna's `timeout`: no trial starts after the budget
                return self._end("the time budget holds no further trial with verification after it")
            if spent:  # other workers' running trials are not waited for
                return self._end(f"the study has its {self.settings.trials} trials (time budget spent)")
            with self.lock:  # this loop's own running trials (other slots) are not waited for
                running = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                           if trial_id(t) not in self.running_here]
            if not running:
                return self._end(f"the study has its {self.settings.trials} trials")
            if not noted:
                self.reporter.note(f"Waiting for {len(running)} trial(s) that other workers on this study are running.")
                noted = True
            time.sleep(min(3.0, heartbeat_interval_s() / 2))

    def _end(self, reason: str) -> bool:
        """False, ``reason`` kept as :attr:`ended` (the first reason a slot found)."""
        with self.lock:
            if self.ended is None:
                self.ended = reason
        return False

    def over_budget(self, study: optuna.Study, config: BalanceConfig) -> str | None:
        """Why ``config`` is not launched under the time budget (``TimeBudget.unaffordable``)."""
        return self.budget.unaffordable(self.decision(study), config)

    def _budget_spent(self, study: optuna.Study) -> None:
        """The first slot to see the budget spent says so; every slot then stops asking."""
        b = self.budget
        with self.lock:
            if b.stopped:
                return
            b.stopped = True
            left = b.left_at_stop = (b.deadline or 0.0) - time.monotonic()
        budget = f"Time budget ({describe_budget(b.budget_s or 0.0)})"
        trials = f"{counted_trials(study)} of {self.settings.trials} trials"
        then = "no new trial starts; running ones finish, then the best is verified and saved."
        if left <= 0:
            self.reporter.note(f"{budget} spent after {trials}: {then}")
            return
        leaders = f" and re-measuring the leaders' {b.leaders_s:.0f} s" if b.leaders_s > 0 else ""
        self.reporter.note(  # stopped early: the time left holds no further trial and verification
            f"{budget}: {left:.0f} s left after {trials}, kept for the next trial's "
            f"{b.next_trial_s:.0f} s and verification's predicted {b.reserve_s:.0f} s "
            f"({b.reserve_runs} one-step runs){leaders}: {then}")

    @contextlib.contextmanager
    def measuring(self, config: BalanceConfig) -> Iterator[None]:
        """Hold ``config`` while this slot measures it; another slot holding it is waited for first."""
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
        """After a recorded trial: whether it stops the study (too many crashes in a row, or a script
        error with ``--on-error stop`` or before any trial was measured); kept for :meth:`more_trials`."""
        if outcome.status == Status.CRASH:
            self._crashes_in_a_row += 1
            if self._crashes_in_a_row >= MAX_CRASHES_IN_A_ROW:
                self._halt = LaunchError(f"{self._crashes_in_a_row} trials in a row crashed (last: "
                                         f"{outcome.reason}); stopping. Logs in {outcome.trial_dir}.")
            return
        self._crashes_in_a_row = 0
        if outcome.status == Status.ERROR:
            any_ok = any(t.user_attrs.get(TrialAttr.STATUS) == Status.OK for t in study.get_trials(deepcopy=False))
            if self.settings.on_error == "stop" or not any_ok:
                self._halt = TrialScriptError(
                    f"trial {study.trials[-1].number} failed in the training script: {outcome.reason}. "
                    f"Logs in {outcome.trial_dir}. (Use --on-error continue to skip such trials.)",
                    traceback_text=outcome.traceback, rank=outcome.failing_rank)
