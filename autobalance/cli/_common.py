"""What every command shares: running a command under the one error-to-exit-code mapping, flag
parsing helpers, quiet Optuna, SIGTERM as Ctrl-C. Imports nothing heavy."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import typer

from autobalance._errors import (
    AutobalanceError,
    TrialScriptError,
    UsageError,
    exit_code,
)

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "HELP_MARKUP",
    "console",
    "existing_storage",
    "fail",
    "help_text",
    "parse_floats",
    "parse_list",
    "quiet_optuna",
    "run_command",
    "sigterm_as_interrupt",
]

INTERRUPTED = ("interrupted; the running trial was killed and marked failed. Run the same command again to "
               "continue the study.")


HELP_MARKUP: Literal["rich"] | None = "rich" if sys.stdout.isatty() else None
"""``--help`` in rich panels on a terminal; plain text (wrapped, never cut) into a pipe or a file."""


def help_text(text: str) -> str:
    """``text`` as a help string: square brackets are kept (not read as rich markup)."""
    if HELP_MARKUP is None:
        return text
    from rich.markup import escape

    return escape(text)


UNWRAPPED_WIDTH = 10_000
"""Console width into a pipe or a file: tables keep their natural width and lines are never wrapped."""


def console(*, stderr: bool = False) -> Console:
    """A rich console for a command's output: a terminal's own width; into a pipe or a file (COLUMNS
    unset) nothing is cut at 80 columns or wrapped mid-command."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    wide = not stream.isatty() and not os.environ.get("COLUMNS")
    return Console(stderr=stderr, width=UNWRAPPED_WIDTH if wide else None)


def fail(message: str, code: int) -> NoReturn:
    typer.echo(f"autobalance: error: {message}", err=True)
    raise typer.Exit(code)


def run_command(fn: Callable[..., Any], *args: Any, interrupted: str = INTERRUPTED, **kwargs: Any) -> Any:
    """Run a command: an autobalance error becomes one line ``autobalance: error: ...`` on stderr and
    the exit code of its class (:func:`autobalance._errors.exit_code`); Ctrl-C prints ``interrupted``."""
    try:
        return fn(*args, **kwargs)
    except TrialScriptError as exc:
        if exc.traceback_text:
            typer.echo(exc.traceback_text.rstrip(), err=True)
        fail(str(exc), exit_code(exc))
    except AutobalanceError as exc:
        fail(str(exc), exit_code(exc))
    except KeyboardInterrupt as exc:  # a command may say more (``KeyboardInterrupt(message)``)
        fail(str(exc) or interrupted, exit_code(exc))
    return None


def existing_storage(url: str) -> str:
    """``url`` for a command that only reads: a SQLite file that does not exist is an error (one
    line, exit code 2), never silently created empty; a malformed URL is one line showing the form."""
    from autobalance.store import normalize_storage_url

    normalize_storage_url(url)
    if url.startswith("sqlite:///") and "?" not in url and not url.startswith("sqlite:///file:"):
        path = url[len("sqlite:///"):]
        if path and path != ":memory:" and not os.path.exists(path):
            raise UsageError(
                f"--storage={url} does not exist (no file {os.path.abspath(path)}); pass the database "
                "`autobalance tune` wrote, e.g. --storage sqlite:///autobalance.db in its directory."
            )
    return url


def parse_floats(flag: str, text: str | None) -> list[float] | None:
    """``X`` or ``X,Y,...`` (e.g. ``--memory-cap-gib 16,24``) as a list of numbers."""
    if text is None:
        return None
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag}={text!r} is not a number or a comma-separated list; e.g. 16 or 16,24.") from None
    if not values:
        raise UsageError(f"{flag}={text!r} is empty; give a number or a comma-separated list, e.g. 16 or 16,24.")
    return values


def parse_list(flag: str, text: str | None) -> list[str] | None:
    """``A,B,...`` (e.g. ``--dtypes fp32,bf16``) as a list of words."""
    if text is None:
        return None
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise UsageError(f"{flag}={text!r} is empty; give a comma-separated list.")
    return items


def quiet_optuna() -> None:
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def sigterm_as_interrupt() -> None:
    """SIGTERM (kill, a batch system's preemption) stops the command like Ctrl-C: trial killed and marked."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, handler)

