"""``autobalance report``, ``dashboard`` and ``diagnose``: seeing the imbalance."""

from __future__ import annotations

from typing import Any

import typer

from autobalance.cli._common import (
    console,
    existing_storage,
    parse_floats,
    parse_list,
    quiet_optuna,
    run_command,
)

commands = typer.Typer()
_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}


def saved_trial(url: str, study_name: str) -> int | None:
    """The trial the store holds as ``study_name``'s best configuration (None: nothing saved)."""
    from autobalance._errors import StudyNotFoundError
    from autobalance.store import ConfigStore

    with ConfigStore(url=url) as store:
        try:
            return store.load(study_name).trial_number
        except StudyNotFoundError:
            return None


@commands.command(short_help="Write an offline HTML report of a study.")
def report(
    study_name: str | None = typer.Option(None, "--study-name", show_default=False,
                                          help="Study to report on (default: the only one in the storage, or the "
                                               "most recently tuned)."),
    storage: str = typer.Option("sqlite:///autobalance.db", help="Study database URL."),
    output: str = typer.Option("report.html", "-o", "--output", help="HTML file to write (one offline file)."),
    png: str | None = typer.Option(None, "--png", help="Also write static PNG charts into this directory."),
) -> None:
    """Write one offline HTML file: why the chosen trial won, step time vs peak memory, what dtype/compile/budget/
    micro-batch did, compile cost, per-rank peaks per trial, baseline vs best, importances."""

    def go() -> None:
        from autobalance.cli._study import resolve_study_name
        from autobalance.report import build_report
        from autobalance.store import check_storage, load_study, mask_url

        quiet_optuna()
        url = check_storage(existing_storage(storage))
        name = resolve_study_name(study_name, url, say=lambda line: typer.echo(line, err=True))
        study = load_study(study_name=name, storage_url=url)
        files = build_report(study, output_html=output, png_dir=png, storage_url=mask_url(url),
                             saved_trial=saved_trial(url, name))
        typer.echo(f"Wrote {files.html}")
        if files.not_saved:
            typer.echo(f"Best measured: trial {files.best_trial} (not saved: {files.not_saved}); the report gives no "
                       "\"Use it\" line for it.")
        for path in files.pngs:
            typer.echo(f"Wrote {path}")

    run_command(go)


@commands.command(short_help="Start optuna-dashboard on the studies.")
def dashboard(
    storage: str = typer.Option("sqlite:///autobalance.db", help="Study database URL."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (127.0.0.1: this machine only)."),
    port: int = typer.Option(8080, help="Port to listen on."),
) -> None:
    """Start optuna-dashboard on the studies, with each trial's per-rank memory chart as an artifact."""

    def go() -> None:
        from autobalance.report import serve_dashboard
        from autobalance.store import check_storage

        quiet_optuna()
        url = check_storage(storage)
        serve_dashboard(url, host=host, port=port, echo=lambda text: typer.echo(text),
                        warn=lambda text: typer.echo(text, err=True))

    run_command(go)


def diagnose_caps(memory_cap: str | None, memory_cap_gib: str | None) -> tuple[list[float] | None, str | None]:
    """``diagnose``'s cap flags: the caps in GiB and the same as ``tune --memory-cap`` takes them
    (``20GiB``; plain GiB become ``61.5MiB``), or (None, None) without a cap."""
    from autobalance._errors import UsageError
    from autobalance.tuner import memory_cap_text, parse_memory_cap

    if memory_cap is not None and memory_cap_gib is not None:
        raise UsageError(f"--memory-cap={memory_cap} and --memory-cap-gib={memory_cap_gib} both given; keep one of them.")
    if memory_cap is not None:
        items = parse_list("--memory-cap", memory_cap) or []
        return parse_memory_cap("--memory-cap", items), ",".join(items)
    caps = parse_floats("--memory-cap-gib", memory_cap_gib)
    if caps is None:
        return None, None
    if any(c <= 0 for c in caps):
        raise UsageError(f"--memory-cap-gib={memory_cap_gib} has a non-positive value; use GiB > 0.")
    return caps, ",".join(memory_cap_text(c) for c in caps)


def paste_line(diag: Any, *, cap_text: str | None) -> tuple[str, str]:
    """What to tune with after a diagnosis: one line saying which cap and why, and the command itself.

    The cap diagnose ran under, if any; else on a GPU none (the card's own memory is the cap; a smaller
    card is named or sized); on CPU, where no cap means the host's whole memory, the smallest cap that
    the script's own configuration fits under with ``tune``'s default headroom."""
    from autobalance.diagnose import tune_command
    from autobalance.protocol import memory_text
    from autobalance.tuner import memory_cap_text, setting_docs

    def command(cap: str | None) -> str:
        return tune_command(script=diag.script, script_args=diag.script_args, nproc_per_node=diag.world_size,
                            device=diag.device, memory_cap=cap)

    if cap_text:
        return f"To tune under the same cap ({cap_text} per rank), paste:", command(cap_text)
    if diag.device == "cuda":
        return ("To tune for this card, paste (no --memory-cap: the card's own memory is the cap; for a smaller "
                "card add --memory-cap 20GiB or its name, e.g. --memory-cap A100-40GB):", command(None))
    peaks = [r.peak_device for r in diag.ranks if r.peak_device]
    if not peaks:
        return "To tune, paste (no --memory-cap: the host's memory is the cap):", command(None)
    headroom = float(setting_docs()["headroom"].value)
    cap = memory_cap_text(max(peaks) / (1 - headroom) / 2**30)
    return (f"To tune under the smallest cap this configuration fits (its largest peak, {memory_text(max(peaks) / 2**30)}, "
            f"and tune's {headroom:.0%} headroom; lower it for a smaller memory, e.g. one the script's own split "
            "does not fit), paste:", command(cap))


@commands.command(short_help="One run with a per-rank memory breakdown and causes.", context_settings=_CONTEXT)
def diagnose(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="Training script that uses autobalance.plan(); its own arguments follow."),
    nproc_per_node: int = typer.Option(2, "--nproc-per-node", help="Ranks (one per GPU)."),
    device: str | None = typer.Option(None, help="cpu or cuda.", show_default="cuda when a GPU is visible, else cpu"),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    memory_cap: str | None = typer.Option(None, "--memory-cap", metavar="SIZE|GPU[,...]",
                                          help="Emulated capacity per rank: 20GiB, 60MiB or a GPU such as A100-40GB."),
    memory_cap_gib: str | None = typer.Option(None, "--memory-cap-gib", help="Emulated capacity in GiB: X or X,Y,... per rank."),
    steps: int = typer.Option(2, help="Measured optimizer steps."),
    warmup: int = typer.Option(1, help="Warm-up optimizer steps (the breakdown is taken on the first)."),
    trial_timeout: float = typer.Option(300.0, "--trial-timeout", help="Seconds for the run, start-up included."),
    runs_dir: str = typer.Option("autobalance_runs", "--runs-dir", help="Where the reports and logs go."),
) -> None:
    """One short run at the script's own configuration: per-rank memory breakdown and likely causes."""

    def go() -> None:
        import json

        from autobalance._errors import UsageError
        from autobalance.diagnose import print_diagnosis, run_diagnose
        from autobalance.tuner import default_device

        dev = device or default_device()
        if dev not in ("cpu", "cuda"):
            raise UsageError(f"--device={dev!r} is not supported; use cpu or cuda.")
        if dev == "cuda":
            import torch

            if nproc_per_node > torch.cuda.device_count():
                raise UsageError(f"--nproc-per-node={nproc_per_node} is larger than the {torch.cuda.device_count()} "
                                 "visible GPU(s).")
        caps_gib, cap_text = diagnose_caps(memory_cap, memory_cap_gib)
        err = console(stderr=True)
        if not as_json:
            err.print(f"Running {script} at its own configuration on {nproc_per_node} {dev} rank(s)...")
        diag = run_diagnose(
            script=script, script_args=list(ctx.args), nproc_per_node=nproc_per_node, device=dev,
            memory_cap_gib=caps_gib, memory_cap_text=cap_text, steps=steps, warmup=warmup,
            timeout_s=trial_timeout, runs_dir=runs_dir,
        )
        if as_json:
            typer.echo(json.dumps(diag.to_dict(), indent=1, default=str))
        else:
            out = console()
            print_diagnosis(diag, console=out)
            what, command = paste_line(diag, cap_text=cap_text)
            out.print(what, markup=False)
            out.print(command, markup=False, soft_wrap=True)  # the last line: the command to paste, never wrapped

    run_command(go)
