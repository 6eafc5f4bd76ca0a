"""Static PNG versions of the report's charts (matplotlib; ``autobalance report --png DIR``)."""

from __future__ import annotations

import os

from autobalance.protocol import Status
from autobalance.report._figures import BAD, rank_colors
from autobalance.report._rows import StudySummary, pareto_front

__all__ = ["write_pngs"]


def _f(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def _max(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def write_pngs(summary: StudySummary, png_dir: str, *, importances: dict[str, float] | None) -> list[str]:
    """Write memory.png, tradeoff.png (and importance.png) into ``png_dir``; returns the paths."""
    try:
        import matplotlib
    except ImportError:
        from autobalance._errors import UsageError

        raise UsageError("--png needs matplotlib; install it with pip install 'autobalance[report]'.") from None
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    os.makedirs(png_dir, exist_ok=True)
    paths = []

    rows = [r for r in summary.rows if any(p is not None for p in r.peaks_gib) or r.failed_memory]
    ranks = max((len(r.peaks_gib) for r in rows), default=0)
    fig = Figure(figsize=(max(6.0, 0.5 * len(rows) * max(1, ranks) + 2), 4.2), dpi=110)
    ax = fig.add_subplot()
    width = 0.8 / max(1, ranks)
    top = _max([_max(r.peaks_gib) for r in rows]) or 1.0
    for rank, color in zip(range(ranks), rank_colors(ranks), strict=True):
        xs = [i - 0.4 + width * (rank + 0.5) for i in range(len(rows))]
        ys = [(r.peaks_gib[rank] if rank < len(r.peaks_gib) else None) or 0.0 for r in rows]
        ax.bar(xs, ys, width=width, color=color, label=f"rank {rank}",
               hatch=None, edgecolor=[BAD if r.failed_memory else color for r in rows])
    caps = [_max(r.capacity_gib) for r in rows]
    cap_top = _max(caps)
    if cap_top is not None and cap_top <= 3 * top:
        for name, series, style in (("capacity", caps, "-"), ("usable", [_max(r.usable_gib) for r in rows], "--")):
            ax.step(range(len(rows)), [v if v is not None else float("nan") for v in series], where="mid",
                    color="#333333", linestyle=style, linewidth=1, label=name)
    for i, r in enumerate(rows):
        if r.failed_memory or r.status in (Status.TIMEOUT, Status.ERROR, Status.CRASH):
            ax.annotate("infeasible" if r.status == Status.OK else r.status.upper(), (i, (_max(r.peaks_gib) or 0) + 0.04 * top),
                        ha="center", color=BAD, fontsize=8, weight="bold")
    ax.set_xticks(range(len(rows)), [r.label for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GiB")
    ax.set_title("Peak device memory per rank, per trial")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(png_dir, "memory.png"))
    fig.savefig(paths[-1])

    fig = Figure(figsize=(6.4, 4.2), dpi=110)
    ax = fig.add_subplot()
    measured = [r for r in summary.rows if r.measured]
    for name, subset, color in (("feasible", [r for r in measured if r.feasible], "#1f77b4"),
                                ("over the memory limit", [r for r in measured if not r.feasible], BAD)):
        if subset:
            ax.scatter([_f(r.spread_gib) for r in subset], [_f(r.step_ms) for r in subset], color=color, label=name, s=30)
    front = pareto_front(summary.rows)
    if front:
        ax.step([_f(r.spread_gib) for r in front], [_f(r.step_ms) for r in front], where="post", color="#2ca02c",
                label="Pareto front")
    if summary.baseline is not None and summary.baseline.measured:
        ax.scatter([_f(summary.baseline.spread_gib)], [_f(summary.baseline.step_ms)], marker="D", s=70, color="#7f7f7f",
                   label="baseline")
    if summary.best is not None and summary.best.measured:
        ax.scatter([_f(summary.best.spread_gib)], [_f(summary.best.step_ms)], marker="*", s=260, color="#ffbf00",
                   edgecolors="black", label=f"chosen {summary.best.label}", zorder=5)
    ax.set_xlabel("spread of peaks across ranks (GiB)")
    ax.set_ylabel("step time (ms)")
    ax.set_title("Step time versus spread")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(png_dir, "tradeoff.png"))
    fig.savefig(paths[-1])

    if importances:
        items = sorted(importances.items(), key=lambda kv: kv[1])
        fig = Figure(figsize=(6.4, max(2.4, 0.5 + 0.4 * len(items))), dpi=110)
        ax = fig.add_subplot()
        ax.barh([k for k, _ in items], [v for _, v in items], color="#1f77b4")
        ax.set_xlabel("importance")
        ax.set_title("Parameter importances")
        fig.tight_layout()
        paths.append(os.path.join(png_dir, "importance.png"))
        fig.savefig(paths[-1])
    return paths
