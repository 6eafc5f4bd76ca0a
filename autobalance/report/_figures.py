"""The report's plotly figures: per-rank peak memory per trial, step time versus peak memory and
versus spread, what dtype / compile / budget / micro-batch did to step time, compile cost,
importances."""

from __future__ import annotations

from typing import Any

from autobalance.protocol import FAILED_STATUSES, Status, memory_text
from autobalance.report._rows import StudySummary, TrialRow, pareto_front

__all__ = ["compile_figure", "factor_values", "factors_figure", "importance_figure", "memory_figure", "memory_unit", "param_words", "rank_colors",
           "time_memory_figure", "tradeoff_figure"]

_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
BAD = "#d62728"


def rank_colors(n: int) -> list[str]:
    return [_PALETTE[i % len(_PALETTE)] for i in range(n)]


def _describe(row: TrialRow) -> str:
    from autobalance._config import describe_config

    return describe_config(row.config) if row.config else "-"


def _max(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


_PER_GIB = {"GiB": 1.0, "MiB": 1024.0, "KiB": 1024.0**2, "B": 1024.0**3}


def memory_unit(gib: float | None) -> tuple[str, float]:
    """The unit the report's text writes a size of ``gib`` in (:func:`~autobalance.protocol.memory_text`:
    ``GiB``, ``MiB``, ``KiB``), and the factor from GiB to it: a chart's axis reads in the unit its
    text does (the demo's peaks in MiB, not 0.004-0.014 GiB)."""
    name = memory_text(gib or 1.0).split()[-1]
    return name, _PER_GIB[name]


def _scaled(values: list[float | None], factor: float) -> list[float | None]:
    return [None if v is None else v * factor for v in values]


PARAM_WORDS = {"accumulation": "accumulation steps", "compile": "torch.compile", "compile_scope": "compile scope",
               "dtype": "dtype (AMP)", "bucket_cap_mb": "DDP bucket size (MB)", "grad_as_bucket_view": "gradient_as_bucket_view",
               "optimizer_sharding": "optimizer sharding (ZeRO-1)"}
_PER_RANK_WORDS = {"share_r": "rank {}'s share of the batch", "oshare_r": "rank {}'s share of the optimizer state",
                   "ckpt_r": "rank {}'s checkpointed blocks", "budget_r": "rank {}'s compile memory budget"}


def param_words(name: str) -> str:
    """A search parameter's name in words for the report (``oshare_r0`` -> ``rank 0's share of the
    optimizer state``); a name it does not know stays as it is."""
    if name in PARAM_WORDS:
        return PARAM_WORDS[name]
    for prefix, words in _PER_RANK_WORDS.items():
        rank = name.removeprefix(prefix)
        if rank != name and rank.isdigit():
            return words.format(rank)
    return name


def _mark(row: TrialRow) -> str:
    if row.predicted:
        return "predicted OOM"
    if row.status == Status.OK:
        return "over limit"
    return row.status.upper()


def memory_figure(summary: StudySummary) -> Any:
    """Grouped bars: one group per trial, one bar per rank that has a peak (a rank without one, e.g.
    killed before its report, has no bar, not an empty one); capacity and usable lines; OOM marked."""
    import plotly.graph_objects as go

    rows = [r for r in summary.rows if any(p is not None for p in r.peaks_gib) or r.failed_memory]
    ranks = max((len(r.peaks_gib) for r in rows), default=0)
    labels = [r.label for r in rows]
    unit, k = memory_unit(_max([_max(r.peaks_gib) for r in rows]))
    fig = go.Figure()
    for rank, color in zip(range(ranks), rank_colors(ranks), strict=True):
        have = [r for r in rows if rank < len(r.peaks_gib) and r.peaks_gib[rank] is not None]
        fig.add_trace(go.Bar(
            x=[r.label for r in have], y=_scaled([r.peaks_gib[rank] for r in have], k), name=f"rank {rank}", marker_color=color,
            marker_pattern_shape=["/" if r.predicted else ("x" if r.failed_memory else "") for r in have],
            marker_opacity=[0.35 if r.predicted else 1.0 for r in have],
            customdata=[[r.outcome + (" (a prediction, not a measurement)" if r.predicted else ""), _describe(r)]
                        for r in have],
            hovertemplate=f"rank {rank}: %{{y:.4g}} {unit}<br>%{{x}} %{{customdata[0]}}<br>%{{customdata[1]}}<extra></extra>",
        ))
    top = (_max([_max(r.peaks_gib) for r in rows]) or 1.0) * k
    caps = _scaled([_max(r.capacity_gib) for r in rows], k)
    usable = _scaled([_max(r.usable_gib) for r in rows], k)
    cap_top = _max(caps)
    off_scale = cap_top is not None and cap_top > 3 * top
    for name, series, dash in (("capacity", caps, "solid"), ("usable (capacity - headroom)", usable, "dash")):
        if any(v is not None for v in series):
            fig.add_trace(go.Scatter(
                x=labels, y=series, name=name, mode="lines", line={"color": "#333333", "dash": dash, "shape": "hvh"},
                hovertemplate=f"{name}: %{{y:.4g}} {unit}<extra></extra>", visible="legendonly" if off_scale else True,
            ))
    bad = [r for r in rows if r.failed_memory or r.status in FAILED_STATUSES]
    if bad:
        fig.add_trace(go.Scatter(
            x=[r.label for r in bad], y=[(_max(r.peaks_gib) or 0.0) * k + 0.06 * top for r in bad],
            mode="markers+text", name="OOM / over the limit / predicted", marker={"symbol": "x", "size": 12, "color": BAD},
            text=[_mark(r) for r in bad], textposition="top center",
            textfont={"color": BAD}, customdata=[r.reason or "" for r in bad],
            hovertemplate="%{x}: %{text}<br>%{customdata}<extra></extra>",
        ))
    title = "Peak device memory per rank, per trial"
    if any(r.predicted for r in rows):
        title += " (pale hatched bars: predicted, never run)"
    if off_scale and cap_top is not None:
        title += f" (capacity {memory_text(cap_top / k)} is off scale; toggle it in the legend)"
    fig.update_layout(
        title=title, barmode="group", xaxis_title="trial", yaxis_title=f"peak device memory ({unit})", legend_title="",
        xaxis={"categoryorder": "array", "categoryarray": labels},  # trial order, whichever rank has a bar
        template="plotly_white", height=460, margin={"t": 60, "l": 60, "r": 20, "b": 60},
    )
    if off_scale:
        fig.update_yaxes(range=[0, top * 1.3])
    return fig


def tradeoff_figure(summary: StudySummary) -> Any:
    """Step time versus spread of measured trials, the Pareto front, the chosen and the baseline."""
    import plotly.graph_objects as go

    measured = [r for r in summary.rows if r.measured]
    unit, k = memory_unit(_max([r.spread_gib for r in measured]))
    fig = go.Figure()
    for name, subset, color in (("feasible", [r for r in measured if r.feasible], "#1f77b4"),
                                ("over the memory limit", [r for r in measured if not r.feasible], BAD)):
        if subset:
            fig.add_trace(go.Scatter(
                x=_scaled([r.spread_gib for r in subset], k), y=[r.step_ms for r in subset], mode="markers", name=name,
                marker={"size": 9, "color": color, "opacity": 0.8}, text=[r.label for r in subset],
                customdata=[_describe(r) for r in subset],
                hovertemplate=f"%{{text}}<br>spread %{{x:.4g}} {unit}, step %{{y:.1f}} ms<br>%{{customdata}}<extra></extra>",
            ))
    # a front of spread and step time only where they are the study's two objectives; a single-objective
    # study minimised their weighted sum, and its chosen trial need not be on such a front
    front = pareto_front(summary.rows) if len(summary.directions) > 1 else []
    if front:
        fig.add_trace(go.Scatter(
            x=_scaled([r.spread_gib for r in front], k), y=[r.step_ms for r in front], mode="lines+markers", name="Pareto front",
            line={"color": "#2ca02c", "shape": "hv"}, marker={"size": 11, "color": "#2ca02c", "symbol": "circle-open"},
            text=[r.label for r in front], hovertemplate="Pareto: %{text}<extra></extra>",
        ))
    if summary.baseline is not None and summary.baseline.measured:
        b = summary.baseline
        fig.add_trace(go.Scatter(
            x=_scaled([b.spread_gib], k), y=[b.step_ms], mode="markers+text", name="baseline (script's own)",
            marker={"size": 14, "color": "#7f7f7f", "symbol": "diamond"}, text=["baseline"],
            textposition="bottom center", hovertemplate=f"baseline {b.label}<extra></extra>",
        ))
    if summary.best is not None and summary.best.measured:
        b = summary.best
        fig.add_trace(go.Scatter(
            x=_scaled([b.spread_gib], k), y=[b.step_ms], mode="markers+text", name=f"chosen {b.label}",
            marker={"size": 20, "color": "#ffbf00", "symbol": "star", "line": {"color": "#000000", "width": 1}},
            text=[f"chosen {b.label}"], textposition="top center",
            hovertemplate=f"chosen {b.label}<br>{_describe(b)}<extra></extra>",
        ))
    fig.update_layout(
        title="Step time versus spread of peak memory across ranks (lower-left is better)",
        xaxis_title=f"spread of peaks across ranks ({unit})", yaxis_title="step time (ms)", template="plotly_white",
        height=460, margin={"t": 60, "l": 60, "r": 20, "b": 60},
    )
    return fig


def importance_figure(importances: dict[str, float]) -> Any:
    import plotly.graph_objects as go

    items = sorted(importances.items(), key=lambda kv: kv[1])
    fig = go.Figure(go.Bar(x=[v for _, v in items], y=[param_words(k) for k, _ in items], orientation="h",
                           marker_color="#1f77b4", hovertemplate="%{y}: %{x:.3f}<extra></extra>"))
    fig.update_layout(title="Parameter importances for the objective", xaxis_title="importance",
                      template="plotly_white", height=max(240, 60 + 36 * len(items)),
                      margin={"t": 60, "l": 260, "r": 20, "b": 50})
    return fig


def _limits(summary: StudySummary) -> tuple[list[float | None], list[float | None]]:
    """Per rank: the capacity and the usable limit of the study (from its first trial that has them)."""
    n = summary.world_size
    for row in summary.rows:
        if len(row.capacity_gib) == n and all(v is not None for v in row.capacity_gib):
            usable = row.usable_gib if len(row.usable_gib) == n else [None] * n
            return list(row.capacity_gib), list(usable)
    return [None] * n, [None] * n


def time_memory_figure(summary: StudySummary) -> Any:
    """Step time against each rank's peak memory: one marker per rank and trial, a trial's ranks
    joined by a line (its length is the spread); the capacity and usable limit as vertical lines.
    Trials without a step time (OOM, predicted) sit in a band above, at their (lower-bound or
    predicted) peak."""
    import plotly.graph_objects as go

    n = summary.world_size
    colors = rank_colors(n)
    measured = [r for r in summary.rows if r.step_ms is not None and r.peak_gib is not None]
    unmeasured = [r for r in summary.rows if r.step_ms is None and r.peak_gib is not None and r.reused_from is None]
    top = max((float(r.step_ms) for r in measured), default=100.0)  # type: ignore[arg-type]
    band = top * 1.12
    unit, k = memory_unit(_max([p for r in [*measured, *unmeasured] for p in r.peaks_gib]))
    fig = go.Figure()
    for row in measured:  # a trial's ranks joined
        peaks = [p for p in row.peaks_gib if p is not None]
        if len(peaks) > 1:
            fig.add_trace(go.Scatter(x=[min(peaks) * k, max(peaks) * k], y=[row.step_ms, row.step_ms], mode="lines",
                                     line={"color": "#bbbbbb", "width": 1}, showlegend=False, hoverinfo="skip"))
    for rank in range(n):
        for feasible in (True, False):
            subset = [r for r in measured if r.feasible == feasible and rank < r.ranks and r.peaks_gib[rank] is not None]
            if not subset:
                continue
            name = (f"rank {rank}" if n > 1 else "peak") + ("" if feasible else " (trial over the limit)")
            fig.add_trace(go.Scatter(
                x=_scaled([r.peaks_gib[rank] for r in subset], k), y=[r.step_ms for r in subset], mode="markers", name=name,
                marker={"size": 10, "color": colors[rank], "symbol": "circle" if feasible else "x",
                        "line": {"color": BAD if not feasible else colors[rank], "width": 2}},
                text=[r.label for r in subset], customdata=[[r.outcome, _describe(r)] for r in subset],
                hovertemplate=(f"%{{text}} rank {rank}: %{{x:.4g}} {unit}, step %{{y:.1f}} ms<br>%{{customdata[0]}}"
                               "<br>%{customdata[1]}<extra></extra>"),
            ))
    for predicted in (False, True):
        subset = [r for r in unmeasured if r.predicted == predicted]
        if not subset:
            continue
        name = "predicted OOM (not run; predicted peak)" if predicted else "OOM / no step time (peak is a lower bound)"
        fig.add_trace(go.Scatter(
            x=_scaled([r.peak_gib for r in subset], k), y=[band] * len(subset), mode="markers+text", name=name,
            marker={"size": 11, "color": BAD,
                    "symbol": "triangle-up-open" if predicted else "triangle-up",
                    "line": {"color": BAD, "width": 1.5}},
            text=[r.label.split()[0] for r in subset], textposition="top center", textfont={"size": 9},
            customdata=[[r.outcome, r.reason or "", _describe(r)] for r in subset],
            hovertemplate=f"%{{text}}: %{{customdata[0]}}, peak >= %{{x:.4g}} {unit}<br>%{{customdata[1]}}<br>%{{customdata[2]}}"
                          "<extra></extra>",
        ))
    best = summary.best
    if best is not None and best.step_ms is not None and best.peak_gib is not None:
        fig.add_trace(go.Scatter(
            x=_scaled([best.peak_gib], k), y=[best.step_ms], mode="markers+text", name=f"chosen {best.label}",
            marker={"size": 20, "color": "#ffbf00", "symbol": "star", "line": {"color": "#000000", "width": 1}},
            text=[f"chosen {best.label}"], textposition="bottom center",
            hovertemplate=f"chosen {best.label}: highest rank %{{x:.4g}} {unit}, %{{y:.1f}} ms<extra></extra>",
        ))
    caps, usable = _limits(summary)
    xs = [p * k for r in [*measured, *unmeasured] for p in r.peaks_gib if p is not None]
    right = max(xs, default=1.0)
    for name, series, dash in (("capacity", caps, "solid"), ("usable", usable, "dash")):
        levels = [(r, float(v) * k) for r, v in enumerate(series) if v is not None]
        if not levels or min(v for _, v in levels) > 3 * right:
            continue  # host RAM on CPU: a far-away line would flatten the markers
        one_level = len({round(v, 4) for _, v in levels}) == 1
        for r, v in (levels[:1] if one_level else levels):
            label = f"{name} {v:.3g} {unit}" + ("" if one_level or n == 1 else f" (rank {r})")
            fig.add_vline(x=v, line={"color": "#333333" if one_level else colors[r], "dash": dash, "width": 1},
                          annotation_text=label, annotation_position="top left" if name == "usable" else "top right",
                          annotation_font_size=10)
            right = max(right, v)
    fig.update_layout(
        title="Step time versus peak memory per rank (left of the usable line and low is better)",
        xaxis_title=f"peak device memory ({unit})", yaxis_title="step time (ms)", template="plotly_white", height=480,
        margin={"t": 70, "l": 60, "r": 20, "b": 60}, legend_title="",
    )
    if unmeasured:
        fig.add_annotation(x=0, xref="paper", y=band, yref="y", text="no step time", showarrow=False, xanchor="left",
                           yanchor="bottom", font={"size": 10, "color": "#777777"})
    return fig


def factor_values(row: TrialRow) -> dict[str, Any]:
    """The settings whose effect on step time the report shows, for one trial."""
    c = row.config or {}
    budget = c.get("activation_budget")
    mode = c.get("compile", "off")
    micro = c.get("micro_batches") or []
    return {
        "dtype": c.get("dtype"),
        "compile": mode,
        "activation budget": (None if mode == "off" else ("default" if not budget else
                                                          "/".join(f"{b:g}" for b in sorted(set(budget))))),
        "micro-batch": None if not micro else "/".join(str(m) for m in micro),
        "accumulation": c.get("accumulation"),
    }


def _varying(rows: list[TrialRow]) -> list[str]:
    keys = list(factor_values(rows[0]).keys()) if rows else []
    return [k for k in keys if len({str(factor_values(r)[k]) for r in rows if factor_values(r)[k] is not None}) > 1]


def factors_figure(summary: StudySummary) -> Any | None:
    """One panel per setting that varied across measured trials: step time by its value, each trial a
    marker (blue: fits; red x: over the limit); the chosen trial starred. None when nothing varied."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    measured = [r for r in summary.rows if r.step_ms is not None and r.reused_from is None]
    keys = _varying(measured)
    if not keys:
        return None
    fig = make_subplots(rows=1, cols=len(keys), shared_yaxes=True, subplot_titles=keys, horizontal_spacing=0.04)
    for col, key in enumerate(keys, start=1):
        order = sorted({str(factor_values(r)[key]) for r in measured if factor_values(r)[key] is not None},
                       key=_natural)
        for feasible in (True, False):
            subset = [r for r in measured if r.feasible == feasible and factor_values(r)[key] is not None]
            if not subset:
                continue
            fig.add_trace(go.Scatter(
                x=[str(factor_values(r)[key]) for r in subset], y=[r.step_ms for r in subset], mode="markers",
                name="fits" if feasible else "over the limit", legendgroup="fits" if feasible else "over",
                showlegend=col == 1, marker={"size": 10, "color": "#1f77b4" if feasible else BAD,
                                             "symbol": "circle" if feasible else "x", "opacity": 0.85},
                text=[r.label for r in subset], customdata=[_describe(r) for r in subset],
                hovertemplate=f"%{{text}}: {key} %{{x}}, %{{y:.1f}} ms<br>%{{customdata}}<extra></extra>",
            ), row=1, col=col)
        fig.update_xaxes(type="category", categoryorder="array", categoryarray=order, row=1, col=col)
        best = summary.best
        if best is not None and best.step_ms is not None and factor_values(best)[key] is not None:
            fig.add_trace(go.Scatter(
                x=[str(factor_values(best)[key])], y=[best.step_ms], mode="markers", name=f"chosen {best.label}",
                legendgroup="chosen", showlegend=col == 1,
                marker={"size": 18, "color": "#ffbf00", "symbol": "star", "line": {"color": "#000000", "width": 1}},
                hovertemplate=f"chosen {best.label}<extra></extra>",
            ), row=1, col=col)
    fig.update_yaxes(title_text="step time (ms)", row=1, col=1)
    fig.update_layout(title="What each setting did to step time (measured trials)", template="plotly_white",
                      height=420, margin={"t": 80, "l": 60, "r": 20, "b": 60})
    return fig


def _natural(text: str) -> tuple[Any, ...]:
    try:
        return (0, float(text.split("/")[0]), text)
    except ValueError:
        return (1, 0.0, text)


def compile_figure(summary: StudySummary) -> Any | None:
    """Seconds each compiled trial spent compiling (its first step), by cache hit or miss; None
    when nothing compiled."""
    import plotly.graph_objects as go

    rows = [r for r in summary.rows if r.compile_s is not None and r.reused_from is None]
    if not rows:
        return None
    total = sum(float(r.compile_s or 0.0) for r in rows)
    fig = go.Figure()
    for name, hit, color in (("cache miss (compiled)", False, "#ff7f0e"), ("from the Inductor cache", True, "#2ca02c"),
                             ("cache unknown", None, "#7f7f7f")):
        subset = [r for r in rows if r.compile_cache_hit is hit]
        if subset:
            fig.add_trace(go.Bar(x=[r.label for r in subset], y=[r.compile_s for r in subset], name=name,
                                 marker_color=color, customdata=[_describe(r) for r in subset],
                                 hovertemplate="%{x}: %{y:.1f} s compiling<br>%{customdata}<extra></extra>"))
    fig.update_layout(title=f"Compile cost: {total:.0f} s over {len(rows)} compiled trial(s) (the objective counts "
                            "step time only; a production run compiles once)",
                      xaxis_title="trial", yaxis_title="seconds compiling", template="plotly_white", height=380,
                      xaxis={"type": "category"}, margin={"t": 60, "l": 60, "r": 20, "b": 60}, legend_title="")
    return fig
