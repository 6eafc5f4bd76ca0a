"""Where a ``tune`` run's wall time went, and its time budget (``--time-budget``).

Each launched trial records its wall time by part (:data:`TrialAttr.TIME_SPLIT`): from the launch to the slowest
rank's first step (``startup``: torchrun, imports, the script's set-up, a warm pool's start), ``compile`` (the
compiling step), ``steps`` (warm-up and measured), ``remeasure`` (a second run) and ``other`` (the report and the
hand-over after the last step). The first step's moment comes from each rank's report (written at ``written_at``,
``timing.wall_s`` after the rank's plan began, whose first step came ``timing.startup_s`` after that); a trial that
never reached a step spent its whole run starting up. The run's time is then the sum over the trials it launched,
plus verification, plus the rest (the tuner itself: sampling, recording, predictions without launching). The time
budget keeps verification's predicted time free (:class:`TimeBudget`, ``search/_timing.py``).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial

from autobalance._files import is_number
from autobalance.launcher import TrialOutcome
from autobalance.protocol import RankTiming, TrialAttr
from autobalance.tuner.search import per_trial_overhead_s

__all__ = ["TIME_PARTS", "TrialOverhead", "describe_budget", "time_lines", "time_spent", "trial_time_split"]

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
    return float(value) if is_number(value) else None


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


@dataclass
class TrialOverhead:
    """The per-trial overhead (:func:`per_trial_overhead_s`) as of the last trial recorded, what ``--measure-s
    auto`` sizes a launch by: ``seconds`` (None before any launched ``ok`` trial), and whether the loop has
    ``counted`` the trials (:meth:`update`, per recorded trial and when it starts; before it, a launch counts
    the study as opened; another worker's trials count from this loop's next recorded one on)."""

    seconds: float | None = None
    counted: bool = False

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
