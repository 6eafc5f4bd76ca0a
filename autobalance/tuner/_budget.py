"""Where a ``tune`` run's wall time went, and its time budget (``--time-budget``).

Each launched trial records its wall time by part (:data:`TrialAttr.TIME_SPLIT`): from the launch
to the slowest rank's first step (``startup``: torchrun, imports, the script's set-up, a warm pool's
start), ``compile`` (the compiling step), ``steps`` (warm-up and measured), ``remeasure`` (a second
run) and ``other`` (the report and the hand-over after the last step). The first step's moment comes
from each rank's report (written at ``written_at``, ``timing.wall_s`` after the rank's plan began,
whose first step came ``timing.startup_s`` after that); a trial that never reached a step spent its
whole run starting up. The run's time is then the sum over the trials it launched, plus
verification, plus the rest (the tuner itself: sampling, recording, predictions without launching).
The time budget keeps verification's predicted time free (:class:`TimeBudget`, ``search/_timing.py``).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optuna.trial import FrozenTrial, TrialState

from autobalance.launcher import TrialOutcome
from autobalance.protocol import RankTiming, TrialAttr
from autobalance.tuner.search import per_trial_overhead_s

if TYPE_CHECKING:
    from autobalance._config import BalanceConfig
    from autobalance.tuner.search import Decision, VerifyForecast

__all__ = ["TIME_PARTS", "TimeBudget", "TrialOverhead", "describe_budget", "per_trial_overhead_s", "time_lines",
           "time_spent", "trial_time_split"]

TIME_PARTS = ("compile", "startup", "steps", "remeasure", "verify")
"""The parts of a run's wall time besides ``other``, in the order the summary names them."""
_WORDS = {"compile": "compiling", "startup": "start-up (launch to first step)", "steps": "steps",
          "remeasure": "re-measuring", "verify": "verification"}


def _epoch(text: Any) -> float | None:
    try:
        return datetime.datetime.fromisoformat(str(text)).timestamp()
    except ValueError:
        return None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def trial_time_split(outcome: TrialOutcome) -> dict[str, float]:
    """The trial's wall time by part (see the module docstring); the parts sum to ``outcome.wall_s``."""
    wall = max(0.0, float(outcome.wall_s))
    again = min(wall, max(0.0, _number((outcome.remeasured or {}).get("wall_s")) or 0.0))
    first_run = wall - again
    compiles, steps, first_steps = [], [], []
    reached = False
    for rep in outcome.reports.values():
        timing = rep.timing or RankTiming()
        compiles.append(_number(timing.compile_s) or 0.0)
        steps.append(_number(timing.steps_s) or 0.0)
        startup, rank_wall, written = _number(timing.startup_s), _number(timing.wall_s), _epoch(rep.written_at)
        if startup is not None:
            reached = True
            if rank_wall is not None and written is not None:
                first_steps.append(written - rank_wall + startup)
    compile_s = min(first_run, max(compiles, default=0.0))
    steps_s = min(first_run - compile_s, max(steps, default=0.0))
    left = first_run - compile_s - steps_s
    if not reached:  # no rank reached a step: the run was all start-up
        startup_s = left
    elif first_steps and outcome.started_at is not None:
        startup_s = min(left, max(0.0, max(first_steps) - outcome.started_at))
    else:
        startup_s = 0.0
    parts = {"startup": startup_s, "compile": compile_s, "steps": steps_s, "remeasure": again,
             "other": left - startup_s}
    return {k: round(v, 3) for k, v in parts.items()}


def time_spent(trials: list[FrozenTrial], numbers: set[int]) -> dict[str, float]:
    """Seconds by part summed over the trials numbered ``numbers`` (those this run launched);
    ``handover`` is their ``other`` part (after the last step)."""
    total = dict.fromkeys(("compile", "startup", "steps", "remeasure", "handover"), 0.0)
    for t in trials:
        split = t.user_attrs.get(TrialAttr.TIME_SPLIT)
        if t.number not in numbers or not isinstance(split, dict) or t.user_attrs.get(TrialAttr.REUSED_FROM) is not None:
            continue
        for key in total:
            total[key] += _number(split.get("other" if key == "handover" else key)) or 0.0
    return {k: round(v, 3) for k, v in total.items()}


@dataclass(kw_only=True)
class TimeBudget:
    """``--time-budget`` of one run: the run, verification included, ends by ``deadline``
    (``time.monotonic()``): no trial starts once the time left is below the next trial's expected
    time plus verification's predicted time (``search/_timing.py``). The one place a stop for time is
    decided: :meth:`spent` (the loop's stop rule), :meth:`unaffordable` (a proposal, or the trial
    asked, that the time left does not hold with verification's reserve after it) and
    :meth:`holds_compile` (a compile the time left holds), each over one ``search.Decision``."""

    budget_s: float | None
    started: float
    stopped: bool = False
    """Whether the budget, not ``--trials``, ended the trial loop."""
    reserve_s: float = 0.0
    """What is kept free at the end of the budget for verification: its forecast times the margin
    (``search.RESERVE_MARGIN``)."""
    reserve_runs: int = 0
    """Verification's predicted one-step runs."""
    next_trial_s: float = 0.0
    """The next trial's expected time (the median launched trial)."""
    left_at_stop: float | None = None
    """The time left when the budget stopped the trial loop."""
    verify: bool = True
    """Whether the study's best is verified after the trial loop (its runs reserved; ``tune --no-verify``
    and several nodes: nothing reserved)."""
    leaders: bool = False
    """Whether the leaders are re-measured before saving (``_remeasure.py``; ``--remeasure``, one node):
    their least plan is then kept free too (:attr:`leaders_s`)."""
    leaders_s: float = 0.0
    """What is kept free for re-measuring the leaders: the least plan (one more run of the best and of
    the next trial within its measured noise, ``_remeasure.least_plan``); 0 when none is within it."""
    compile_left_s: float | None = None
    """Seconds left for a compile once verification's reserve and a usual trial are kept (None: no
    budget, or nothing verified): a proposal that compiles new graphs is made only when the study's
    median compile fits in it, and only when it is predicted to beat the best trial."""

    @property
    def deadline(self) -> float | None:
        return None if self.budget_s is None else self.started + self.budget_s

    def spent(self, now: float) -> bool:
        """Whether no further trial may start: the time left does not hold the next trial and
        verification, or a proposal found it so (:attr:`stopped`)."""
        return self.deadline is not None and (self.stopped or not self.holds(now, self.next_trial_s,
                                                                            self.reserve_s + self.leaders_s))

    def holds(self, now: float, trial_s: float, reserve_s: float) -> bool:
        """Whether a trial of ``trial_s`` started ``now`` still leaves ``reserve_s`` (verification's
        reserve after it) before the deadline."""
        return self.deadline is None or now + trial_s + reserve_s < self.deadline

    def refresh(self, decision: Decision, now: float) -> None:
        """What is kept free, as predicted from ``decision``'s trials (``search/_timing.py``): the next
        trial, and the best trial's verification (:attr:`reserve_s`); nothing without a budget."""
        from autobalance.protocol import best_trial
        from autobalance.tuner.search import next_trial_s

        if self.budget_s is None:
            return
        self.next_trial_s = next_trial_s(decision.trials)
        leaders: list[FrozenTrial] = []
        if self.leaders:
            from autobalance.tuner._remeasure import least_plan

            leaders, self.leaders_s = least_plan(decision.study, decision.trials, device=decision.device)
        forecast = self.forecast(decision, best_trial(decision.study))
        if forecast is None:  # nothing is verified after the study
            return
        for leader in leaders[1:]:  # a leader may become the best: the larger verification is kept
            other = self.forecast(decision, leader)
            if other is not None and other.reserve_s > forecast.reserve_s:
                forecast = other
        self.reserve_s, self.reserve_runs = forecast.reserve_s, len(forecast.runs)
        if self.deadline is not None:  # no compile the budget cannot hold
            self.compile_left_s = self.deadline - now - self.reserve_s - self.leaders_s - self.next_trial_s

    def forecast(self, decision: Decision, best: FrozenTrial | None) -> VerifyForecast | None:
        """Verification's forecast for ``best``, priced with ``decision``'s step-time models; None when
        nothing is verified."""
        from autobalance._config import BalanceConfig
        from autobalance.protocol import StudyAttr
        from autobalance.tuner.search import forecast_verification

        if not self.verify:
            return None
        base_no = decision.study.user_attrs.get(StudyAttr.BASELINE)
        own = next((t.user_attrs.get(TrialAttr.CONFIG) for t in decision.trials if t.number == base_no), None)
        return forecast_verification(decision.trials, baseline=BalanceConfig.from_dict(own) if own else None,
                                     best=best, num_layers=decision.num_layers, device=decision.device,
                                     eager=decision.step_time, compiled=decision.compiled_time)

    def unaffordable(self, decision: Decision, config: BalanceConfig) -> str | None:
        """Why ``config`` is not launched under the time budget (None: it is): its expected time (a
        compile included) plus verification's reserve after it - of the best so far, or of ``config``
        should it become the best - no longer fits in the time left (``decision.clock``)."""
        from autobalance.tuner.search import trial_s

        if self.deadline is None:
            return None
        trials = decision.trials
        took = trial_s(trials, config, device=decision.device)
        candidate = FrozenTrial(number=len(trials), state=TrialState.COMPLETE, value=None, values=None,
                                datetime_start=None, datetime_complete=None, params={}, distributions={},
                                user_attrs={TrialAttr.CONFIG: config.to_dict()}, system_attrs={},
                                intermediate_values={}, trial_id=-1)
        forecast = self.forecast(decision, candidate)
        reserve = max(self.reserve_s, forecast.reserve_s if forecast is not None else 0.0) + self.leaders_s
        now = decision.clock()
        if self.holds(now, took, reserve):
            return None
        leaders = f" (re-measuring the leaders {self.leaders_s:.0f} s of it)" if self.leaders_s > 0 else ""
        return (f"the time budget no longer holds it: {max(0.0, self.deadline - now):.0f} s left, it would take "
                f"about {took:.0f} s and verification after it {reserve:.0f} s{leaders}; nothing was launched")

    def holds_compile(self, decision: Decision, scope: str | None = None) -> bool:
        """Whether the time left for a compile (:attr:`compile_left_s`) holds the study's median compile
        (``scope``: of that scope, ``compile_times``); always without a limit."""
        from autobalance.tuner.search import compile_times

        if self.compile_left_s is None:
            return True
        _, compile_s = compile_times(decision.trials, device=decision.device, scope=scope)
        return compile_s <= self.compile_left_s

    def record(self) -> dict[str, Any]:
        """What the run's time accounting keeps about the reservation."""
        return {"verify_reserved": round(self.reserve_s, 1), "verify_reserved_runs": self.reserve_runs,
                "next_trial_s": round(self.next_trial_s, 1), "leaders_reserved": round(self.leaders_s, 1),
                "left_at_stop": None if self.left_at_stop is None else round(self.left_at_stop, 1)}


class TrialOverhead:
    """The per-trial overhead (:func:`per_trial_overhead_s`) over the study's trials as of the last
    one recorded: what ``--measure-s auto`` sizes a launch's measurement by, so that a launch reads a
    figure, not the study. The trial loop updates it (:meth:`update`) once per recorded trial and when it
    starts (the baseline's and a resumed study's trials); another worker's trials on the same study
    count from this loop's next recorded trial on."""

    def __init__(self) -> None:
        self.seconds: float | None = None
        """The overhead in seconds; None before any launched ``ok`` trial."""
        self.counted = False
        """Whether :meth:`update` has run (before it, a launch counts the study as it was opened)."""

    def update(self, trials: list[FrozenTrial]) -> float | None:
        """Count ``trials`` (the study's, in order); the overhead over them."""
        self.seconds = per_trial_overhead_s(trials)
        self.counted = True
        return self.seconds


def describe_budget(seconds: float) -> str:
    """``600`` -> ``10m``, ``5400`` -> ``1.5h``, ``90`` -> ``90s``."""
    if seconds >= 3600 and seconds % 360 == 0:
        return f"{seconds / 3600:g}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"


def time_lines(spent: dict[str, Any]) -> list[str]:
    """The summary's lines about time from a run's :data:`StudyAttr.TIME_SPENT` record: where the wall
    time went, and whether the time budget stopped the study."""
    wall = _number(spent.get("wall"))
    if wall is None:
        return []
    slots = int(spent.get("slots") or 1)
    parts = {k: _number(spent.get(k)) or 0.0 for k in TIME_PARTS}
    shown = [(k, v) for k, v in parts.items() if v > 0 or k in ("compile", "startup", "steps")]
    lines = []
    if slots == 1:
        other = max(0.0, wall - sum(parts.values()))
        items = [f"{_WORDS[k]} {v:.1f} s ({100 * v / max(wall, 1e-9):.0f}%)" for k, v in shown]
        items.append(f"other {other:.1f} s ({100 * other / max(wall, 1e-9):.0f}%: the tuner, trials' hand-overs)")
        lines.append(f"Time: {wall:.1f} s in all: " + ", ".join(items) + ".")
    else:  # trials ran side by side: their times add up to more than the wall time
        items = [f"{_WORDS[k]} {v:.1f} s" for k, v in shown]
        lines.append(f"Time: {wall:.1f} s in all, {slots} trials at a time; summed over the slots: "
                     + ", ".join(items) + ".")
    budget = _number(spent.get("budget_s"))
    reserved = _number(spent.get("verify_reserved")) or 0.0
    left = _number(spent.get("left_at_stop"))
    if budget is not None and spent.get("stopped_by_budget"):
        text = (f"Stopped by the time budget ({describe_budget(budget)}) after {spent.get('trials')} of "
                f"{spent.get('of')} trials: ")
        if left is not None and left > 0:  # stopped before the budget's end: what the time left had to hold
            text += (f"no trial started once the time left ({max(0.0, left):.0f} s) no longer held the next trial "
                     f"(about {_number(spent.get('next_trial_s')) or 0.0:.0f} s) and verification (predicted "
                     f"{reserved:.0f} s, {spent.get('verify_reserved_runs')} one-step runs), running ones finished")
        else:
            text += "no trial started after it, running ones finished"
        if spent.get("verified"):
            text += (f"; verification took {parts['verify']:.1f} s of the {reserved:.0f} s reserved." if reserved > 0
                     else f"; verification ran after the budget ({parts['verify']:.1f} s).")
        else:
            text += "; nothing was verified after it (no feasible trial, or --no-verify)."
        lines.append(text)
    elif budget is not None:
        text = f"Time budget {describe_budget(budget)}: not reached ({spent.get('trials')} of {spent.get('of')} trials ran within it"
        if reserved > 0:
            text += f"; verification was predicted at {reserved:.0f} s"
            text += f", took {parts['verify']:.1f} s" if spent.get("verified") else ""
        lines.append(text + ").")
    return lines
