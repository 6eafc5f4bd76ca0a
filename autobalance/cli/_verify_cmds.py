"""``autobalance verify``: one optimizer step of a tuned configuration against the script's own."""

from __future__ import annotations

import json

import typer

from autobalance._errors import EXIT_FAILURE
from autobalance.cli._common import console, existing_storage, run_command

commands = typer.Typer()
_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}


@commands.command(short_help="Check a configuration computes the baseline's update.", context_settings=_CONTEXT)
def verify(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="The training script the study tuned; its own arguments follow (after --)."),
    study_name: str | None = typer.Option(None, "--study-name", help="Verify this study's best trial (or --trial N)."),
    trial: int | None = typer.Option(None, "--trial", help="Trial number to verify (default: the study's best)."),
    config: str | None = typer.Option(None, "--config", help="Verify this configuration file (JSON, e.g. from `autobalance export`)."),
    storage: str = typer.Option("sqlite:///autobalance.db", help="Study database URL."),
    nproc_per_node: int | None = typer.Option(None, "--nproc-per-node", help="Ranks (default: the configuration's)."),
    device: str | None = typer.Option(None, help="cpu or cuda (default: the study's device)."),
    runs_dir: str = typer.Option("autobalance_runs", "--runs-dir", help="Where the verification runs are kept."),
    trial_timeout: float = typer.Option(300.0, "--trial-timeout", help="Seconds per run, start-up included."),
    cold: bool = typer.Option(False, "--cold", help="One torchrun per run (no warm worker pool)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Prove a configuration computes the baseline's update: same weights, same global batch, one step.

    Always: the configuration's math with both it and the script's own configuration in fp32 - gradients,
    updated parameters and buffers within 1e-6 relative (a loss that is not a per-sample mean fails here,
    whatever the dtype). bf16/fp16: also in its dtype, within 4x the script's own error in that dtype. A model
    with BatchNorm-like layers runs in train mode. When the configuration recomputes (checkpointing, compile
    budget < 1), also with dropout on: the same configuration without recomputation must give the same step.
    Exit code 1 when it fails."""

    def go() -> None:
        from rich.markup import escape
        from rich.table import Table

        from autobalance._config import describe_config
        from autobalance.tuner import run_verify_command

        err = console(stderr=True)
        url = existing_storage(storage) if study_name is not None and config is None else storage
        verdict, cfg, what = run_verify_command(
            script=script, script_args=list(ctx.args), study_name=study_name, storage=url, trial=trial,
            config_file=config, nproc_per_node=nproc_per_node, device=device, runs_dir=runs_dir,
            trial_timeout=trial_timeout, cold=cold, note=lambda text: err.print(f"[dim]{escape(text)}[/]"),
        )
        if as_json:
            print(json.dumps({"what": what, "config": cfg.to_dict(), **verdict.to_dict()}, indent=1))
        else:
            out = console()
            table = Table(title=f"Verification of {what}: {describe_config(cfg)}")
            for col in ("check", "runs", "gradients", "parameters", "buffers", "update (info)", "tolerance", "worst",
                        "result"):
                table.add_column(col)
            for c in verdict.checks:
                tol = "-" if c.tolerance is None else f"{c.tolerance[0]:.1e} / {c.tolerance[1]:.1e}"
                result = "info" if c.tolerance is None else ("pass" if c.passed else "[red]FAIL[/]")
                table.add_row(c.name, f"{c.runs[0]} vs {c.runs[1]}", _figure(c.grad_rel), _figure(c.param_rel),
                              _figure(c.buffer_rel), _figure(c.update_rel), tol, escape(c.worst or "-"), result)
            out.print(table)
            word = "[green]PASS[/]" if verdict.passed else "[red]FAIL[/]"
            out.print(f"{word}: {escape(verdict.reason)} ({verdict.wall_s:.0f} s; runs in "
                          f"{escape(next(iter(verdict.runs.values()), '-').rsplit('/', 1)[0])})")
        if not verdict.passed:
            raise typer.Exit(EXIT_FAILURE)

    run_command(go)


def _figure(value: float) -> str:
    """A relative error for the table: ``inf/nan`` said as ``not finite``."""
    import math

    return f"{value:.2e}" if math.isfinite(value) else "not finite"
