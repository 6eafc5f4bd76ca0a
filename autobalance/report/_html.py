"""``build_report``: one offline HTML file (plotly.js embedded) describing a study."""

from __future__ import annotations

import datetime
import html
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from autobalance.protocol import Status, busy_wait_text, memory_text, slow_rank, speed_up
from autobalance.report._rows import StudySummary, TrialRow, summarize

__all__ = ["ReportFiles", "build_report", "config_rows"]


@dataclass(kw_only=True)
class ReportFiles:
    html: str
    pngs: list[str] = field(default_factory=list)
    importance_note: str = ""
    best_trial: int | None = None
    """The best measured trial the report names (None: no trial fits)."""
    not_saved: str = ""
    """Why that trial is not the saved one (``failed verification``; empty: it is, or the store was not read)."""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


_DTYPES = {"fp32": "fp32 (no autocast)", "bf16": "bf16 autocast", "fp16": "fp16 autocast with a GradScaler"}


def _per_rank(values: list[Any], fmt: Any = str) -> str:
    if len(values) == 1:
        return fmt(values[0])
    if len({repr(v) for v in values}) == 1:
        return f"{fmt(values[0])} on every rank"
    return ", ".join(f"rank {r}: {fmt(v)}" for r, v in enumerate(values))


def config_rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    """A configuration as (setting, readable value) pairs: per-rank values spelled out, no JSON."""
    c = dict(config)
    rows: list[tuple[str, str]] = []
    from autobalance._config import BalanceConfig, block_ranges
    from autobalance._errors import ConfigError

    micro = c.pop("micro_batches", None)
    uneven = bool(c.pop("rank_samples", None))
    try:  # each rank's micro-steps as they run, the notation of every output: "rank 0: 6,6,5,5,5,5; rank 1: ..."
        split: str | None = BalanceConfig.from_dict(config).split_text()
    except ConfigError:  # a partial configuration: its fields as they are
        split = None
    if split is not None:
        rows.append(("micro-batches per optimizer step" + (" (sizes differ by at most one)" if uneven else ""), split))
    elif micro is not None:
        rows.append(("micro-batch (samples per micro-step)", _per_rank(list(micro))))
    if "accumulation" in c:
        rows.append(("gradient accumulation (micro-steps per optimizer step)", str(c.pop("accumulation"))))
    if "global_batch" in c:
        rows.append(("global batch (samples per optimizer step)", str(c.pop("global_batch"))))
    if "dtype" in c:
        dtype = c.pop("dtype")
        rows.append(("precision", _DTYPES.get(dtype, str(dtype))))
    mode = c.pop("compile", "off")
    rows.append(("torch.compile", "off (eager)" if mode == "off" else f"mode {mode}"))
    budget = c.pop("activation_budget", None)
    if mode != "off":
        rows.append(("activation memory budget", "Inductor's default" if not budget else _per_rank(list(budget), lambda b: f"{b:g}")))
    ckpt = c.pop("checkpoint", None)
    if ckpt is not None and (mode == "off" or any(ckpt)):
        rows.append(("checkpointed blocks (indices)", _per_rank([list(b) for b in ckpt], block_ranges)))
    if "bucket_cap_mb" in c:
        rows.append(("DDP bucket size", f"{float(c.pop('bucket_cap_mb')):g} MB"))
    if "gradient_as_bucket_view" in c:
        rows.append(("DDP gradient_as_bucket_view", "yes" if c.pop("gradient_as_bucket_view") else "no"))
    for key, value in c.items():
        rows.append((key.replace("_", " "), str(value)))
    return rows


def _spread(row: TrialRow) -> float | None:
    """A measured spread only: an OOM trial's peaks are lower bounds, a predicted one's are predictions."""
    return row.spread_gib if row.status == Status.OK else None


def _comparison(summary: StudySummary) -> str:
    base, best = summary.baseline, summary.best

    def cell(row: TrialRow | None, fn: Any) -> str:
        return "<td>-</td>" if row is None else f"<td>{_e(fn(row))}</td>"

    from autobalance._config import describe_config

    lines = [
        "<table class='cmp'><thead><tr><th></th>"
        f"<th>baseline {_e(base.label) if base else ''}</th><th>best {_e(best.label) if best else '(none yet)'}</th>"
        "</tr></thead><tbody>",
        "<tr><th>configuration</th>" + cell(base, lambda r: describe_config(r.config)) +
        cell(best, lambda r: describe_config(r.config)) + "</tr>",
        "<tr><th>outcome</th>" + cell(base, lambda r: r.outcome) + cell(best, lambda r: r.outcome) + "</tr>",
    ]
    ranks = max(len(base.peaks_gib) if base else 0, len(best.peaks_gib) if best else 0)
    for r in range(ranks):
        name = f"rank {r} peak" if summary.multi_rank else "peak"
        lines.append(f"<tr><th>{name}</th>"
                     + cell(base, lambda x, r=r: memory_text(x.peaks_gib[r] if r < len(x.peaks_gib) else None))
                     + cell(best, lambda x, r=r: memory_text(x.peaks_gib[r] if r < len(x.peaks_gib) else None))
                     + "</tr>")
    rows = [x for x in (base, best) if x is not None]
    if any(x.optimizer_state_gib for x in rows):  # optimizer state as its own part of each rank's memory
        for r in range(ranks):
            name = f"rank {r} optimizer state" if summary.multi_rank else "optimizer state"
            lines.append(f"<tr><th>{name}</th>" + cell(base, lambda x, r=r: _optimizer_cell(x, r))
                         + cell(best, lambda x, r=r: _optimizer_cell(x, r)) + "</tr>")
    if summary.multi_rank and any(x.busy_ms for x in rows):  # the imbalance of time next to that of memory
        for r in range(ranks):
            lines.append(f"<tr><th title='its own work per step / its wait for the other ranks (the gradient all-reduce, DDP's forward syncs, ZeRO-1's broadcasts)'>rank {r} busy / "
                         "wait for the other ranks (ms)</th>" + cell(base, lambda x, r=r: _time_cell(x, r))
                         + cell(best, lambda x, r=r: _time_cell(x, r)) + "</tr>")
    if summary.multi_rank:
        lines.append("<tr><th>spread</th>" + cell(base, lambda r: memory_text(_spread(r)))
                     + cell(best, lambda r: memory_text(_spread(r))) + "</tr>")
        lines.append("<tr><th>spread (% of capacity)</th>"
                     + cell(base, lambda r: _num(r.spread_pct if r.status == Status.OK else None, ".2f"))
                     + cell(best, lambda r: _num(r.spread_pct if r.status == Status.OK else None, ".2f")) + "</tr>")
    lines.append("<tr><th>step time (ms)</th>" + cell(base, lambda r: _num(r.step_ms, ".1f"))
                 + cell(best, lambda r: _num(r.step_ms, ".1f")) + "</tr>")
    if base and best and base.step_ms and best.step_ms:
        gain = speed_up(baseline_ms=base.step_ms, baseline_iqr_pct=base.step_iqr_pct, best_ms=best.step_ms,
                        best_iqr_pct=best.step_iqr_pct)
        lines.append(f"<tr><th>speed-up</th><td>1.00x</td><td>{_e(gain.text())}</td></tr>")
    if summary.multi_rank and base and best and _spread(base) is not None and _spread(best) is not None:
        lines.append("<tr><th>spread reduction</th><td>-</td>"
                     f"<td>{memory_text(_spread(base) - _spread(best))}</td></tr>")  # type: ignore[operator]
    lines.append("</tbody></table>")
    return "\n".join(lines)


def _optimizer_cell(row: TrialRow, rank: int) -> str:
    state = row.optimizer_state_gib[rank] if rank < len(row.optimizer_state_gib) else None
    if state is None:
        return "-"
    return memory_text(state) + (" (zero1: its share)" if row.optimizer_sharding == "zero1" else "")


def _time_cell(row: TrialRow, rank: int) -> str:
    pick = [row.busy_ms[rank] if rank < len(row.busy_ms) else None, row.wait_ms[rank] if rank < len(row.wait_ms) else None]
    return "-" if pick == [None, None] else busy_wait_text([pick[0]], [pick[1]]).replace("/", " / ")


def rank_time_text(row: TrialRow) -> str:
    """A trial's time per rank in words: each rank's busy time and its wait for the other ranks, and the slow rank
    (busy time per sample :data:`~autobalance.protocol.SLOW_RATIO` times the fastest's or more); empty
    without busy times (a study from before they were measured)."""
    if not row.busy_ms or row.ranks < 2:
        return ""
    each = ", ".join(f"rank {r}: {_time_cell(row, r)}" for r in range(len(row.busy_ms)))
    slow = slow_rank(row.busy_ms, row.samples_per_rank)
    verdict = (f"{slow.text()}." if slow is not None else
               "No rank is clearly slower per sample than another.")
    return f"Time per rank (busy / wait for the other ranks, ms per step): {each}. {verdict}"


SavedTrial = int | None | Literal["unknown"]
"""The trial the store holds as the study's best (None: nothing saved; ``"unknown"``: not looked up)."""


def not_saved_reason(summary: StudySummary, saved_trial: SavedTrial) -> str:
    """Why the best measured trial is not the saved one, in words (``failed verification``, ``not
    verified yet``, ``trial 4 is saved instead``); empty when it is saved or the store was not read."""
    best = summary.best
    if best is None or saved_trial == "unknown" or saved_trial == best.number:
        return ""
    verdict = summary.verify.get(best.number)
    if verdict is not None and not verdict.get("passed"):
        return "failed verification"
    if saved_trial is not None:
        return f"trial {saved_trial} is saved instead"
    return "not verified yet" if verdict is None else "not saved by tune or promote"


def _best_config(summary: StudySummary, saved_trial: SavedTrial = "unknown") -> str:
    from autobalance.report._why import why_this_one

    why = " ".join(why_this_one(summary, script=summary.script or "SCRIPT"))
    best = summary.best
    if best is None:
        return f"<h2>Chosen configuration</h2>\n<p class='warn' id='why'>{_e(why)}</p>"
    not_saved = not_saved_reason(summary, saved_trial)
    heading = f"Best measured (not saved: {not_saved})" if not_saved else "Chosen configuration"
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in config_rows(best.config or {}))
    storage = summary.storage_url or "..."
    use = (f"AUTOBALANCE_STUDY={summary.name} AUTOBALANCE_STORAGE={storage} torchrun ...  "
           f"# or: autobalance export --study-name {summary.name} --storage {storage} -o best.json")
    figures = [f"step {_num(best.step_ms, '.1f')} ms", f"highest peak {memory_text(best.peak_gib)}"]
    if summary.multi_rank:
        figures.append(f"spread {memory_text(best.spread_gib)}")
    if not not_saved:
        use_text = f"<p>Use it: <code>{_e(use)}</code></p>"
    elif isinstance(saved_trial, int):  # another trial is the saved one: what production loads
        use_text = f"<p class='warn' id='not-saved'>Production loads trial {saved_trial}, the saved one: <code>{_e(use)}</code></p>"
    else:
        use_text = ("<p class='warn' id='not-saved'>Nothing is saved for this study: a production job asking for it "
                    "runs the script's own configuration.</p>")
    time_text = rank_time_text(best)
    time_html = f"<p id='rank-time'>{_e(time_text)}</p>" if time_text else ""
    return (f"<h2 id='best-heading'>{_e(heading)}</h2>\n"
            f"<p>Trial {_e(best.label)}: {_e(', '.join(figures))}.</p>{time_html}"
            f"<h3>Why this one</h3><p id='why'>{_e(why)}</p>"
            f"<table class='cfg' id='best-config'>{rows}</table>"
            f"{use_text}")


def _trials_table(summary: StudySummary) -> str:
    from autobalance._config import describe_config

    spread_head = "<th>spread</th>" if summary.multi_rank else ""
    peak_head = "peak per rank" if summary.multi_rank else "peak"
    with_optimizer = any(r.optimizer_state_gib for r in summary.rows)  # studies from before: no column
    with_time = summary.multi_rank and any(r.busy_ms for r in summary.rows)
    spread_head += ("<th title='optimizer state each rank keeps (zero1: its share)'>optimizer state per rank</th>"
                    if with_optimizer else "")
    extra_head = ("<th title='each rank: its own work per step / its wait at the gradient all-reduce'>busy/wait ms "
                  "per rank</th>" if with_time else "")
    head = ("<table class='trials' id='trials'><thead><tr><th>#</th><th>outcome</th><th>configuration</th>"
            f"<th>{peak_head}</th>{spread_head}<th>step ms</th><th>compile s</th>"
            "<th title='seconds the slowest rank spent in warm-up and measured steps'>time in steps s</th>"
            f"{extra_head}</tr></thead><tbody>")
    body = []
    for r in summary.rows:
        classes = []
        if summary.best is not None and r.number == summary.best.number:
            classes.append("chosen")
        elif r.failed_memory or r.status != Status.OK:
            classes.append("bad")
        if r.predicted:
            classes.append("predicted")
        cls = f" class='{' '.join(classes)}'" if classes else ""
        peaks = " ".join(memory_text(p) for p in r.peaks_gib) or "-"
        if r.predicted and peaks != "-":
            peaks = f"{peaks} (predicted)"
        elif r.status == Status.OOM and peaks != "-":
            peaks = f"{peaks} (at least)"
        spread = f"<td>{memory_text(_spread(r))}</td>" if summary.multi_rank else ""
        if with_optimizer:
            state = " ".join(memory_text(v) for v in r.optimizer_state_gib) or "-"
            spread += f"<td>{_e(('zero1: ' if r.optimizer_sharding == 'zero1' and r.optimizer_state_gib else '') + state)}</td>"
        extra = f"<td>{_e(busy_wait_text(r.busy_ms, r.wait_ms))}</td>" if with_time else ""
        outcome = r.outcome + (" (chosen)" if "chosen" in classes else "")
        body.append(f"<tr{cls}><td>{_e(r.label)}</td><td title='{_e(r.reason or '')}'>{_e(outcome)}</td>"
                    f"<td>{_e(describe_config(r.config) if r.config else '-')}</td>"
                    f"<td>{_e(peaks)}</td>{spread}<td>{_num(r.step_ms, '.1f')}</td><td>{_num(r.compile_s, '.1f')}</td>"
                    f"<td>{_num(r.time_in_steps_s, '.2f')}</td>{extra}</tr>")
    return head + "".join(body) + "</tbody></table>"


def _compile_text(summary: StudySummary) -> str:
    rows = [r for r in summary.rows if r.compile_s is not None and r.reused_from is None]
    if not rows:
        return "<p class='meta' id='compile-note'>No trial compiled (torch.compile was off throughout).</p>"
    times = sorted(float(r.compile_s) for r in rows)  # type: ignore[arg-type]
    total = summary.compile_total_s if summary.compile_total_s is not None else sum(times)
    hits = sum(1 for r in rows if r.compile_cache_hit)
    return (f"<p class='meta' id='compile-note'>{len(rows)} compiled trial(s) spent {total:.0f} s compiling in all "
            f"(median {times[len(times) // 2]:.1f} s, longest {times[-1]:.1f} s); {hits} came from the Inductor cache. "
            "Step times exclude the compiling step.</p>")


_STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; } h3 { font-size: 1em; }
table { border-collapse: collapse; margin: 8px 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; }
thead th { background: #f4f4f4; } tr.bad td { color: #b00; } tr.chosen td { background: #fff6cc; font-weight: bold; }
tr.predicted td { font-style: italic; color: #a55; }
table.cfg th { font-weight: normal; color: #555; }
.meta { color: #555; } .warn { color: #b00; } code { font-size: 0.95em; } #why { max-width: 70em; line-height: 1.4; }
"""


def build_report(study: Any, *, output_html: str, png_dir: str | None = None,
                 storage_url: str | None = None, saved_trial: SavedTrial = "unknown") -> ReportFiles:
    """Write the study's report to ``output_html`` (and PNGs to ``png_dir``); returns the paths.
    ``storage_url`` (masked) fills the commands the report suggests. ``saved_trial``: the trial the
    store holds for the study (None: nothing saved): a best that is not it reads ``Best measured (not
    saved: failed verification)``, with no "Use it" line."""
    import plotly.io as pio

    from autobalance.report._figures import (
        compile_figure,
        factors_figure,
        importance_figure,
        memory_figure,
        time_memory_figure,
        tradeoff_figure,
    )
    from autobalance.report._importance import param_importances

    summary = summarize(study, storage_url=storage_url)
    importances, note = param_importances(study)
    config = {"displaylogo": False, "responsive": True}
    first = True

    def chart(div_id: str, fig: Any) -> str:
        nonlocal first
        text = pio.to_html(fig, full_html=False, include_plotlyjs=first, div_id=div_id, config=config,
                           include_mathjax=False)
        first = False
        return str(text)

    time_memory = chart("time-memory-chart", time_memory_figure(summary))
    factors = factors_figure(summary)
    factors_html = (chart("factors-chart", factors) if factors is not None else
                    "<p class='meta' id='factors-note'>No setting varied across the measured trials.</p>")
    comp = compile_figure(summary)
    compile_html = _compile_text(summary) + (chart("compile-chart", comp) if comp is not None else "")
    memory = chart("memory-chart", memory_figure(summary))
    spread_html = ""
    if summary.multi_rank:
        spread_html = f"<h2>Step time versus spread</h2>\n{chart('tradeoff-chart', tradeoff_figure(summary))}"
    importance_html = (chart("importance-chart", importance_figure(importances)) if importances else
                       f"<p class='meta' id='importance-note'>Parameter importances: {_e(note)}.</p>")
    device = summary.device
    meta = (f"{len(summary.rows)} trials; objective {', '.join(summary.directions)} "
            f"{'(' + ', '.join(summary.metric_names) + ')' if summary.metric_names else ''}; "
            f"device {device.get('name', '?')} ({device.get('type', '?')}); world size "
            f"{summary.world_size}; generated "
            f"{datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}")
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>autobalance report: {_e(summary.name)}</title>
<style>{_STYLE}</style></head><body>
<h1>autobalance report: study <code>{_e(summary.name)}</code></h1>
<p class="meta">{_e(meta)}</p>
{f'<p class="meta" id="exchange-rate">{_e(summary.exchange_rate)}</p>' if summary.exchange_rate else ''}
{_best_config(summary, saved_trial)}
<h2>Baseline versus best</h2>
{_comparison(summary)}
<h2>Step time versus peak memory</h2>
<p class="meta">One marker per rank and trial (a trial's ranks joined by a grey line); red x: over the usable limit.
Triangles above: trials without a step time at their peak (out of memory: a lower bound; hollow: predicted, never run).</p>
{time_memory}
<h2>What the settings did to step time</h2>
{factors_html}
<h2>Compile cost</h2>
{compile_html}
<h2>Peak memory per rank</h2>
<p class="meta">Bars: each rank's peak device memory (allocator reserved + memory outside PyTorch). Lines: capacity
and the usable limit (capacity minus headroom). Crossed bars and red marks: out of memory or over the usable limit;
pale hatched bars: predicted, never run.</p>
{memory}
{spread_html}
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
    return ReportFiles(html=os.path.abspath(output_html), pngs=pngs, importance_note=note,
                       best_trial=None if summary.best is None else summary.best.number,
                       not_saved=not_saved_reason(summary, saved_trial))
