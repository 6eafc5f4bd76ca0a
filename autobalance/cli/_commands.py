"""The commands. Each parses its flags, then calls into the tuner, store or launcher."""

from __future__ import annotations

from typing import Any

import typer

from autobalance._errors import UsageError
from autobalance.cli._common import console, existing_storage, run_command
from autobalance.cli._options import settings_from_command_line, with_settings_options

commands = typer.Typer()
_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}
STUDY_HELP = "Study to show (default: the only one in the storage, or the most recently tuned)."


@commands.command(short_help="Tune a training script over short real torchrun trials.", context_settings=_CONTEXT)
@with_settings_options
def tune(ctx: typer.Context, config: str | None = None, **values: Any) -> None:
    """Tune a training script: each trial is a short real torchrun run of one configuration.

    Multi-node trials: --nnodes N --rdzv-endpoint HOST:PORT here, `autobalance worker` on each other node."""

    def go() -> None:
        from autobalance.cli._tune import run_tune

        run_tune(flags=settings_from_command_line(ctx, values), config_path=config)

    run_command(go)


@commands.command(short_help="List the studies in a storage.")
def studies(storage: str = typer.Option("sqlite:///autobalance.db", help="Study database URL.")) -> None:
    """List the studies in a storage."""

    def go() -> None:
        from autobalance.cli._views import print_studies

        print_studies(existing_storage(storage))

    run_command(go)


@commands.command(short_help="Show a study's trials: configuration, peaks, step time.")
def trials(
    study_name: str | None = typer.Option(None, "--study-name", help=STUDY_HELP, show_default=False),
    storage: str = typer.Option("sqlite:///autobalance.db"),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """A table of a study's trials: configuration, per-rank peak memory, spread, step time, state."""

    def go() -> None:
        from autobalance.cli._study import resolve_study_name
        from autobalance.cli._views import print_trials

        url = existing_storage(storage)
        name = resolve_study_name(study_name, url, say=lambda line: typer.echo(line, err=True))
        print_trials(study_name=name, storage=url, as_json=as_json)

    run_command(go)


@commands.command(short_help="Verify a chosen trial, then save it as the best.", context_settings=_CONTEXT)
def promote(
    ctx: typer.Context,
    study_name: str = typer.Option(..., "--study-name"),
    trial: int = typer.Option(..., "--trial", help="Trial number to save as the study's best."),
    storage: str = typer.Option("sqlite:///autobalance.db"),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Verify the trial (same update as the baseline) before saving it, as `tune` does."),
    script: str | None = typer.Option(None, "--script", help="The training script to verify with (default: the one the study's latest `tune` ran; its arguments follow --)."),
) -> None:
    """Save a chosen trial (e.g. a point of the Pareto front) as the study's best configuration.

    Like the end of `tune`, the trial is verified first (one optimizer step against the script's own
    configuration): a trial that fails is never saved (exit code 1)."""

    def go() -> None:
        from rich.markup import escape

        from autobalance.store import check_storage, load_study
        from autobalance.tuner import promote_trial

        err = console(stderr=True)
        url = check_storage(existing_storage(storage))
        study = load_study(study_name=study_name, storage_url=url)
        saved, line = promote_trial(storage_url=url, study=study, trial_number=trial, verify=verify, script=script,
                                    script_args=list(ctx.args) if ctx.args else None,
                                    note=lambda text: err.print(f"[dim]{escape(text)}[/]"))
        typer.echo(f"Saved trial {saved.trial_number} of '{study_name}' as its best configuration ({line}).")

    run_command(go)


@commands.command(short_help="Print the saved best configuration of a study.")
def best(
    study_name: str | None = typer.Option(None, "--study-name", help=STUDY_HELP, show_default=False),
    storage: str = typer.Option("sqlite:///autobalance.db"),
    format: str = typer.Option("table", "--format", help="table, json or yaml."),
) -> None:
    """Print the saved best configuration of a study."""

    def go() -> None:
        from autobalance.cli._views import print_saved
        from autobalance.store import ConfigStore, check_storage

        if format not in ("table", "json", "yaml"):
            raise UsageError(f"--format={format!r} is unknown; use table, json or yaml.")
        from autobalance.cli._study import resolve_study_name

        url = check_storage(existing_storage(storage))
        name = resolve_study_name(study_name, url, saved=True, say=lambda line: typer.echo(line, err=True))
        with ConfigStore(url=url) as store:
            print_saved(store.load(name), fmt=format)

    run_command(go)


@commands.command(short_help="Write the saved best configuration to a JSON file.")
def export(
    study_name: str | None = typer.Option(None, "--study-name", help=STUDY_HELP, show_default=False),
    output: str = typer.Option(..., "-o", "--output", help="File to write (JSON) for AUTOBALANCE_CONFIG_FILE."),
    storage: str = typer.Option("sqlite:///autobalance.db"),
) -> None:
    """Write the saved best configuration to a JSON file that plan() loads without a database."""

    def go() -> None:
        from autobalance._config import describe_config
        from autobalance.cli._study import resolve_study_name
        from autobalance.store import ConfigStore, check_storage, export_file

        url = check_storage(existing_storage(storage))
        name = resolve_study_name(study_name, url, saved=True, say=lambda line: typer.echo(line, err=True))
        with ConfigStore(url=url) as store:
            saved = store.load(name)
            path = export_file(saved, output)
        typer.echo(f"Wrote {path}. Use it with AUTOBALANCE_CONFIG_FILE={path} torchrun ...")
        typer.echo(f"It applies: {describe_config(saved.config)}")

    run_command(go)
