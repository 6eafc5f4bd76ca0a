"""``build_report``: one offline HTML file (plotly.js embedded) describing a study."""

from __future__ import annotations

import datetime
import html
import json
import os
from dataclasses import dataclass, field
from typing import Any

from autobalance.protocol import Status
from autobalance.report._rows import StudySummary, TrialRow, summarize

__all__ = ["ReportFiles", "build_report"]


@dataclass(kw_only=True)
class ReportFiles:
    html: str
    pngs: list[str] = field(default_factory=list)
    importance_note: str = ""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _comparison(summary: StudySummary) -> str:
    base, best = summary.baseline, summary.best

    def cell(row: TrialRow | None, fn: Any) -> str:
        return "<td>-</td>" if row is None else f"<td>{_e(fn(row))}</td>"

    from autobalance.tuner import describe_config

    lines = [
        "<table class='cmp'><thead><tr><th></th>"
        f"<th>baseline {_e(base.label) if base else ''}</th><th>best {_e(best.label) if best else '(none yet)'}</th>"
        "</tr></thead><tbody>",
        "<tr><th>configuration</th>" + cell(base, lambda r: describe_config(r.config)) +
        cell(best, lambda r: describe_config(r.config)) + "</tr>",
        "<tr><th>status</th>" + cell(base, lambda r: r.status) + cell(best, lambda r: r.status) + "</tr>",
    ]
    ranks = max(len(base.peaks_gib) if base else 0, len(best.peaks_gib) if best else 0)
    for r in range(ranks):
        lines.append(f"<tr><th>rank {r} peak (GiB)</th>"
                     + cell(base, lambda x, r=r: _num(x.peaks_gib[r] if r < len(x.peaks_gib) else None, ".4f"))
                     + cell(best, lambda x, r=r: _num(x.peaks_gib[r] if r < len(x.peaks_gib) else None, ".4f"))
                     + "</tr>")
    lines.append("<tr><th>spread (GiB)</th>" + cell(base, lambda r: _num(r.spread_gib, ".4f"))
                 + cell(best, lambda r: _num(r.spread_gib, ".4f")) + "</tr>")
    lines.append("<tr><th>spread (% of capacity)</th>" + cell(base, lambda r: _num(r.spread_pct, ".2f"))
                 + cell(best, lambda r: _num(r.spread_pct, ".2f")) + "</tr>")
    lines.append("<tr><th>step time (ms)</th>" + cell(base, lambda r: _num(r.step_ms, ".1f"))
                 + cell(best, lambda r: _num(r.step_ms, ".1f")) + "</tr>")
    if base and best and base.step_ms and best.step_ms:
        lines.append(f"<tr><th>speed-up</th><td>1.00x</td><td>{base.step_ms / best.step_ms:.2f}x</td></tr>")
    if base and best and base.spread_gib is not None and best.spread_gib is not None:
        lines.append(f"<tr><th>spread reduction</th><td>-</td><td>{_num(base.spread_gib - best.spread_gib, '.4f')} GiB</td></tr>")
    lines.append("</tbody></table>")
    return "\n".join(lines)


def _best_config(summary: StudySummary) -> str:
    best = summary.best
    if best is None:
        return ("<p class='warn'>No feasible configuration yet: every trial ran out of memory, went over the usable "
                "limit or failed. Run more trials, raise <code>--memory-cap-gib</code> or lower <code>--headroom</code>.</p>")
    rows = "".join(f"<tr><th>{_e(k)}</th><td><code>{_e(json.dumps(v))}</code></td></tr>"
                   for k, v in (best.config or {}).items())
    use = (f"AUTOBALANCE_STUDY={summary.name} AUTOBALANCE_STORAGE=... torchrun ...  "
           f"# or: autobalance export --study-name {summary.name} -o best.json")
    return (f"<p>Trial {_e(best.label)}: peak spread {_num(best.spread_gib, '.4f')} GiB, step "
            f"{_num(best.step_ms, '.1f')} ms.</p><table class='cfg' id='best-config'>{rows}</table>"
            f"<p>Use it: <code>{_e(use)}</code></p>")


def _trials_table(summary: StudySummary) -> str:
    from autobalance.tuner import describe_config

    head = ("<table class='trials' id='trials'><thead><tr><th>#</th><th>state</th><th>status</th><th>feasible</th>"
            "<th>configuration</th><th>peak GiB per rank</th><th>spread GiB</th><th>step ms</th></tr></thead><tbody>")
    body = []
    for r in summary.rows:
        cls = " class='bad'" if r.failed_memory or r.status not in (Status.OK,) else ""
        chosen = " class='chosen'" if summary.best is not None and r.number == summary.best.number else cls
        peaks = " ".join("-" if p is None else f"{p:.4f}" for p in r.peaks_gib) or "-"
        body.append(f"<tr{chosen}><td>{_e(r.label)}</td><td>{_e(r.state)}</td><td>{_e(r.status)}</td>"
                    f"<td>{'yes' if r.feasible else 'no'}</td><td>{_e(describe_config(r.config) if r.config else '-')}</td>"
                    f"<td>{_e(peaks)}</td><td>{_num(r.spread_gib, '.4f')}</td><td>{_num(r.step_ms, '.1f')}</td></tr>")
    return head + "".join(body) + "</tbody></table>"


_STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; }
thead th { background: #f4f4f4; } tr.bad td { color: #b00; } tr.chosen td { background: #fff6cc; font-weight: bold; }
.meta { color: #555; } .warn { color: #b00; } code { font-size: 0.95em; }
"""


def build_report(study: Any, *, output_html: str, png_dir: str | None = None) -> ReportFiles:
    """Write the study's report to ``output_html`` (and PNGs to ``png_dir``); returns the paths."""
    import plotly.io as pio

    from autobalance.report._figures import importance_figure, memory_figure, tradeoff_figure
    from autobalance.report._importance import param_importances

    summary = summarize(study)
    importances, note = param_importances(study)
    config = {"displaylogo": False, "responsive": True}
    charts: list[str] = []
    first = True
    for div_id, fig in (("memory-chart", memory_figure(summary)), ("tradeoff-chart", tradeoff_figure(summary)),
                        *((("importance-chart", importance_figure(importances)),) if importances else ())):
        charts.append(pio.to_html(fig, full_html=False, include_plotlyjs=first, div_id=div_id,
                                  config=config, include_mathjax=False))
        first = False
    device = summary.device
    meta = (f"{len(summary.rows)} trials; objective {', '.join(summary.directions)} "
            f"{'(' + ', '.join(summary.metric_names) + ')' if summary.metric_names else ''}; "
            f"device {device.get('name', '?')} ({device.get('type', '?')}); world size "
            f"{summary.objective.get('world_size', '?')}; generated "
            f"{datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}")
    importance_html = charts[2] if importances else f"<p class='meta' id='importance-note'>Parameter importances: {_e(note)}.</p>"
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>autobalance report: {_e(summary.name)}</title>
<style>{_STYLE}</style></head><body>
<h1>autobalance report: study <code>{_e(summary.name)}</code></h1>
<p class="meta">{_e(meta)}</p>
<h2>Chosen configuration</h2>
{_best_config(summary)}
<h2>Baseline versus best</h2>
{_comparison(summary)}
<h2>Peak memory per rank</h2>
<p class="meta">Bars: each rank's peak device memory (allocator reserved + memory outside PyTorch). Lines: capacity
and the usable limit (capacity minus headroom). Crossed bars and red marks: out of memory or over the usable limit.</p>
{charts[0]}
<h2>Step time versus spread</h2>
{charts[1]}
<h2>Parameter importances</h2>
{importance_html}
<h2>All trials</h2>
{_trials_table(summary)}
</body></html>
"""
    os.makedirs(os.path.dirname(os.path.abspath(output_html)), exist_ok=True)
    with open(output_html, "w", encoding="utf-8") as fh:
        fh.write(page)
    pngs: list[str] = []
    if png_dir:
        from autobalance.report._static import write_pngs

        pngs = write_pngs(summary, png_dir, importances=importances)
    return ReportFiles(html=os.path.abspath(output_html), pngs=pngs, importance_note=note)
