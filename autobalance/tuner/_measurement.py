"""How each trial was measured, as trial attributes and as lines of the study summary.

- the compiling step apart from the steady state: ``compile_peak_gib`` and ``steady_peak_gib`` per
  rank (a compiled trial's peak device memory in its first, compiling, step and in the steps
  after); the memory constraint judges ``peak_device_gib``, the larger of the two;
- the steps' spread: ``step_time_iqr_pct`` (the worst rank's interquartile range of its measured
  steps, % of its median) next to ``measured_steps``; ``remeasured`` for a trial measured twice;
- a warm trial's carry-over (see :mod:`autobalance.runtime._carryover`): ``warm_pool_trial`` (its
  place in its worker's life, 1 = a fresh worker), ``warm_fresh_outside_gib`` (what a fresh worker
  held outside PyTorch, per rank), ``warm_inherited_outside_gib`` (what this trial's worker held
  over its reference when the trial started: charged to the trial, never discounted) and
  ``warm_recycled`` (why the pool was restarted after it).
"""

from __future__ import annotations

import statistics
from typing import Any

from autobalance.launcher import TrialOutcome
from autobalance.protocol import RankMemory, TrialAttr, memory_text, timed_steps

__all__ = ["STEP_TIMES_MS", "measurement_attrs", "measurement_summary", "rank_steps"]

GIB = 2**30
STEP_TIMES_MS = "step_times_ms"
"""Trial attribute: each rank's measured steps that its step time stands for (``protocol.timed_steps``),
in ms; a trial measured twice holds both runs' steps."""


def rank_steps(rep: Any) -> list[float]:
    """A rank report's timed steps in seconds (the full steps when any was measured)."""
    config = rep.config or {}
    batch = config.get("global_batch")
    times, _ = timed_steps([float(t) for t in rep.step_times_s or []], rep.step_samples,
                           batch if isinstance(batch, int) else None)
    return times


def _gib(value: Any) -> float | None:
    return None if value is None else round(float(value) / GIB, 4)


def measurement_attrs(outcome: TrialOutcome, *, world_size: int) -> dict[str, Any]:
    reports = [outcome.reports.get(r) for r in range(world_size)]
    memory = [rep.memory if rep is not None and rep.memory is not None else RankMemory() for rep in reports]
    attrs: dict[str, Any] = {}
    first = [(mem.compile_step or {}).get("peak_device") for mem in memory]
    steady = [(mem.steady or {}).get("peak_device") for mem in memory]
    if any(v is not None for v in first):
        attrs["compile_peak_gib"] = [_gib(v) for v in first]
        attrs["steady_peak_gib"] = [_gib(v) for v in steady]
    spreads = []
    for rep in reports:
        if rep is None:
            continue
        iqr, times = rep.step_time_iqr_s, rep.step_times_s or []
        if iqr is not None and times:
            median = statistics.median(float(t) for t in times)
            if median > 0:
                spreads.append(100 * float(iqr) / median)
    if spreads and len(spreads) == world_size:
        attrs["step_time_iqr_pct"] = round(max(spreads), 2)
    steps = [rank_steps(rep) if rep is not None else [] for rep in reports]
    if any(steps):  # each rank's timed steps: what the leaders' re-measure pools (tuner/_remeasure.py)
        attrs[STEP_TIMES_MS] = [[round(1000 * t, 3) for t in times] for times in steps]
    if outcome.remeasured:
        attrs["remeasured"] = {"reason": outcome.remeasured.get("reason"),
                               "step_time_ms": [None if t is None else round(1000 * t, 3)
                                                for t in outcome.remeasured.get("step_time_s") or []]}
    warm = [rep.warm if rep is not None else None for rep in reports]
    if any(warm):
        attrs["warm_pool_trial"] = max(int(w.get("pool_trial") or 0) for w in warm if w)
        attrs["warm_fresh_outside_gib"] = [_gib((w or {}).get("fresh_outside")) for w in warm]
        attrs["warm_inherited_outside_gib"] = [_gib((w or {}).get("inherited_outside")) for w in warm]
        if outcome.recycled:
            attrs[TrialAttr.WARM_RECYCLED] = outcome.recycled
    return attrs


def measurement_summary(attrs: list[dict[str, Any]]) -> list[str]:
    """Lines for the study summary from the launched trials' attributes (empty when none apply)."""
    lines: list[str] = []
    warm = [a for a in attrs if a.get("warm_pool_trial")]
    if warm:
        fresh = [g for a in warm for g in (a.get("warm_fresh_outside_gib") or []) if g is not None]
        inherited = [g for a in warm for g in (a.get("warm_inherited_outside_gib") or []) if g is not None]
        recycled = [a[TrialAttr.WARM_RECYCLED] for a in warm if a.get(TrialAttr.WARM_RECYCLED)]
        text = (f"Warm trials ({len(warm)}): each trial's memory was measured in its own worker, nothing discounted; "
                "the allocator was emptied between trials")
        if fresh:
            text += f"; a fresh worker held {memory_text(min(fresh))}-{memory_text(max(fresh))} outside PyTorch"
        if inherited:
            text += f"; a trial inherited at most {memory_text(max(inherited))} over it (charged to it)"
        text += (f"; workers recycled after {len(recycled)} trial(s) (first: {recycled[0]})." if recycled
                 else "; no worker needed recycling.")
        lines.append(text)
    compiled = [a for a in attrs if a.get("compile_peak_gib")]
    if compiled:
        higher = sum(1 for a in compiled
                     if max(v or 0 for v in a["compile_peak_gib"]) > max(v or 0 for v in a.get("steady_peak_gib") or [0]))
        lines.append(f"Compiled trials ({len(compiled)}): the compiling step's peak and the steady peak both "
                     f"judged (the larger counts); the compiling step was the higher in {higher}.")
    again = [a for a in attrs if a.get("remeasured")]
    spreads = [a["step_time_iqr_pct"] for a in attrs if a.get("step_time_iqr_pct") is not None]
    if spreads:
        lines.append(f"Step times: spread (IQR) of measured steps {min(spreads):.1f}-{max(spreads):.1f} % of the "
                     f"median; {len(again)} trial(s) measured twice (high spread, or about to become the best).")
    return lines
