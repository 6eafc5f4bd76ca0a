"""Entry point: the typer app, assembled from the command modules (which never import it back)."""

from __future__ import annotations

import typer

from autobalance.cli import _commands, _report_cmds, _verify_cmds, _worker_cmds
from autobalance.cli._common import HELP_MARKUP

__all__ = ["app", "main"]

app = typer.Typer(
    name="autobalance",
    help="Even GPU memory and fast steps for DDP training: an Optuna study over real torchrun trials.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=HELP_MARKUP,
)
for _module in (_commands, _report_cmds, _verify_cmds, _worker_cmds):
    app.add_typer(_module.commands)


def main() -> None:
    """``autobalance``: exit codes follow :func:`autobalance._errors.exit_code` (click's own usage
    errors, such as an unknown option, exit with 2 as well)."""
    app()
