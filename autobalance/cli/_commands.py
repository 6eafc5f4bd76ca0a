"""The commands. Each parses its flags, then calls into the tuner, store or launcher."""

from __future__ import annotations

from typing import Any

import typer

from autobalance._errors import UsageError
from autobalance.cli._app import app, existing_storage, run_command

_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}


def _parse_caps(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--memory-cap-gib={text!r} is not a number or a comma-separated list; e.g. 16 or 16,24.") from None


def _parse_list(name: str, text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise UsageError(f"{name}={text!r} is empty; give a comma-separated list.")
    return items


@app.command(context_settings=_CONTEXT)
def tune(
    ctx: typer.Context,
    script: str | None = typer.Argument(None, help="Training script that uses autobalance.plan() (or `script` in --config); its own arguments follow (after --)."),
    trials: int | None = typer.Option(None, help="Total trials of the study [default: 20]."),
    nproc_per_node: int | None = typer.Option(None, "--nproc-per-node", help="Ranks per node [default: 2]."),
    device: str | None = typer.Option(None, help="cpu or cuda [default: cuda when available]."),
    global_batch: int | None = typer.Option(None, "--global-batch", help="Samples per optimizer step [default: the script's]."),
    steps: int | None = typer.Option(None, help="Measured optimizer steps per trial [default: 3]."),
    warmup: int | None = typer.Option(None, help="Warm-up steps per trial [default: 1]."),
    measure_s: str | None = typer.Option(None, "--measure-s", help="Measure each trial for about this many seconds (at least --steps steps), 0 = exactly --steps, or auto (CUDA: 7/3 of the per-trial overhead, at most 2 s; CPU: 0) [default: auto]."),
    max_steps: int | None = typer.Option(None, "--max-steps", help="Most measured steps per trial when --measure-s lengthens it [default: 50]."),
    storage: str | None = typer.Option(None, help="Study database URL [default: sqlite:///autobalance.db]."),
    study_name: str | None = typer.Option(None, "--study-name", help="[default: derived from the script path]."),
    trial_timeout: float | None = typer.Option(None, "--trial-timeout", help="Seconds per trial, start-up included [default: 300]."),
    memory_cap_gib: str | None = typer.Option(None, "--memory-cap-gib", help="Emulated capacity: X or X,Y,... per rank."),
    headroom: float | None = typer.Option(None, help="Fraction of capacity kept free [default: 0.05]."),
    cap_mode: str | None = typer.Option(None, "--cap-mode", help="enforce (ranks run under the cap, default) or judge (run uncapped, judge peaks against it)."),
    weight_spread: float | None = typer.Option(None, "--weight-spread", help="Weight of the spread (fraction of capacity) [default: 1]."),
    weight_time: float | None = typer.Option(None, "--weight-time", help="Weight of step time / baseline step time [default: 1]."),
    max_spread_gib: float | None = typer.Option(None, "--max-spread-gib", help="Also infeasible: spread above this (GiB)."),
    multi_objective: bool | None = typer.Option(None, "--multi-objective/--single-objective", help="Spread and step time as two objectives."),
    strategy: str | None = typer.Option(None, help="model (memory-model-guided, default) or optuna (sampler alone)."),
    sampler: str | None = typer.Option(None, help="tpe, gp, random or nsga2 [default: tpe]."),
    seed: int | None = typer.Option(None, help="Sampler seed."),
    dtypes: str | None = typer.Option(None, help="AMP dtypes to search, e.g. fp32,bf16 [default: all the device has]."),
    max_accumulation: int | None = typer.Option(None, "--max-accumulation", help="[default: 8]."),
    on_error: str | None = typer.Option(None, "--on-error", help="After successes, a script error: stop (default) or continue."),
    runs_dir: str | None = typer.Option(None, "--runs-dir", help="Trial reports and logs [default: autobalance_runs]."),
    cold: bool | None = typer.Option(None, "--cold", help="One torchrun job per trial (no warm worker pool)."),
    prune_factor: float | None = typer.Option(None, "--prune-factor", help="Stop trials slower than this x the best (0: off) [default: 1.5]."),
    nnodes: int | None = typer.Option(None, help="Nodes per trial (torchrun --nnodes)."),
    node_rank: int | None = typer.Option(None, "--node-rank", help="torchrun --node-rank."),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help="torchrun --rdzv-endpoint HOST:PORT."),
    torchrun_arg: list[str] | None = typer.Option(None, "--torchrun-arg", help="Extra torchrun option (repeatable)."),
    gpus_per_trial: int | None = typer.Option(None, "--gpus-per-trial", help="Run floor(visible GPUs / K) trials at once, each on its own K GPUs."),
    cpus_per_trial: int | None = typer.Option(None, "--cpus-per-trial", help="Run floor(usable cores / K) trials at once, each pinned to its own K cores."),
    compile: str | None = typer.Option(None, "--compile", help="torch.compile in the search: off, on or search [default: search on CUDA, off on CPU]."),
    compile_mode: str | None = typer.Option(None, "--compile-mode", help="Mode of compiled trials: default or max-autotune-no-cudagraphs [default: default]."),
    verify: bool | None = typer.Option(None, "--verify/--no-verify", help="Verify the best configuration (same update as the baseline) before saving it [default: on]."),
    config: str | None = typer.Option(None, "--config", help="Study TOML (flags override it)."),
) -> None:
    """Tune a training script: each trial is a short real torchrun run of one configuration.

    Multi-node trials: --nnodes N --rdzv-endpoint HOST:PORT here, `autobalance worker` on each other node."""

    def go() -> None:
        from autobalance.cli._tune import run_tune

        flags: dict[str, Any] = {
            "script": script, "script_args": list(ctx.args) or None, "trials": trials,
            "nproc_per_node": nproc_per_node, "device": device, "global_batch": global_batch, "steps": steps,
            "warmup": warmup, "measure_s": measure_s, "max_steps": max_steps, "storage": storage, "study_name": study_name, "trial_timeout": trial_timeout,
            "memory_cap_gib": _parse_caps(memory_cap_gib), "headroom": headroom, "cap_mode": cap_mode, "weight_spread": weight_spread,
            "weight_time": weight_time, "multi_objective": multi_objective, "max_spread_gib": max_spread_gib, "strategy": strategy,
            "sampler": sampler, "seed": seed, "dtypes": _parse_list("--dtypes", dtypes),
            "max_accumulation": max_accumulation, "on_error": on_error, "runs_dir": runs_dir, "prune_factor": prune_factor, "cold": cold, "nnodes": nnodes,
            "node_rank": node_rank, "rdzv_endpoint": rdzv_endpoint, "torchrun_args": torchrun_arg or None,
            "gpus_per_trial": gpus_per_trial, "cpus_per_trial": cpus_per_trial,
            "compile": compile, "compile_mode": compile_mode, "verify": verify,
        }
        run_tune(flags=flags, config_path=config)

    run_command(go)


@app.command()
def studies(storage: str = typer.Option("sqlite:///autobalance.db", help="Study database URL.")) -> None:
    """List the studies in a storage."""

    def go() -> None:
        from autobalance.cli._views import print_studies

        print_studies(existing_storage(storage))

    run_command(go)


@app.command()
def trials(
    study_name: str = typer.Option(..., "--study-name"),
    storage: str = typer.Option("sqlite:///autobalance.db"),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """A table of a study's trials: configuration, per-rank peak memory, spread, step time, state."""

    def go() -> None:
        from autobalance.cli._views import print_trials

        print_trials(study_name=study_name, storage=existing_storage(storage), as_json=as_json)

    run_command(go)




@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
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
        from rich.console import Console
        from rich.markup import escape

        from autobalance.store import check_storage
        from autobalance.tuner._promote import promote_trial
        from autobalance.tuner._storage import load_study

        err = Console(stderr=True)
        url = check_storage(existing_storage(storage))
        study = load_study(study_name=study_name, storage_url=url)
        saved, line = promote_trial(storage_url=url, study=study, trial_number=trial, verify=verify, script=script,
                                    script_args=list(ctx.args) if ctx.args else None,
                                    note=lambda text: err.print(f"[dim]{escape(text)}[/]"))
        typer.echo(f"Saved trial {saved.trial_number} of '{study_name}' as its best configuration ({line}).")

    run_command(go)


@app.command()
def best(
    study_name: str = typer.Option(..., "--study-name"),
    storage: str = typer.Option("sqlite:///autobalance.db"),
    format: str = typer.Option("table", "--format", help="table, json or yaml."),
) -> None:
    """Print the saved best configuration of a study."""

    def go() -> None:
        from autobalance.cli._views import print_saved
        from autobalance.store import ConfigStore, check_storage

        if format not in ("table", "json", "yaml"):
            raise UsageError(f"--format={format!r} is unknown; use table, json or yaml.")
        url = check_storage(existing_storage(storage))
        with ConfigStore(url=url) as store:
            print_saved(store.load(study_name), fmt=format)

    run_command(go)


@app.command()
def export(
    study_name: str = typer.Option(..., "--study-name"),
    output: str = typer.Option(..., "-o", "--output", help="File to write (JSON) for AUTOBALANCE_CONFIG_FILE."),
    storage: str = typer.Option("sqlite:///autobalance.db"),
) -> None:
    """Write the saved best configuration to a JSON file that plan() loads without a database."""

    def go() -> None:
        from autobalance.store import ConfigStore, check_storage, export_file

        url = check_storage(existing_storage(storage))
        with ConfigStore(url=url) as store:
            path = export_file(store.load(study_name), output)
        typer.echo(f"Wrote {path}. Use it with AUTOBALANCE_CONFIG_FILE={path} torchrun ...")

    run_command(go)
