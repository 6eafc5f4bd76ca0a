"""Entry point: typer app, error handling and exit codes. Heavy imports happen inside commands."""

from __future__ import annotations

import os
import sys
from typing import Any

import typer

from autobalance._errors import AutobalanceError, StudyNotFoundError, TrialScriptError, UsageError

app = typer.Typer(
    name="autobalance",
    help="Even GPU memory and fast steps for DDP training: an Optuna study over real torchrun trials.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EXIT_USAGE = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130


def fail(message: str, code: int) -> None:
    typer.echo(f"autobalance: error: {message}", err=True)
    raise typer.Exit(code)


def existing_storage(url: str) -> str:
    """``url`` for a command that only reads: a SQLite file that does not exist is an error (one
    line, exit code 2), never silently created empty."""
    if url.startswith("sqlite:///") and "?" not in url and not url.startswith("sqlite:///file:"):
        path = url[len("sqlite:///"):]
        if path and path != ":memory:" and not os.path.exists(path):
            raise UsageError(
                f"--storage={url} does not exist (no file {os.path.abspath(path)}); pass the database "
                "`autobalance tune` wrote, e.g. --storage sqlite:///autobalance.db in its directory."
            )
    return url


def run_command(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Map autobalance errors to one-line messages and exit codes."""
    try:
        return fn(*args, **kwargs)
    except (UsageError, StudyNotFoundError) as exc:  # bad input: a wrong flag value or an unknown study name
        fail(str(exc), EXIT_USAGE)
    except TrialScriptError as exc:
        if exc.traceback_text:
            typer.echo(exc.traceback_text.rstrip(), err=True)
        fail(str(exc), EXIT_FAILURE)
    except AutobalanceError as exc:
        fail(str(exc), EXIT_FAILURE)
    except KeyboardInterrupt:
        fail("interrupted; the running trial was killed and marked failed. Run the same command again to "
             "continue the study.", EXIT_INTERRUPTED)
    return None


def main() -> None:
    from autobalance.cli import (
        _commands,  # noqa: F401  (registers the commands)
        _report_cmds,  # noqa: F401
        _verify_cmds,  # noqa: F401
        _worker_cmds,  # noqa: F401
    )

    try:
        app()
    except SystemExit as exc:
        code = exc.code
        # click reports usage errors with 2 already; keep every other code as is
        sys.exit(code)
