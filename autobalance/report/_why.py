"""Why the chosen trial won: the sentences the report's "Why this one" paragraph and the best
trial's dashboard note are made of (trials that were faster but excluded, headroom, verification)."""

from __future__ import annotations

from autobalance.protocol import Status, memory_pair, memory_text
from autobalance.report._rows import StudySummary, TrialRow

__all__ = ["excluded_reason", "why_this_one"]

_LISTED = 5


def excluded_reason(row: TrialRow, summary: StudySummary) -> str:
    """Why a measured trial faster than the chosen one did not win."""
    over = [(p - u, r, p, u) for r, (p, u) in enumerate(zip(row.peaks_gib, row.usable_gib, strict=False))
            if p is not None and u is not None and p > u]
    if over:
        _, rank, peak, usable = max(over)
        cap = row.capacity_gib[rank] if rank < len(row.capacity_gib) else None
        where = f" on rank {rank}" if summary.multi_rank else ""
        peak_text, usable_text = memory_pair(peak, usable)
        text = f"peaked at {peak_text}{where}, over the usable {usable_text}"
        if cap is not None and peak > cap:
            text += f" (over the {memory_text(cap)} cap itself)"
        return text
    limit = summary.objective.get("max_spread_gib")
    if not row.feasible and limit is not None and row.spread_gib is not None and row.spread_gib > float(limit):
        return f"spread {memory_text(row.spread_gib)} is over --max-spread-gib {float(limit):g}"
    if not row.feasible:
        return row.reason or "infeasible"
    if summary.multi_rank and row.spread_gib is not None:
        return (f"fits, but its spread ({memory_text(row.spread_gib)}) costs more in the objective than its step time "
                "gains")
    return "fits, but scores worse on the objective"


def why_this_one(summary: StudySummary, *, script: str = "SCRIPT") -> list[str]:
    """Plain sentences: what won and by which rule, its headroom, the faster trials it beat and why,
    the trials that could not be compared, and the verification verdict."""
    best = summary.best
    rows = [r for r in summary.rows if r.reused_from is None]
    oom = [r for r in rows if r.status == Status.OOM]
    predicted = [r for r in rows if r.predicted]
    other_fail = [r for r in rows if r.status not in (Status.OK, Status.OOM, Status.PREDICTED_OOM) and not r.predicted]
    over = [r for r in rows if r.status == Status.OK and not r.feasible]
    if best is None:
        parts = [f"No configuration fits yet: of {len(rows)} trial(s), {len(over)} ran but went over the usable "
                 f"limit, {len(oom)} ran out of memory, {len(predicted)} were predicted to run out and {len(other_fail)} "
                 "failed otherwise."]
        if over:
            closest = min(over, key=lambda r: (r.peak_gib or 0.0))
            parts.append(f"The closest, {closest.label}, {excluded_reason(closest, summary)}. Raise --memory-cap-gib, "
                         "lower --headroom or run more trials.")
        if summary.multi_rank and summary.exchange_rate:
            parts.append(summary.exchange_rate)
        return parts
    fits = [r for r in rows if r.feasible and r.measured]
    obj = summary.objective
    if len(summary.directions) > 1:
        rule = ("the lowest weighted sum of spread and step time "
                f"({obj.get('weight_spread', 1.0):g} x spread + {obj.get('weight_time', 1.0):g} x step time) on the "
                "Pareto front")
    elif summary.multi_rank:
        rule = (f"the lowest objective ({obj.get('weight_spread', 1.0):g} x spread as a fraction of capacity + "
                f"{obj.get('weight_time', 1.0):g} x step time / the reference step)")
    else:
        rule = "the shortest step time"
    parts = [f"Trial {best.label} won: {rule} among the {len(fits)} measured trial(s) that fit in the usable memory"
             + (f"; step {best.step_ms:.1f} ms" if best.step_ms is not None else "") + "."]
    if summary.multi_rank and summary.exchange_rate:
        parts.append(summary.exchange_rate)
    slack = [(u - p, r, p, u) for r, (p, u) in enumerate(zip(best.peaks_gib, best.usable_gib, strict=False))
             if p is not None and u is not None]
    if slack:
        left, rank, peak, usable = min(slack)
        cap = best.capacity_gib[rank] if rank < len(best.capacity_gib) else None
        where = f" on rank {rank}" if summary.multi_rank else ""
        headroom = obj.get("headroom")
        limit_text = f"usable {memory_text(usable)}" + (
            f" = the {memory_text(cap)} cap minus {100 * float(headroom):.0f}% headroom" if cap is not None and headroom else "")
        parts.append(f"Headroom: its highest peak is {memory_text(peak)}{where}, {memory_text(left)} ({100 * left / usable:.1f}%) "
                     f"under the {limit_text}.")
    faster = sorted((r for r in rows if r.step_ms is not None and best.step_ms is not None and r.step_ms < best.step_ms
                     and r.number != best.number), key=lambda r: float(r.step_ms))  # type: ignore[arg-type]
    if faster:
        listed = "; ".join(f"{r.label} ({r.step_ms:.1f} ms) {excluded_reason(r, summary)}" for r in faster[:_LISTED])
        more = f"; and {len(faster) - _LISTED} more" if len(faster) > _LISTED else ""
        parts.append(f"Faster trials excluded: {listed}{more}.")
    else:
        parts.append("No measured trial was faster.")
    unknown = []
    if oom:
        unknown.append(f"{len(oom)} ran out of memory ("
                       + ", ".join(r.label.split()[0] + (f" rank {r.failing_rank}" if r.failing_rank is not None
                                                         and summary.multi_rank else "") for r in oom[:_LISTED])
                       + (", ..." if len(oom) > _LISTED else "") + ")")
    if predicted:
        unknown.append(f"{len(predicted)} {'was' if len(predicted) == 1 else 'were'} predicted to run out and never run ("
                       + ", ".join(r.label for r in predicted[:_LISTED]) + (", ..." if len(predicted) > _LISTED else "")
                       + ")")
    if other_fail:
        unknown.append(f"{len(other_fail)} failed otherwise ("
                       + ", ".join(f"{r.label} {r.status}" for r in other_fail[:_LISTED]) + ")")
    if unknown:
        parts.append("Without a step time: " + "; ".join(unknown) + ".")
    verdict = summary.verify.get(best.number)
    if verdict is None:
        parts.append(f"Not verified yet: autobalance verify {script} --study-name {summary.name} --trial {best.number}.")
    elif verdict.get("passed"):
        parts.append(f"Verified: {verdict.get('reason', 'passed')}.")
    else:
        parts.append(f"Verification FAILED: {verdict.get('reason', '?')}; a configuration that fails is never saved.")
    return parts
