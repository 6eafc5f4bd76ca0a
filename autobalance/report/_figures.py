"""The report's plotly figures: per-rank peak memory per trial, step time versus spread, importances."""

from __future__ import annotations

from typing import Any

from autobalance.protocol import Status
from autobalance.report._rows import StudySummary, TrialRow, pareto_front

__all__ = ["importance_figure", "memory_figure", "rank_colors", "tradeoff_figure"]

_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
BAD = "#d62728"


def rank_colors(n: int) -> list[str]:
    return [_PALETTE[i % len(_PALETTE)] for i in range(n)]


def _describe(row: TrialRow) -> str:
    from autobalance.tuner import describe_config

    return describe_config(row.config) if row.config else "-"


def _max(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def memory_figure(summary: StudySummary) -> Any:
    """Grouped bars: one group per trial, one bar per rank; capacity and usable lines; OOM marked."""
    import plotly.graph_objects as go

    rows = [r for r in summary.rows if any(p is not None for p in r.peaks_gib) or r.failed_memory]
    ranks = max((len(r.peaks_gib) for r in rows), default=0)
    labels = [r.label for r in rows]
    fig = go.Figure()
    for rank, color in zip(range(ranks), rank_colors(ranks), strict=True):
        y = [r.peaks_gib[rank] if rank < len(r.peaks_gib) else None for r in rows]
        fig.add_trace(go.Bar(
            x=labels, y=y, name=f"rank {rank}", marker_color=color,
            marker_pattern_shape=["x" if r.failed_memory else "" for r in rows],
            customdata=[[r.status, _describe(r)] for r in rows],
            hovertemplate=f"rank {rank}: %{{y:.4f}} GiB<br>%{{x}} %{{customdata[0]}}<br>%{{customdata[1]}}<extra></extra>",
        ))
    top = _max([_max(r.peaks_gib) for r in rows]) or 1.0
    caps = [_max(r.capacity_gib) for r in rows]
    usable = [_max(r.usable_gib) for r in rows]
    cap_top = _max(caps)
    off_scale = cap_top is not None and cap_top > 3 * top
    for name, series, dash in (("capacity", caps, "solid"), ("usable (capacity - headroom)", usable, "dash")):
        if any(v is not None for v in series):
            fig.add_trace(go.Scatter(
                x=labels, y=series, name=name, mode="lines", line={"color": "#333333", "dash": dash, "shape": "hvh"},
                hovertemplate=f"{name}: %{{y:.4f}} GiB<extra></extra>", visible="legendonly" if off_scale else True,
            ))
    bad = [r for r in rows if r.failed_memory or r.status in (Status.TIMEOUT, Status.ERROR, Status.CRASH)]
    if bad:
        fig.add_trace(go.Scatter(
            x=[r.label for r in bad], y=[(_max(r.peaks_gib) or 0.0) + 0.06 * top for r in bad],
            mode="markers+text", name="OOM / infeasible", marker={"symbol": "x", "size": 12, "color": BAD},
            text=[("infeasible" if r.status == Status.OK else r.status.upper()) for r in bad], textposition="top center",
            textfont={"color": BAD}, customdata=[r.reason or "" for r in bad],
            hovertemplate="%{x}: %{text}<br>%{customdata}<extra></extra>",
        ))
    title = "Peak device memory per rank, per trial"
    if off_scale and cap_top is not None:
        title += f" (capacity {cap_top:.3g} GiB is off scale; toggle it in the legend)"
    fig.update_layout(
        title=title, barmode="group", xaxis_title="trial", yaxis_title="GiB", legend_title="",
        template="plotly_white", height=460, margin={"t": 60, "l": 60, "r": 20, "b": 60},
    )
    if off_scale:
        fig.update_yaxes(range=[0, top * 1.3])
    return fig


def tradeoff_figure(summary: StudySummary) -> Any:
    """Step time versus spread of measured trials, the Pareto front, the chosen and the baseline."""
    import plotly.graph_objects as go

    measured = [r for r in summary.rows if r.measured]
    fig = go.Figure()
    for name, subset, color in (("feasible", [r for r in measured if r.feasible], "#1f77b4"),
                                ("over the memory limit", [r for r in measured if not r.feasible], BAD)):
        if subset:
            fig.add_trace(go.Scatter(
                x=[r.spread_gib for r in subset], y=[r.step_ms for r in subset], mode="markers", name=name,
                marker={"size": 9, "color": color, "opacity": 0.8}, text=[r.label for r in subset],
                customdata=[_describe(r) for r in subset],
                hovertemplate="%{text}<br>spread %{x:.4f} GiB, step %{y:.1f} ms<br>%{customdata}<extra></extra>",
            ))
    front = pareto_front(summary.rows)
    if front:
        fig.add_trace(go.Scatter(
            x=[r.spread_gib for r in front], y=[r.step_ms for r in front], mode="lines+markers", name="Pareto front",
            line={"color": "#2ca02c", "shape": "hv"}, marker={"size": 11, "color": "#2ca02c", "symbol": "circle-open"},
            text=[r.label for r in front], hovertemplate="Pareto: %{text}<extra></extra>",
        ))
    if summary.baseline is not None and summary.baseline.measured:
        b = summary.baseline
        fig.add_trace(go.Scatter(
            x=[b.spread_gib], y=[b.step_ms], mode="markers+text", name="baseline (script's own)",
            marker={"size": 14, "color": "#7f7f7f", "symbol": "diamond"}, text=["baseline"],
            textposition="bottom center", hovertemplate=f"baseline {b.label}<extra></extra>",
        ))
    if summary.best is not None and summary.best.measured:
        b = summary.best
        fig.add_trace(go.Scatter(
            x=[b.spread_gib], y=[b.step_ms], mode="markers+text", name=f"chosen {b.label}",
            marker={"size": 20, "color": "#ffbf00", "symbol": "star", "line": {"color": "#000000", "width": 1}},
            text=[f"chosen {b.label}"], textposition="top center",
            hovertemplate=f"chosen {b.label}<br>{_describe(b)}<extra></extra>",
        ))
    fig.update_layout(
        title="Step time versus spread of peak memory across ranks (lower-left is better)",
        xaxis_title="spread of peaks across ranks (GiB)", yaxis_title="step time (ms)", template="plotly_white",
        height=460, margin={"t": 60, "l": 60, "r": 20, "b": 60},
    )
    return fig


def importance_figure(importances: dict[str, float]) -> Any:
    import plotly.graph_objects as go

    items = sorted(importances.items(), key=lambda kv: kv[1])
    fig = go.Figure(go.Bar(x=[v for _, v in items], y=[k for k, _ in items], orientation="h",
                           marker_color="#1f77b4", hovertemplate="%{y}: %{x:.3f}<extra></extra>"))
    fig.update_layout(title="Parameter importances for the objective", xaxis_title="importance",
                      template="plotly_white", height=max(240, 60 + 36 * len(items)),
                      margin={"t": 60, "l": 160, "r": 20, "b": 50})
    return fig
