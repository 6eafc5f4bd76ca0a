"""A second measurement of a trial whose step time is not to be trusted from one run.

A rank's step time is the median of its measured steps; a trial's is the slowest rank's. On one
H200 one configuration measured 177-239 ms across a warm study: more than most differences the
search ranks. Each rank reports its steps' spread (``step_time_iqr_s``: interquartile range); the
tuner runs a measured trial once more when

- its spread is high: the IQR of a rank's measured steps exceeds :data:`DISPERSION_LIMIT` of its
  median (something disturbed the steps: another process, a clock change, garbage collection), or
- it is about to become the best: feasible and with a lower objective value than the study's best
  trial (``protocol.would_be_best``; a lucky measurement would otherwise steer the rest of the
  search and be what is saved).

The two runs are merged (:func:`merge_outcomes`): each rank's measured steps pooled, its step time
the median of those it stands for (the full steps when any was measured: a partial step at the
end of an epoch does less work); memory figures the larger of the two (a configuration that needed more once can need
it again). A second run that fails (an OOM the first run escaped) is the trial's outcome.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from typing import Any

from autobalance.launcher import TrialOutcome
from autobalance.protocol import RankMemory, RankReport, Status, timed_steps
from autobalance.tuner.search import DISPERSION_LIMIT

__all__ = ["DISPERSION_LIMIT", "dispersion", "merge_outcomes", "remeasure_reason"]


def _iqr(times: list[float]) -> float | None:
    if len(times) < 2:
        return None
    q = statistics.quantiles(times, n=4, method="inclusive")
    return q[2] - q[0]


def _timed(times: list[float], samples: list[Any] | None, rep: RankReport) -> tuple[list[float], float | None]:
    """The steps a rank's step time stands for (its full steps when any was measured: a partial
    step does less work) and their samples per step; see :func:`~autobalance.protocol.timed_steps`."""
    global_batch = _global_batch(rep)
    return timed_steps(times, samples, global_batch if isinstance(global_batch, int) else None)


def _global_batch(rep: RankReport) -> Any:
    """The global batch of the configuration the rank applied (as it reported it; None: not reported)."""
    return (rep.config or {}).get("global_batch")


def dispersion(outcome: TrialOutcome) -> float | None:
    """Largest IQR / median over the ranks' measured steps (those the step time stands for: a
    partial step is not spread); None without measured steps."""
    worst: float | None = None
    for rep in outcome.reports.values():
        times, _ = _timed([float(t) for t in rep.step_times_s or []], rep.step_samples, rep)
        iqr = _iqr(times)
        if iqr is None:
            continue
        median = statistics.median(times)
        if median > 0:
            worst = max(worst or 0.0, iqr / median)
    return worst


def remeasure_reason(outcome: TrialOutcome, *, step_time_s: float | None, would_be_best: bool,
                     best_step_s: float | None = None, limit: float = DISPERSION_LIMIT) -> str | None:
    """Why ``outcome`` (already measured once) must be measured again, or None. ``would_be_best``:
    feasible and better than the study's best trial (``protocol.would_be_best``); ``best_step_s``
    that trial's step time, for the sentence."""
    if outcome.status != Status.OK or step_time_s is None:
        return None
    spread = dispersion(outcome)
    if spread is not None and spread > limit:
        return f"its measured steps' IQR is {100 * spread:.1f} % of their median (> {100 * limit:.0f} %)"
    if would_be_best:
        was = f"; the best so far {1000 * best_step_s:.1f} ms" if best_step_s is not None else ""
        return f"it would become the best ({1000 * step_time_s:.1f} ms{was}): confirmed by a second run"
    return None


def _padded(samples: Any, count: int) -> list[Any]:
    """A report's ``step_samples`` for its ``count`` measured steps (``None``: unknown, a full step)."""
    known = list(samples) if isinstance(samples, list) else []
    return [*known[:count], *([None] * (count - len(known)))]


def _max_numbers(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, vb in b.items():
        va = a.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out[key] = _max_numbers(va, vb)
        elif isinstance(va, (int, float)) and isinstance(vb, (int, float)) and not isinstance(va, bool):
            out[key] = max(va, vb)
        elif va is None:
            out[key] = vb
    return out


def _memory(rep: RankReport | None) -> dict[str, Any]:
    """A rank's memory figures as its report's JSON object (empty without a report or figures)."""
    return rep.memory.to_dict() if rep is not None and rep.memory is not None else {}


def merge_outcomes(first: TrialOutcome, second: TrialOutcome, *, reason: str) -> TrialOutcome:
    """One outcome from a trial measured twice (see the module docstring)."""
    runs = [_slowest(first), _slowest(second)]
    if second.status != Status.OK:
        merged = copy.copy(second)
        merged.reason = f"re-measured ({reason}); the second run: {second.reason}"
        return merged
    reports: dict[int, RankReport] = {}
    for rank, rep in first.reports.items():
        other = second.reports.get(rank)
        own, theirs = list(rep.step_times_s or []), list((other.step_times_s if other else None) or [])
        times = [*own, *theirs]
        other_samples = other.step_samples if other else None
        samples = [*_padded(rep.step_samples, len(own)), *_padded(other_samples, len(theirs))]
        timed, per_step = _timed(times, samples, rep)
        memory = _max_numbers(_memory(rep), _memory(other))
        step_samples, partial_steps = rep.step_samples, rep.partial_steps
        if rep.step_samples is not None or other_samples is not None:
            global_batch = _global_batch(rep)
            step_samples = [global_batch if n is None else n for n in samples]
            partial_steps = sum(1 for n in samples if n is not None and isinstance(global_batch, int)
                                and n < global_batch)
        # the median of the steps both runs' step times stand for (their full steps when any was measured)
        step_time = statistics.median(timed) if timed else rep.step_time_s
        per_step = per_step or rep.samples_per_step or _global_batch(rep)
        reports[rank] = dataclasses.replace(
            rep, memory=RankMemory.from_dict(memory), step_times_s=times, measured_steps=len(times),
            step_samples=step_samples, partial_steps=partial_steps, step_time_s=step_time,
            step_time_iqr_s=_iqr(timed), samples_per_step=per_step,
            samples_per_s=(per_step / step_time) if per_step and step_time else None,
        )
    merged = copy.copy(first)
    merged.reports = reports
    merged.wall_s = first.wall_s + second.wall_s
    merged.pool_start_s = first.pool_start_s + second.pool_start_s
    merged.recycled = second.recycled or first.recycled
    merged.remeasured = {"reason": reason, "step_time_s": runs, "wall_s": second.wall_s}
    return merged


def _slowest(outcome: TrialOutcome) -> float | None:
    times = [rep.step_time_s for rep in outcome.reports.values()]
    return max(float(t) for t in times if t is not None) if times and all(t is not None for t in times) else None
