"""``autobalance worker``: one node's part of multi-node trials (see ``launcher._multinode``)."""

from __future__ import annotations

import os
import re

import typer

from autobalance._errors import EXIT_INTERRUPTED, UsageError
from autobalance.cli._common import fail, quiet_optuna, run_command, sigterm_as_interrupt

commands = typer.Typer()
_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}


def check_endpoint(endpoint: str) -> str:
    if not re.fullmatch(r"\[?[A-Za-z0-9_.:-]+\]?:\d{1,5}", endpoint) or not 0 < int(endpoint.rsplit(":", 1)[1]) < 65536:
        raise UsageError(f"--rdzv-endpoint={endpoint!r} is not HOST:PORT; pass the endpoint given to "
                         "`autobalance tune`, e.g. node0:29400.")
    return endpoint


@commands.command(short_help="Serve multi-node trials from this node.", context_settings=_CONTEXT)
def worker(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="The same training script as the tune command's; its arguments follow (after --)."),
    rdzv_endpoint: str = typer.Option(..., "--rdzv-endpoint", help="HOST:PORT given to `autobalance tune --rdzv-endpoint`."),
    nnodes: int = typer.Option(..., "--nnodes", help="Nodes per trial, as given to `autobalance tune --nnodes`."),
    nproc_per_node: int = typer.Option(2, "--nproc-per-node", help="Ranks on this node (the same on every node)."),
    node_rank: int | None = typer.Option(None, "--node-rank", help="Passed to torchrun (used by static rendezvous only)."),
    runs_dir: str = typer.Option("autobalance_runs", "--runs-dir", help="The tune command's --runs-dir, on a filesystem shared by all nodes."),
    torchrun_arg: list[str] | None = typer.Option(None, "--torchrun-arg", help="Extra torchrun option for this node (repeatable)."),
    idle_timeout: float = typer.Option(600.0, "--idle-timeout", help="Exit after this many seconds without a live coordinator."),
) -> None:
    """Serve multi-node trials: join each trial's torchrun rendezvous from this node until the study ends."""

    def go() -> None:
        from autobalance.launcher import run_worker

        if not script.endswith(".py") or not os.path.isfile(script):
            raise UsageError(f"SCRIPT={script!r} is not an existing Python file; pass the same training script as "
                             "the tune command (a copy on this node).")
        if nnodes < 2:
            raise UsageError(f"--nnodes={nnodes}: a worker serves multi-node trials; use the tune command's --nnodes (2 or more).")
        if nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node={nproc_per_node} must be at least 1.")
        if idle_timeout <= 0:
            raise UsageError(f"--idle-timeout={idle_timeout:g} must be positive; e.g. 600.")
        check_endpoint(rdzv_endpoint)
        quiet_optuna()
        sigterm_as_interrupt()
        try:
            run_worker(script=script, script_args=list(ctx.args), runs_dir=runs_dir, rdzv_endpoint=rdzv_endpoint,
                       nnodes=nnodes, nproc_per_node=nproc_per_node, node_rank=node_rank,
                       torchrun_args=list(torchrun_arg or []), idle_timeout_s=idle_timeout,
                       say=lambda text: typer.echo(text, err=True))
        except KeyboardInterrupt:
            fail("worker interrupted; its part of the running trial was killed (the coordinator marks the trial "
                 "failed). Start it again to rejoin the study.", EXIT_INTERRUPTED)

    run_command(go)
