"""Per-trial memory charts stored as Optuna artifacts (shown on the trial's page in optuna-dashboard)."""

from __future__ import annotations

import html
import os
import tempfile
from typing import Any

from autobalance.protocol import Status, TrialAttr, memory_text

__all__ = ["ARTIFACT_PREFIX", "artifact_dir_for", "chart_verdict", "render_trial_chart", "upload_trial_chart"]

ARTIFACT_PREFIX = "memory-per-rank"
DEFAULT_ARTIFACT_DIR = "autobalance_artifacts"


def artifact_dir_for(storage_url: str) -> str:
    """Where the artifacts of a storage live: next to a SQLite file (``x.db`` -> ``x.db.artifacts``),
    else ``./autobalance_artifacts`` (absolute path)."""
    path: str | None = None
    if storage_url.startswith("sqlite"):
        try:
            from sqlalchemy.engine import make_url

            path = make_url(storage_url).database
        except Exception:
            path = None
    if path and path != ":memory:" and not path.startswith("file:"):
        return os.path.abspath(path) + ".artifacts"
    return os.path.abspath(DEFAULT_ARTIFACT_DIR)


def _per_rank(attrs: dict[str, Any], key: str) -> list[float | None]:
    value = attrs.get(key)
    return list(value) if isinstance(value, list) else []


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


GOOD = "#1f77b4"
BAD = "#d62728"
PREDICTED = "#f4a6a6"


def chart_verdict(attrs: dict[str, Any]) -> tuple[str, list[str]]:
    """The chart's title words and each rank's bar colour, from feasibility (not status): a rank
    over its usable limit, or the rank that ran out of memory, is red; a predicted trial is pale."""
    from autobalance.report._rows import outcome_label

    peaks = _per_rank(attrs, TrialAttr.PEAK_DEVICE_GIB)
    usable = _per_rank(attrs, TrialAttr.USABLE_GIB)
    status = str(attrs.get(TrialAttr.STATUS) or "?")
    over = [p is not None and u is not None and float(p) > float(u)
            for p, u in zip(peaks, [*usable, *[None] * len(peaks)], strict=False)]
    predicted = bool(attrs.get(TrialAttr.PREDICTED)) or status == Status.PREDICTED_OOM
    feasible = status == Status.OK and not any(over) and attrs.get(TrialAttr.FEASIBLE, True) is not False
    ratios = [(float(p) / float(u), r) for r, (p, u) in enumerate(zip(peaks, usable, strict=False)) if p is not None and u]
    worst = max(ratios)[1] if ratios else None
    many = len(peaks) > 1
    words = outcome_label(status=status, feasible=feasible, failing_rank=attrs.get(TrialAttr.FAILING_RANK) if many else None,
                          worst_rank=worst if many else None, predicted=predicted)
    failing = attrs.get(TrialAttr.FAILING_RANK)
    colors = []
    for r in range(len(peaks)):
        if predicted:
            colors.append(PREDICTED)
        elif feasible:
            colors.append(GOOD)
        elif over[r] or r == failing or (status == Status.OK and not any(over)):
            colors.append(BAD)
        else:
            colors.append("#9ecae1")  # a rank that fit in a trial that did not
    return words, colors


def render_trial_chart(attrs: dict[str, Any], *, number: int, path_stem: str) -> str | None:
    """Draw one trial's per-rank peak memory (bars) against capacity and the usable limit, coloured
    by feasibility: blue fits, red over the limit or out of memory, pale red predicted (never run).

    Writes ``path_stem + '.png'`` (matplotlib) or, without matplotlib, ``path_stem + '.html'``
    (an inline SVG, no scripts). Returns the path, or None when the trial measured nothing.
    """
    peaks = _per_rank(attrs, TrialAttr.PEAK_DEVICE_GIB)
    if not peaks or all(p is None for p in peaks):
        return None
    caps = _per_rank(attrs, TrialAttr.CAPACITY_GIB)
    usable = _per_rank(attrs, TrialAttr.USABLE_GIB)
    words, colors = chart_verdict(attrs)
    spread = attrs.get(TrialAttr.SPREAD_GIB)
    title = f"trial {number}: {words}"
    if isinstance(spread, (int, float)) and len(peaks) > 1 and attrs.get(TrialAttr.STATUS) == Status.OK:
        title += f", spread {memory_text(spread)}"
    if _have_matplotlib():
        return _render_png(peaks, caps, usable, title=title, colors=colors, path=path_stem + ".png")
    return _render_svg_html(peaks, caps, usable, title=title, colors=colors, path=path_stem + ".html")


def _render_png(peaks: list[float | None], caps: list[float | None], usable: list[float | None], *,
                title: str, colors: list[str], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2, 2.6), dpi=90)
    ax = fig.add_subplot()
    ranks = list(range(len(peaks)))
    values = [p or 0.0 for p in peaks]
    ax.bar(ranks, values, color=colors, width=0.6, label="peak")
    top = max(values) if values else 1.0
    for name, series, style in (("capacity", caps, "-"), ("usable", usable, "--")):
        if series and all(v is not None for v in series):
            shown = [float(v) for v in series if v is not None]
            if max(shown) <= 3 * top:  # a far-away line (host RAM on CPU) would flatten the bars
                ax.step([r - 0.5 for r in ranks] + [ranks[-1] + 0.5], [*shown, shown[-1]], where="post",
                        linestyle=style, color="#444444", linewidth=1, label=name)
    for r, v in zip(ranks, values, strict=True):
        ax.annotate(f"{v:.3g}", (r, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(ranks, [f"rank {r}" for r in ranks], fontsize=8)
    ax.set_ylabel("GiB", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    return path


def _render_svg_html(peaks: list[float | None], caps: list[float | None], usable: list[float | None], *,
                     title: str, colors: list[str], path: str) -> str:
    width, height, pad = 360, 200, 30
    values = [p or 0.0 for p in peaks]
    lines = [float(v) for v in [*caps, *usable] if v is not None]
    top = max([*values, *[v for v in lines if v <= 3 * max(values or [1.0])]] or [1.0]) * 1.15 or 1.0
    bar_w = (width - 2 * pad) / max(1, len(values))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">']
    for r, v in enumerate(values):
        color = colors[r]
        h = (height - 2 * pad) * v / top
        x = pad + r * bar_w + bar_w * 0.2
        parts.append(f'<rect x="{x:.1f}" y="{height - pad - h:.1f}" width="{bar_w * 0.6:.1f}" height="{h:.1f}" '
                     f'fill="{color}"><title>rank {r}: {memory_text(v)}</title></rect>')
        parts.append(f'<text x="{x + bar_w * 0.3:.1f}" y="{height - pad + 14}" font-size="10" '
                     f'text-anchor="middle">rank {r}</text>')
    for series, dash in ((caps, ""), (usable, ' stroke-dasharray="4 3"')):
        for r, level in enumerate(series):
            if level is not None and float(level) <= top:
                y = height - pad - (height - 2 * pad) * float(level) / top
                parts.append(f'<line x1="{pad + r * bar_w:.1f}" x2="{pad + (r + 1) * bar_w:.1f}" y1="{y:.1f}" '
                             f'y2="{y:.1f}" stroke="#444"{dash}/>')
    parts.append(f'<text x="{pad}" y="16" font-size="12">{html.escape(title)} (GiB)</text></svg>')
    with open(path, "w") as fh:
        fh.write(f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>{''.join(parts)}")
    return path


def upload_trial_chart(study: Any, trial: Any, artifact_dir: str, *, attrs: dict[str, Any] | None = None) -> str | None:
    """Render ``trial``'s per-rank memory chart and upload it as an Optuna artifact of that trial.

    ``trial`` is an ``optuna.Trial`` or a ``FrozenTrial``; Optuna only accepts artifacts on a trial
    that is not finished yet, so the tuner calls this before ``study.tell``, passing the user
    attributes it is about to set as ``attrs``. Returns the artifact id, or None when the trial
    has no measurement to draw.
    """
    from optuna.artifacts import FileSystemArtifactStore, upload_artifact

    from autobalance.store import storage_of

    data = dict(trial.user_attrs)
    data.update(attrs or {})
    os.makedirs(artifact_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="autobalance-chart-") as tmp:
        path = render_trial_chart(data, number=trial.number,
                                  path_stem=os.path.join(tmp, f"{ARTIFACT_PREFIX}-trial{trial.number:04d}"))
        if path is None:
            return None
        return upload_artifact(artifact_store=FileSystemArtifactStore(artifact_dir), file_path=path,
                               study_or_trial=trial, storage=storage_of(study))
