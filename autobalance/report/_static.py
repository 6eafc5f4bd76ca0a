"""Static PNG versions of the report's charts (matplotlib; ``autobalance report --png DIR``):
memory.png, time_memory.png, factors.png (when a setting varied), compile.png (when a trial
compiled), tradeoff.png (two ranks or more), importance.png (when computable)."""

from __future__ import annotations

import os
from typing import Any

from autobalance.protocol import FAILED_STATUSES, Status
from autobalance.report._figures import (
    BAD,
    _limits,
    _natural,
    _scaled,
    _varying,
    factor_values,
    memory_unit,
    param_words,
    rank_colors,
)
from autobalance.report._rows import StudySummary, pareto_front

__all__ = ["write_pngs"]


def _f(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def _max(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def write_pngs(summary: StudySummary, png_dir: str, *, importances: dict[str, float] | None) -> list[str]:
    """Write the PNGs into ``png_dir``; returns the paths."""
    try:
        import matplotlib
    except ImportError:
        from autobalance._errors import UsageError

        raise UsageError("--png needs matplotlib; install it with pip install -e '.[report]' in the autobalance clone (or pip install matplotlib).") from None
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    os.makedirs(png_dir, exist_ok=True)
    paths = []

    rows = [r for r in summary.rows if any(p is not None for p in r.peaks_gib) or r.failed_memory]
    ranks = max((len(r.peaks_gib) for r in rows), default=0)
    fig = Figure(figsize=(max(6.0, 0.5 * len(rows) * max(1, ranks) + 2), 4.2), dpi=110)
    ax = fig.add_subplot()
    width = 0.8 / max(1, ranks)
    unit, k = memory_unit(_max([_max(r.peaks_gib) for r in rows]))
    top = (_max([_max(r.peaks_gib) for r in rows]) or 1.0) * k
    for rank, color in zip(range(ranks), rank_colors(ranks), strict=True):
        xs = [i - 0.4 + width * (rank + 0.5) for i in range(len(rows))]
        ys = [((r.peaks_gib[rank] if rank < len(r.peaks_gib) else None) or 0.0) * k for r in rows]
        ax.bar(xs, ys, width=width, color=color, label=f"rank {rank}",
               hatch=None, edgecolor=[BAD if r.failed_memory else color for r in rows])
    caps = _scaled([_max(r.capacity_gib) for r in rows], k)
    cap_top = _max(caps)
    if cap_top is not None and cap_top <= 3 * top:
        for name, series, style in (("capacity", caps, "-"), ("usable", _scaled([_max(r.usable_gib) for r in rows], k), "--")):
            ax.step(range(len(rows)), [v if v is not None else float("nan") for v in series], where="mid",
                    color="#333333", linestyle=style, linewidth=1, label=name)
    for i, r in enumerate(rows):
        if r.failed_memory or r.status in FAILED_STATUSES:
            text = "predicted OOM" if r.predicted else ("over limit" if r.status == Status.OK else r.status.upper())
            ax.annotate(text, (i, (_max(r.peaks_gib) or 0) * k + 0.04 * top), ha="center", color=BAD, fontsize=8,
                        weight="bold")
    ax.set_xticks(range(len(rows)), [r.label for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"peak device memory ({unit})")
    ax.set_title("Peak device memory per rank, per trial")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(png_dir, "memory.png"))
    fig.savefig(paths[-1])

    paths.append(_time_memory_png(summary, png_dir, Figure))
    factors = _factors_png(summary, png_dir, Figure)
    if factors:
        paths.append(factors)
    compiled = _compile_png(summary, png_dir, Figure)
    if compiled:
        paths.append(compiled)
    if summary.multi_rank:
        paths.append(_tradeoff_png(summary, png_dir, Figure))
    if importances:
        items = sorted(importances.items(), key=lambda kv: kv[1])
        fig = Figure(figsize=(6.4, max(2.4, 0.5 + 0.4 * len(items))), dpi=110)
        ax = fig.add_subplot()
        ax.barh([param_words(name) for name, _ in items], [v for _, v in items], color="#1f77b4")
        ax.set_xlabel("importance")
        ax.set_title("Parameter importances")
        fig.tight_layout()
        paths.append(os.path.join(png_dir, "importance.png"))
        fig.savefig(paths[-1])
    return paths


def _time_memory_png(summary: StudySummary, png_dir: str, Figure: Any) -> str:
    fig = Figure(figsize=(7.2, 4.6), dpi=110)
    ax = fig.add_subplot()
    n = summary.world_size
    colors = rank_colors(n)
    measured = [r for r in summary.rows if r.step_ms is not None and r.peak_gib is not None]
    unmeasured = [r for r in summary.rows if r.step_ms is None and r.peak_gib is not None and r.reused_from is None]
    top = max((float(r.step_ms) for r in measured), default=100.0)  # type: ignore[arg-type]
    unit, k = memory_unit(_max([p for r in [*measured, *unmeasured] for p in r.peaks_gib]))
    for r in measured:
        peaks = [p * k for p in r.peaks_gib if p is not None]
        if len(peaks) > 1:
            ax.plot([min(peaks), max(peaks)], [r.step_ms, r.step_ms], color="#bbbbbb", linewidth=1, zorder=1)
    for rank in range(n):
        for feasible in (True, False):
            subset = [r for r in measured if r.feasible == feasible and rank < r.ranks and r.peaks_gib[rank] is not None]
            if subset:
                ax.scatter([_f(r.peaks_gib[rank]) * k for r in subset], [_f(r.step_ms) for r in subset], color=colors[rank],
                           marker="o" if feasible else "X", edgecolors=colors[rank] if feasible else BAD, s=45,
                           label=(f"rank {rank}" if n > 1 else "peak") + ("" if feasible else " (trial over the limit)"),
                           zorder=3)
    for predicted in (False, True):
        subset = [r for r in unmeasured if r.predicted == predicted]
        if subset:
            ax.scatter([_f(r.peak_gib) * k for r in subset], [top * 1.12] * len(subset), marker="^",
                       facecolors="none" if predicted else BAD, edgecolors=BAD, s=50, zorder=3,
                       label="predicted OOM (not run)" if predicted else "OOM (peak: a lower bound)")
    best = summary.best
    if best is not None and best.step_ms is not None:
        ax.scatter([_f(best.peak_gib) * k], [_f(best.step_ms)], marker="*", s=260, color="#ffbf00", edgecolors="black",
                   label=f"chosen {best.label}", zorder=5)
    caps, usable = _limits(summary)
    right = max((p * k for r in [*measured, *unmeasured] for p in r.peaks_gib if p is not None), default=1.0)
    for name, series, style in (("capacity", caps, "-"), ("usable", usable, "--")):
        levels = sorted({float(f"{float(v) * k:.4g}") for v in series if v is not None})
        if levels and levels[0] <= 3 * right:
            for v in levels:
                ax.axvline(v, color="#333333", linestyle=style, linewidth=1, label=f"{name} {v:.4g} {unit}")
    ax.set_xlabel(f"peak device memory ({unit})")
    ax.set_ylabel("step time (ms)")
    ax.set_title("Step time versus peak memory per rank")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = os.path.join(png_dir, "time_memory.png")
    fig.savefig(path)
    return path


def _factors_png(summary: StudySummary, png_dir: str, Figure: Any) -> str | None:
    measured = [r for r in summary.rows if r.step_ms is not None and r.reused_from is None]
    keys = _varying(measured)
    if not keys:
        return None
    fig = Figure(figsize=(max(4.0, 2.4 * len(keys)), 3.6), dpi=110)
    axes = fig.subplots(1, len(keys), sharey=True, squeeze=False)[0]
    for ax, key in zip(axes, keys, strict=True):
        order = sorted({str(factor_values(r)[key]) for r in measured if factor_values(r)[key] is not None}, key=_natural)
        for feasible in (True, False):
            subset = [r for r in measured if r.feasible == feasible and factor_values(r)[key] is not None]
            if subset:
                ax.scatter([order.index(str(factor_values(r)[key])) for r in subset], [_f(r.step_ms) for r in subset],
                           color="#1f77b4" if feasible else BAD, marker="o" if feasible else "X", s=35,
                           label="fits" if feasible else "over the limit")
        best = summary.best
        if best is not None and best.step_ms is not None and factor_values(best)[key] is not None:
            ax.scatter([order.index(str(factor_values(best)[key]))], [_f(best.step_ms)], marker="*", s=200,
                       color="#ffbf00", edgecolors="black", zorder=5, label=f"chosen {best.label}")
        ax.set_xticks(range(len(order)), order, fontsize=7, rotation=20)
        ax.set_xlim(-0.5, len(order) - 0.5)
        ax.set_title(key, fontsize=9)
    axes[0].set_ylabel("step time (ms)")
    axes[0].legend(fontsize=7)
    fig.suptitle("What each setting did to step time", fontsize=10)
    fig.tight_layout()
    path = os.path.join(png_dir, "factors.png")
    fig.savefig(path)
    return path


def _compile_png(summary: StudySummary, png_dir: str, Figure: Any) -> str | None:
    rows = [r for r in summary.rows if r.compile_s is not None and r.reused_from is None]
    if not rows:
        return None
    fig = Figure(figsize=(max(4.0, 0.5 * len(rows) + 2), 3.4), dpi=110)
    ax = fig.add_subplot()
    colors = ["#2ca02c" if r.compile_cache_hit else ("#ff7f0e" if r.compile_cache_hit is False else "#7f7f7f")
              for r in rows]
    ax.bar(range(len(rows)), [_f(r.compile_s) for r in rows], color=colors)
    ax.set_xticks(range(len(rows)), [r.label for r in rows], fontsize=8, rotation=30)
    ax.set_ylabel("seconds compiling")
    ax.set_title(f"Compile cost: {sum(_f(r.compile_s) for r in rows):.0f} s over {len(rows)} trial(s) "
                 "(green: from the cache)", fontsize=9)
    fig.tight_layout()
    path = os.path.join(png_dir, "compile.png")
    fig.savefig(path)
    return path


def _tradeoff_png(summary: StudySummary, png_dir: str, Figure: Any) -> str:
    fig = Figure(figsize=(6.4, 4.2), dpi=110)
    ax = fig.add_subplot()
    measured = [r for r in summary.rows if r.measured]
    unit, k = memory_unit(_max([r.spread_gib for r in measured]))
    for name, subset, color in (("feasible", [r for r in measured if r.feasible], "#1f77b4"),
                                ("over the memory limit", [r for r in measured if not r.feasible], BAD)):
        if subset:
            ax.scatter([_f(r.spread_gib) * k for r in subset], [_f(r.step_ms) for r in subset], color=color, label=name, s=30)
    front = pareto_front(summary.rows) if len(summary.directions) > 1 else []  # two objectives only
    if front:
        ax.step([_f(r.spread_gib) * k for r in front], [_f(r.step_ms) for r in front], where="post", color="#2ca02c",
                label="Pareto front")
    if summary.baseline is not None and summary.baseline.measured:
        ax.scatter([_f(summary.baseline.spread_gib) * k], [_f(summary.baseline.step_ms)], marker="D", s=70, color="#7f7f7f",
                   label="baseline")
    if summary.best is not None and summary.best.measured:
        ax.scatter([_f(summary.best.spread_gib) * k], [_f(summary.best.step_ms)], marker="*", s=260, color="#ffbf00",
                   edgecolors="black", label=f"chosen {summary.best.label}", zorder=5)
    ax.set_xlabel(f"spread of peaks across ranks ({unit})")
    ax.set_ylabel("step time (ms)")
    ax.set_title("Step time versus spread")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(png_dir, "tradeoff.png")
    fig.savefig(path)
    return path
