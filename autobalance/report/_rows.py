"""A study's trials as plain rows (what the report draws), the Pareto front and the summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autobalance.protocol import Status, StudyAttr, TrialAttr, best_trial

__all__ = ["StudySummary", "TrialRow", "pareto_front", "summarize"]


@dataclass(kw_only=True)
class TrialRow:
    number: int
    state: str
    status: str
    baseline: bool
    feasible: bool
    config: dict[str, Any] | None
    params: dict[str, Any]
    peaks_gib: list[float | None]
    capacity_gib: list[float | None]
    usable_gib: list[float | None]
    spread_gib: float | None
    spread_pct: float | None
    step_ms: float | None
    values: list[float] | None
    reason: str | None = None
    reused_from: int | None = None

    @property
    def label(self) -> str:
        return f"#{self.number}" + (" (baseline)" if self.baseline else "")

    @property
    def measured(self) -> bool:
        return self.status == Status.OK and self.spread_gib is not None and self.step_ms is not None

    @property
    def failed_memory(self) -> bool:
        """OOM, predicted OOM, or over the usable limit (infeasible by the memory constraint)."""
        return self.status in (Status.OOM, Status.PREDICTED_OOM) or (self.status == Status.OK and not self.feasible)


@dataclass(kw_only=True)
class StudySummary:
    name: str
    rows: list[TrialRow]
    baseline: TrialRow | None
    best: TrialRow | None
    directions: list[str]
    metric_names: list[str] | None
    objective: dict[str, Any] = field(default_factory=dict)
    device: dict[str, Any] = field(default_factory=dict)


def _floats(value: Any) -> list[float | None]:
    if not isinstance(value, list):
        return []
    return [None if v is None else float(v) for v in value]


def _row(trial: Any) -> TrialRow:
    a = trial.user_attrs
    return TrialRow(
        number=trial.number, state=trial.state.name, status=str(a.get(TrialAttr.STATUS) or trial.state.name.lower()),
        baseline=bool(a.get(TrialAttr.BASELINE, False)), feasible=bool(a.get(TrialAttr.FEASIBLE, False)), config=a.get(TrialAttr.CONFIG),
        params=dict(trial.params), peaks_gib=_floats(a.get(TrialAttr.PEAK_DEVICE_GIB)),
        capacity_gib=_floats(a.get("capacity_gib")), usable_gib=_floats(a.get(TrialAttr.USABLE_GIB)),
        spread_gib=a.get(TrialAttr.SPREAD_GIB), spread_pct=a.get("spread_pct_of_capacity"), step_ms=a.get(TrialAttr.STEP_TIME_MS),
        values=list(trial.values) if trial.values is not None else None, reason=a.get(TrialAttr.REASON),
        reused_from=a.get(TrialAttr.REUSED_FROM),
    )


def pareto_front(rows: list[TrialRow]) -> list[TrialRow]:
    """Measured feasible trials no other such trial beats on both spread and step time, by spread."""
    points = [r for r in rows if r.measured and r.feasible]
    front = [
        r for r in points
        if not any(
            (o.spread_gib <= r.spread_gib and o.step_ms <= r.step_ms)  # type: ignore[operator]
            and (o.spread_gib < r.spread_gib or o.step_ms < r.step_ms)  # type: ignore[operator]
            for o in points
        )
    ]
    return sorted(front, key=lambda r: (r.spread_gib, r.step_ms))


def summarize(study: Any) -> StudySummary:
    rows = [_row(t) for t in study.get_trials(deepcopy=False)]
    by_number = {r.number: r for r in rows}
    base_no = study.user_attrs.get(StudyAttr.BASELINE)
    baseline = by_number.get(base_no) if base_no is not None else next((r for r in rows if r.baseline), None)
    best = best_trial(study)
    try:
        names = study.metric_names
    except Exception:
        names = None
    return StudySummary(
        name=study.study_name, rows=rows, baseline=baseline,
        best=by_number.get(best.number) if best is not None else None,
        directions=[d.name.lower() for d in study.directions], metric_names=names,
        objective=dict(study.user_attrs.get(StudyAttr.OBJECTIVE) or {}),
        device=dict(study.user_attrs.get(StudyAttr.DEVICE) or {}),
    )
