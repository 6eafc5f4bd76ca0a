"""Tables printed by the CLI."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autobalance._config import describe_config
from autobalance.cli._common import console
from autobalance.protocol import (
    Status,
    TrialAttr,
    busy_wait_text,
    memory_text,
    over_limit,
    speed_up,
    study_ranks,
    time_in_steps_s,
    trial_ranks,
)


def print_studies(storage_url: str) -> None:
    import optuna

    from autobalance.store import list_studies, mask_url, open_storage

    storage = open_storage(storage_url, heartbeat=False)
    names = list_studies(storage)
    out = console()
    if not names:
        out.print(f"No studies in {mask_url(storage_url)}. Start one with `autobalance tune SCRIPT`.")
        return
    from autobalance.protocol import best_trial, is_feasible

    rows, any_spread = [], False
    for name in names:
        study = optuna.load_study(study_name=name, storage=storage)
        ts = study.get_trials(deepcopy=False)
        best = best_trial(study)
        spread = study_ranks(study) > 1  # one rank: no spread to show
        any_spread = any_spread or spread
        rows.append([
            name, str(len(ts)), str(sum(t.state.name == "COMPLETE" for t in ts)),
            str(sum(is_feasible(t) for t in ts)),
            f"{best.user_attrs.get('step_time_ms', 0):.1f}" if best else "-",
            memory_text(best.user_attrs.get('spread_gib', 0)) if best and spread else "-",
        ])
    table = Table(title=f"Studies in {mask_url(storage_url)}")
    columns = ["study", "trials", "complete", "feasible", "best step (ms)", "best spread"]
    for col in columns[:None if any_spread else -1]:
        table.add_column(col)
    for row in rows:
        table.add_row(*row[:None if any_spread else -1])
    out.print(table)


def trial_rows(study: Any) -> list[dict[str, Any]]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        rows.append({
            "number": t.number, "state": t.state.name, "status": a.get(TrialAttr.STATUS), "baseline": a.get(TrialAttr.BASELINE, False),
            "feasible": a.get(TrialAttr.FEASIBLE), "config": a.get(TrialAttr.CONFIG), "peak_device_gib": a.get(TrialAttr.PEAK_DEVICE_GIB),
            "usable_gib": a.get(TrialAttr.USABLE_GIB), "over_limit": over_limit(a),
            "spread_gib": a.get(TrialAttr.SPREAD_GIB), "step_time_ms": a.get(TrialAttr.STEP_TIME_MS),
            "measured_steps": a.get(TrialAttr.MEASURED_STEPS), "time_in_steps_s": time_in_steps_s(a), "wall_s": a.get(TrialAttr.WALL_S),
            "values": t.values, "reason": a.get(TrialAttr.REASON),
            "busy_ms": a.get(TrialAttr.BUSY_MS), "allreduce_wait_ms": a.get(TrialAttr.WAIT_MS),
            "optimizer_state_bytes": a.get(TrialAttr.OPTIMIZER_STATE_BYTES),
        })
    return rows


def feasible_text(row: dict[str, Any]) -> str:
    """The trials table's ``feasible`` column: ``yes``, ``no``, or for a trial that ran to the end
    over a limit ``no: over the usable limit (rank 0: 0.014 GiB > 0.0138 GiB usable)``; ``-`` while
    a trial has no verdict (running, failed)."""
    if row["feasible"] is None:
        return "-"
    if row["feasible"]:
        return "yes"
    return "no" if row["over_limit"] is None else f"no: {row['over_limit']}"


def print_trials(*, study_name: str, storage: str, as_json: bool) -> None:
    from autobalance.store import load_study

    study = load_study(study_name=study_name, storage_url=storage)
    rows = trial_rows(study)
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    many = study_ranks(study) > 1  # one rank: a peak, no spread
    with_optimizer = any(r["optimizer_state_bytes"] for r in rows)  # studies from before: as they were
    with_time = many and any(r["busy_ms"] for r in rows)
    table = Table(title=f"Trials of {study_name}")
    for col in ("#", "state", "status", "feasible", "configuration", "peak per rank" if many else "peak",
                *(["spread"] if many else []), *(["optimizer state" + (" per rank" if many else "")] if with_optimizer else []),
                "step ms", *(["busy/wait ms per rank"] if with_time else []), "objective"):
        table.add_column(col)
    for r in rows:
        peaks = r["peak_device_gib"] or []
        spread = [memory_text(r["spread_gib"])] if many else []
        if with_optimizer:
            spread.append(optimizer_state_text(r["optimizer_state_bytes"], r["config"]))
        time = [busy_wait_text(r["busy_ms"] or [], r["allreduce_wait_ms"] or [])] if with_time else []
        table.add_row(
            f"{r['number']}{' (baseline)' if r['baseline'] else ''}", r["state"], r["status"] or "-",
            feasible_text(r),
            describe_config(r["config"]) if r["config"] else "-",
            " ".join(memory_text(p) for p in peaks) or "-",
            *spread,
            "-" if r["step_time_ms"] is None else f"{r['step_time_ms']:.1f}",
            *time,
            "-" if not r["values"] else " ".join(f"{v:.4g}" for v in r["values"]),
        )
    console().print(table)
    if with_time:
        console().print("busy/wait: each rank's own work per step and its wait at the gradient all-reduce (ms); "
                        "the rank that waits least is the slowest.")
    print_reasons(rows)


def print_reasons(rows: list[dict[str, Any]]) -> None:
    """Each trial that did not end ``ok``, with its whole reason (tune's console line cuts it short)."""
    failed = [r for r in rows if r["reason"] and r["status"] not in (None, Status.OK)]
    if not failed:
        return
    out = console()
    out.print("Why trials did not end ok:")
    for r in failed:
        out.print(f"  trial {r['number']} ({r['status']}): {' '.join(str(r['reason']).split())}", markup=False,
                  soft_wrap=True)


def optimizer_state_text(state_bytes: list[Any] | None, config: dict[str, Any] | None) -> str:
    """Each rank's optimizer state (``12.0 MiB 12.0 MiB``; ``zero1: 4.00 MiB 20.0 MiB``: each rank keeps
    its share); ``-`` when not measured."""
    if not state_bytes:
        return "-"
    text = " ".join(memory_text(None if b is None else b / 2**30) for b in state_bytes)
    return ("zero1: " if (config or {}).get("optimizer_sharding") == "zero1" else "") + text


def comparison_table(baseline: Any, best: Any, *, not_saved: str = "") -> Table:
    """The baseline and the best side by side: each rank's peak, the spread (two ranks or more), the
    step time and the speed-up (claimed only beyond the steps' noise: :func:`~autobalance.protocol.speed_up`).
    ``not_saved``: why the best was not saved (its column then reads ``best measured (not saved: ...)``)."""
    table = Table(title="Baseline (the script's own configuration) vs best")
    table.add_column("")
    table.add_column(f"baseline #{baseline.number}" if baseline else "baseline")
    label = f"best measured (not saved: {not_saved})" if not_saved else "best"
    table.add_column(f"{label} #{best.number}" if best else label)
    b = baseline.user_attrs if baseline else {}
    t = best.user_attrs if best else {}
    table.add_row("configuration", describe_config(b.get("config")) if b else "-", describe_config(t.get("config")) if t else "-")
    table.add_row("status", _status(b), _status(t))
    peaks_b, peaks_t = b.get("peak_device_gib") or [], t.get("peak_device_gib") or []
    many = max(trial_ranks(b), trial_ranks(t)) > 1  # one rank: its peak, no spread
    for r in range(max(len(peaks_b), len(peaks_t))):
        fb = peaks_b[r] if r < len(peaks_b) else None
        ft = peaks_t[r] if r < len(peaks_t) else None
        table.add_row(f"rank {r} peak" if many else "peak", memory_text(fb), memory_text(ft))
    if many:
        table.add_row("spread", memory_text(b.get("spread_gib")), memory_text(t.get("spread_gib")))
    table.add_row("step time (ms)", _fmt(b.get("step_time_ms"), ".1f"), _fmt(t.get("step_time_ms"), ".1f"))
    if b.get("step_time_ms") and t.get("step_time_ms"):
        gain = speed_up(baseline_ms=b["step_time_ms"], baseline_iqr_pct=b.get("step_time_iqr_pct"),
                        best_ms=t["step_time_ms"], best_iqr_pct=t.get("step_time_iqr_pct"))
        table.add_row("speed-up", "1.00x", gain.text())
    return table


def baseline_misfit(baseline: Any, best: Any) -> str | None:
    """The line under the comparison when the script's own configuration does not fit (the demo's, by
    design): why, and why there is no speed-up row. None when it fits or either trial is missing."""
    b = baseline.user_attrs if baseline else {}
    if not (b and best) or b.get("feasible") is not False:
        return None
    why = over_limit(b) or str(b.get("status"))
    return (f"The script's own configuration does not fit ({why}); the best does, with the same global batch"
            + ("." if b.get("step_time_ms") else ": no baseline step time, no speed-up."))


def _status(attrs: dict[str, Any]) -> str:
    """A trial's status, and for one that ran to the end over a limit, which limit."""
    over = over_limit(attrs)
    return str(attrs.get("status", "-")) + ("" if over is None else f", {over}")


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def not_saved_reason(result: Any, *, rejected: list[int] | tuple[int, ...] = ()) -> str:
    """Why ``tune`` saved nothing although it has a best trial (``failed verification`` when that
    trial is among ``rejected``); empty when it saved one or has none."""
    if result.best is None or result.saved:
        return ""
    return "failed verification" if result.best.number in rejected else "see above"


def print_result(result: Any, *, settings: Any, console: Console, nothing_feasible: str = "",
                 rejected: list[int] | tuple[int, ...] = ()) -> None:
    """Tune's summary: the comparison, where the time went, the notes, and how to see and use the
    result (no "Use it" line when nothing was saved: the best column then says why)."""
    not_saved = not_saved_reason(result, rejected=rejected)
    hint = getattr(result, "rerun_hint", lambda: None)()  # a TuneResult; None: trials ran, or more were left
    if hint:
        console.print(hint)
    console.print(comparison_table(result.baseline, result.best, not_saved=not_saved))
    misfit = baseline_misfit(result.baseline, result.best)
    if misfit:
        console.print(misfit)
    console.print(f"{result.trials_run} trial(s) launched in {result.wall_s:.1f} s. Study '{result.study_name}' "
                  f"lives in {result.storage}.")
    for line in getattr(result, "time_lines", list)():  # where the time went; the time budget (a TuneResult)
        console.print(line)
    if result.best is None:
        console.print(f"[red]No feasible configuration yet[/]: {escape(nothing_feasible or 'no trial was feasible.')}")
        return
    for note in result.notes:
        console.print(note)
    if not result.saved:
        console.print(f"[red]Best measured (not saved: {not_saved})[/]: trial {result.best.number}. No configuration was "
                      "saved: nothing to use in production (it would run the script's own configuration); the study "
                      "keeps every trial.")
    console.print(f"See it: autobalance dashboard --storage {result.storage}   (per-rank charts per trial), or "
                  f"autobalance report --study-name {result.study_name} --storage {result.storage} -o report.html")
    if not result.saved:
        return
    console.print(
        f"Use it in production: AUTOBALANCE_STUDY={result.study_name} AUTOBALANCE_STORAGE={result.storage} "
        f"torchrun ... {settings.script}   (or `autobalance export --study-name {result.study_name} -o best.json` "
        "and AUTOBALANCE_CONFIG_FILE=best.json)"
    )


def _speedup_text(fig: dict[str, Any]) -> str:
    """The saved speed-up as the other outputs write it, by :func:`~autobalance.protocol.speed_up`
    (claimed only beyond the steps' variation); the stored number when the steps are missing."""
    base = fig.get("baseline") or {}
    if base.get("step_time_ms") and fig.get("step_time_ms"):
        return speed_up(baseline_ms=base["step_time_ms"], baseline_iqr_pct=base.get("step_time_iqr_pct"),
                        best_ms=fig["step_time_ms"], best_iqr_pct=fig.get("step_time_iqr_pct")).text()
    return str(fig["speedup_vs_baseline"])


def saved_figure_rows(fig: dict[str, Any], *, world_size: int) -> list[tuple[str, str]]:
    """The saved figures as ``best``'s table rows: plain labels (``rank 0 peak``, ``spread``, ``step time``,
    ``speed-up``), each value in the unit it is written in (``10.0 MiB``, ``68.5 ms``); the stored keys
    (``peak_device_gib``, in GiB) are what ``--format json`` shows."""
    rows: list[tuple[str, str]] = []
    peaks = fig.get("peak_device_gib")
    if isinstance(peaks, list):
        many = len(peaks) > 1
        rows += [(f"rank {r} peak" if many else "peak", memory_text(v)) for r, v in enumerate(peaks)]
    elif peaks is not None:
        rows.append(("peak", memory_text(peaks)))
    if fig.get("spread_gib") is not None and world_size > 1:  # one rank: no spread
        rows.append(("spread", memory_text(fig["spread_gib"])))
    spread = fig.get("step_time_spread")  # saved with its spread (older records: the step time alone)
    if isinstance(spread, dict) and spread.get("step_time_ms") is not None:
        from autobalance.tuner import spread_text

        rows.append(("step time", spread_text(spread)))
    elif fig.get("step_time_ms") is not None:
        rows.append(("step time", f"{fig['step_time_ms']:.1f} ms"))
    if fig.get("speedup_vs_baseline") is not None:
        rows.append(("speed-up vs baseline", _speedup_text(fig)))
    return rows


def print_saved(saved: Any, *, fmt: str) -> None:
    data = saved.to_dict()
    if fmt == "json":
        print(json.dumps(data, indent=2, default=str))
        return
    if fmt == "yaml":
        import yaml

        print(yaml.safe_dump(json.loads(json.dumps(data, default=str)), sort_keys=False))
        return
    table = Table(title=f"Best configuration of '{saved.study_name}' (trial {saved.trial_number})")
    table.add_column("field")
    table.add_column("value")
    cfg = saved.config
    # the one notation of every output, a rank per line: micro-batches of one optimizer step, then the
    # checkpointed blocks' indices (or the compile budget); `--format json` gives the stored fields
    ranks, shared = describe_config(cfg).split(" | ")
    table.add_row("configuration", ranks.replace("; ", "\n") + "\n" + shared)
    table.add_row("global batch", f"{cfg.global_batch} samples per optimizer step, "
                                  f"{cfg.accumulation} micro-step(s) per rank")
    fig = saved.figures
    fp = saved.fingerprint
    for label, text in saved_figure_rows(fig, world_size=fp.world_size):
        table.add_row(label, text)
    table.add_row("hardware", f"{fp.world_size} x {fp.device_name} ({fp.device_type})")
    table.add_row("saved", f"{saved.created_at} by {saved.saved_by}")
    console().print(table)
