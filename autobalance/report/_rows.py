"""A study's trials as plain rows (what the report draws), the Pareto front and the summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autobalance.protocol import Status, TrialAttr, time_in_steps_s

__all__ = ["StudySummary", "TrialRow", "outcome_label", "pareto_front", "summarize"]


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
    failing_rank: int | None = None
    compile_s: float | None = None
    """Slowest rank's first (compiling) step, seconds; None for eager trials."""
    time_in_steps_s: float | None = None
    """Seconds the slowest rank spent in warm-up and measured steps (the trial attribute ``time_in_steps_s``;
    ``steps_s`` in studies stored before)."""
    compile_cache_hit: bool | None = None
    """Inductor FX graph cache: True when every graph came from the cache, False on a miss."""
    predicted: bool = False
    """Never launched: judged out of memory from the memory model or a dominating trial."""
    step_iqr_pct: float | None = None
    """How much the measured steps spread: the worst rank's IQR, % of its median (``step_time_iqr_pct``)."""
    busy_ms: list[float | None] = field(default_factory=list)
    """Each rank's busy ms per step (its own work, ``TrialAttr.BUSY_MS``); empty in studies from before."""
    wait_ms: list[float | None] = field(default_factory=list)
    """Each rank's wait at the gradient all-reduce, ms per step (``TrialAttr.WAIT_MS``)."""
    optimizer_state_gib: list[float | None] = field(default_factory=list)
    """Each rank's optimizer state (``TrialAttr.OPTIMIZER_STATE_BYTES``; zero1: its share); empty in studies from before."""

    @property
    def label(self) -> str:
        return f"#{self.number}" + (" (baseline)" if self.baseline else "")

    @property
    def ranks(self) -> int:
        return len(self.peaks_gib)

    @property
    def peak_gib(self) -> float | None:
        """The highest rank's peak (a lower bound for an OOM, a prediction for a predicted trial)."""
        known = [p for p in self.peaks_gib if p is not None]
        return max(known) if known else None

    @property
    def worst_rank(self) -> int | None:
        """The rank closest to (or furthest over) its usable limit."""
        ratios = [(p / u, r) for r, (p, u) in enumerate(zip(self.peaks_gib, self.usable_gib, strict=False))
                  if p is not None and u]
        return max(ratios)[1] if ratios else None

    @property
    def optimizer_sharding(self) -> str:
        return str(self.config_value("optimizer_sharding") or "off")

    @property
    def samples_per_rank(self) -> list[int | None]:
        """Each rank's samples per optimizer step (empty without a readable configuration)."""
        from autobalance._config import BalanceConfig
        from autobalance._errors import ConfigError

        try:
            return list(BalanceConfig.from_dict(self.config).samples_per_rank) if self.config else []
        except (ConfigError, KeyError, TypeError, ValueError):
            return []

    @property
    def outcome(self) -> str:
        """A few words that tell the trial apart at a glance (see :func:`outcome_label`)."""
        many = self.ranks > 1
        return outcome_label(status=self.status, feasible=self.feasible,
                             failing_rank=self.failing_rank if many else None, worst_rank=self.worst_rank if many else None,
                             predicted=self.predicted, reused_from=self.reused_from)

    def config_value(self, key: str) -> Any:
        return (self.config or {}).get(key)

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
    verify: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Verification verdicts by trial number (``autobalance verify``, the end of ``tune``, ``promote``)."""
    compile_total_s: float | None = None
    storage_url: str | None = None
    """Masked storage URL (for the commands the report suggests), when known."""
    script: str | None = None
    """The training script of the study's latest ``tune``, when recorded."""
    exchange_rate: str | None = None
    """The objective's trade between spread and step time in one sentence (``protocol.exchange_rate_text``;
    None while no reference step is fixed)."""

    @property
    def world_size(self) -> int:
        ws = self.objective.get("world_size")
        return int(ws) if ws else max((r.ranks for r in self.rows), default=1)

    @property
    def multi_rank(self) -> bool:
        """Spread (max - min over ranks) means something only with two ranks or more."""
        return self.world_size > 1


def outcome_label(*, status: str, feasible: bool, failing_rank: int | None = None, worst_rank: int | None = None,
                  predicted: bool = False, reused_from: int | None = None) -> str:
    """``ok``, ``over limit (rank 0)``, ``OOM (rank 1)``, ``predicted OOM``, ``timeout``, ...: what
    happened to a trial in a few words (the dashboard's ``outcome`` attribute and the report's tables)."""
    if predicted or status == Status.PREDICTED_OOM:
        return "predicted OOM (not run)"
    where = f" (rank {failing_rank})" if failing_rank is not None else ""
    if status == Status.OK:
        text = "ok" if feasible else "over limit" + (f" (rank {worst_rank})" if worst_rank is not None else "")
    elif status == Status.OOM:
        text = "OOM" + where
    else:
        text = status + where
    return text + (f", as #{reused_from}" if reused_from is not None else "")


def _floats(value: Any) -> list[float | None]:
    if not isinstance(value, list):
        return []
    return [None if v is None else float(v) for v in value]


def _row(trial: Any) -> TrialRow:
    a = trial.user_attrs
    return TrialRow(
        number=trial.number, state=trial.state.name, status=str(a.get(TrialAttr.STATUS) or trial.state.name.lower()),
        baseline=bool(a.get(TrialAttr.BASELINE, False)), feasible=bool(a.get(TrialAttr.FEASIBLE, False)),
        config=a.get(TrialAttr.CONFIG), params=dict(trial.params), peaks_gib=_floats(a.get(TrialAttr.PEAK_DEVICE_GIB)),
        capacity_gib=_floats(a.get(TrialAttr.CAPACITY_GIB)), usable_gib=_floats(a.get(TrialAttr.USABLE_GIB)),
        spread_gib=a.get(TrialAttr.SPREAD_GIB), spread_pct=a.get(TrialAttr.SPREAD_PCT),
        step_ms=a.get(TrialAttr.STEP_TIME_MS),
        values=list(trial.values) if trial.values is not None else None, reason=a.get(TrialAttr.REASON),
        reused_from=a.get(TrialAttr.REUSED_FROM), failing_rank=a.get(TrialAttr.FAILING_RANK),
        compile_s=None if a.get(TrialAttr.COMPILE_S) is None else float(a[TrialAttr.COMPILE_S]),
        time_in_steps_s=time_in_steps_s(a),
        compile_cache_hit=_cache_hit(a.get(TrialAttr.COMPILE_CACHE)),
        predicted=bool(a.get(TrialAttr.PREDICTED)) or a.get(TrialAttr.STATUS) == Status.PREDICTED_OOM,
        step_iqr_pct=a.get(TrialAttr.STEP_IQR_PCT),
        busy_ms=_floats(a.get(TrialAttr.BUSY_MS)), wait_ms=_floats(a.get(TrialAttr.WAIT_MS)),
        optimizer_state_gib=[None if v is None else v / 2**30 for v in _floats(a.get(TrialAttr.OPTIMIZER_STATE_BYTES))],
    )


def _cache_hit(cache: Any) -> bool | None:
    if not isinstance(cache, dict) or not (cache.get("fx_graph_hits") or cache.get("fx_graph_misses")):
        return None
    return not cache.get("fx_graph_misses")


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


def summarize(study: Any, *, storage_url: str | None = None) -> StudySummary:
    from autobalance.protocol import StudyAttr, best_trial, exchange_rate_text

    prefix = StudyAttr.VERIFY_PREFIX

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
        verify={int(k[len(prefix):]): v for k, v in study.user_attrs.items()
                if k.startswith(prefix) and k[len(prefix):].isdigit() and isinstance(v, dict)},
        compile_total_s=study.user_attrs.get(StudyAttr.COMPILE_TOTAL), storage_url=storage_url,
        script=(study.user_attrs.get(StudyAttr.LAUNCH) or {}).get("script"),
        exchange_rate=exchange_rate_text(study.user_attrs),
    )
