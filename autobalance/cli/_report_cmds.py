"""``autobalance report``, ``dashboard`` and ``diagnose``: seeing the imbalance."""

from __future__ import annotations

import typer

from autobalance.cli._common import console, parse_floats, quiet_optuna, run_command

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
    study_name: str = typer.Option(..., "--study-name", help="Study to report on."),
    storage: str = typer.Option("sqlite:///autobalance.db", help="Study database URL."),
    output: str = typer.Option("report.html", "-o", "--output", help="HTML file to write (one offline file)."),
    png: str | None = typer.Option(None, "--png", help="Also write static PNG charts into this directory."),
) -> None:
    """Write one offline HTML file: why the chosen trial won, step time vs peak memory, what dtype/compile/budget/
    micro-batch did, compile cost, per-rank peaks per trial, baseline vs best, importances."""

    def go() -> None:
        from autobalance.report import build_report
        from autobalance.store import check_storage, load_study, mask_url

        quiet_optuna()
        url = check_storage(storage)
        study = load_study(study_name=study_name, storage_url=url)
        files = build_report(study, output_html=output, png_dir=png, storage_url=mask_url(url),
                             saved_trial=saved_trial(url, study_name))
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


@commands.command(short_help="One run with a per-rank memory breakdown and causes.", context_settings=_CONTEXT)
def diagnose(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="Training script that uses autobalance.plan(); its own arguments follow."),
    nproc_per_node: int = typer.Option(2, "--nproc-per-node", help="Ranks (one per GPU)."),
    device: str | None = typer.Option(None, help="cpu or cuda.", show_default="cuda when a GPU is visible, else cpu"),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    memory_cap_gib: str | None = typer.Option(None, "--memory-cap-gib", help="Emulated capacity: X or X,Y,... per rank."),
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
        err = console(stderr=True)
        if not as_json:
            err.print(f"Running {script} at its own configuration on {nproc_per_node} {dev} rank(s)...")
        diag = run_diagnose(
            script=script, script_args=list(ctx.args), nproc_per_node=nproc_per_node, device=dev,
            memory_cap_gib=parse_floats("--memory-cap-gib", memory_cap_gib), memory_cap_text=memory_cap_gib, steps=steps, warmup=warmup,
            timeout_s=trial_timeout, runs_dir=runs_dir,
        )
        if as_json:
            typer.echo(json.dumps(diag.to_dict(), indent=1, default=str))
        else:
            print_diagnosis(diag, console=console())

    run_command(go)
