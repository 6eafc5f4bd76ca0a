"""How a rank's trial ends, and its report written exactly once.

A trial ends in one of four ways, each leaving ``rank<R>.json`` in the trial directory:

- its steps are done: the report says ``ok`` and :class:`TrialComplete` (exit code 0) leaves the
  script's loop;
- an exception reaches the top (``sys.excepthook``): ``oom``, ``peer_failed`` or ``error`` (see
  :func:`classify_exception`), then the process exits with the launcher's exit code for it;
- the script returns before the steps are done (``atexit``): ``error`` saying so, or ``ok`` when a
  longer ``measure_s`` measurement had passed its minimum when the data ran out;
- the configuration is rejected while the plan is built: an ``error`` report, then the error raises.

A rank that cannot write its report says why on stderr (a line the launcher recognises) and exits
with ``REPORT_FAILED_EXIT_CODE``. In a trial a rank also dies with its parent (torchrun's agent).
The warm worker (:mod:`autobalance.runtime._worker`) calls the same functions itself.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autobalance import _env
from autobalance._errors import AutobalanceError
from autobalance.protocol import Status, looks_like_oom, looks_like_peer_failure
from autobalance.runtime._report import build_report, setup_failure_report, write_report
from autobalance.runtime._setup import tear_down_group

if TYPE_CHECKING:
    from autobalance.runtime._plan import Plan

__all__ = ["TrialComplete", "TrialEnd", "classify_exception", "set_parent_death_signal", "setup_failure_reported"]


class TrialComplete(SystemExit):
    """Raised out of ``plan.steps()`` once a trial has measured its steps (exit code 0)."""

    def __init__(self) -> None:
        super().__init__(0)


def classify_exception(exc: BaseException) -> Status:
    """``oom`` for out-of-memory, ``peer_failed`` for a collective broken by another rank, else ``error``."""
    if isinstance(exc, torch.OutOfMemoryError):
        return Status.OOM
    text = str(exc)
    if isinstance(exc, RuntimeError) and looks_like_oom(text):
        return Status.OOM
    dist_errors = tuple(
        cls
        for cls in (getattr(dist, "DistBackendError", None), getattr(dist, "DistNetworkError", None))
        if cls is not None
    )
    if dist_errors and isinstance(exc, dist_errors):
        return Status.PEER_FAILED
    if isinstance(exc, RuntimeError) and looks_like_peer_failure(text):
        return Status.PEER_FAILED
    return Status.ERROR


class TrialEnd:
    """Ends one plan's trial: writes its report once, whichever way the trial ends."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.written = False
        self.deferred: dict[str, Any] | None = None
        """A warm worker's ``ok`` report, written by the worker once it has cleaned up after the trial."""

    def install(self) -> None:
        """Report uncaught exceptions and an early end of the script (a cold trial's process)."""
        sys.excepthook = self.on_uncaught
        atexit.register(self.on_exit)

    def write(self, status: Status, error: str | None = None, tb: str | None = None) -> None:
        """Write this rank's report once; a rank that cannot (disk full, directory gone or read-only)
        says why on stderr and leaves with REPORT_FAILED_EXIT_CODE instead of passing for a script error."""
        plan = self.plan
        if plan.trial_dir is None or self.written:
            return
        self.written = True
        if status == Status.OK and plan.trial.warm:  # the worker adds what the trial inherited and writes it
            self.deferred = build_report(plan, status=status, error=error, tb=tb)
            return
        try:
            write_report(plan.trial_dir, plan.rank, build_report(plan, status=status, error=error, tb=tb))
        except Exception as exc:
            report_not_written(plan.rank, plan.trial_dir, status, exc)

    def take_deferred(self) -> dict[str, Any] | None:
        """The ``ok`` report a warm worker has still to write (see :meth:`write`), once."""
        report, self.deferred = self.deferred, None
        return report

    def finish(self) -> None:
        """The trial's steps are done: report ``ok`` and leave the script's loop."""
        self.write(Status.OK)
        self.plan.meter.close()
        if not self.plan.trial.warm:
            tear_down_group()  # the report is written: a failed teardown changes nothing
        raise TrialComplete()

    def on_uncaught(self, exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        status = classify_exception(exc)
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(text)
        try:
            self.write(status, error=f"{exc_type.__name__}: {exc}"[:2000], tb=text[-20000:])
        except BaseException as write_exc:  # never let a failing report hide the original error
            report_not_written(self.plan.rank, self.plan.trial_dir or "", status, write_exc)
        finally:
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(_env.OOM_EXIT_CODE if status == Status.OOM else _env.ERROR_EXIT_CODE)

    def on_exit(self) -> Status | None:
        """The script ended before the trial's steps were done: report it. Returns the status written
        (``ok`` when the data ran out during a longer ``measure_s`` measurement, after the minimum)."""
        plan, clock = self.plan, self.plan.clock
        if plan.trial_dir is None or self.written:
            return None
        if clock.measured_enough():
            self.write(Status.OK)
            return Status.OK
        self.write(
            Status.ERROR,
            error=(
                f"the script ended after {plan.steps_done} optimizer steps, before the trial's "
                f"{clock.warmup_steps} warm-up + {clock.measured_steps} measured steps; give it more data "
                "or lower --steps"
            ),
        )
        return Status.ERROR


def report_not_written(rank: int, trial_dir: str, status: Status, exc: BaseException) -> None:
    """Say on stderr why the report is missing (one line the launcher recognises), then exit."""
    try:
        sys.stderr.write(
            f"\n{_env.REPORT_FAILED_MARKER} rank {rank} could not write its {str(status)!r} report to {trial_dir} "
            f"({type(exc).__name__}: {str(exc)[:300]})\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(_env.REPORT_FAILED_EXIT_CODE)


@contextlib.contextmanager
def setup_failure_reported(trial: _env.TrialEnv) -> Iterator[None]:
    """In a trial (``trial.trial_dir`` not empty), a configuration that is rejected still leaves an
    ``error`` report (then raises)."""
    trial_dir = trial.trial_dir
    try:
        yield
    except AutobalanceError as exc:
        if trial_dir:
            report = setup_failure_report(exc, trial_id=trial.trial_id)
            try:
                write_report(trial_dir, report["rank"], report)
            except Exception as write_exc:
                report_not_written(report["rank"], trial_dir, Status.ERROR, write_exc)
        raise


def set_parent_death_signal(marker: str) -> None:
    """Die with the parent (torchrun's agent): a killed tuner must not leave workers behind.
    ``marker``: this process's ``AUTOBALANCE_TRIAL_ID`` (``TrialEnv.trial_id``; "": unset)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
        if _parent_gone(marker):  # the parent died before prctl took effect
            os._exit(1)
    except OSError:
        pass


def _parent_gone(marker: str) -> bool:
    """Whether this rank was orphaned: re-parented to init, or to a subreaper that is not torchrun
    (torchrun's environment carries the trial's marker ``marker``, see the launcher)."""
    ppid = os.getppid()
    if ppid == 1:
        return True
    if not marker:
        return False
    try:
        with open(f"/proc/{ppid}/environ", "rb") as fh:
            environ = fh.read().split(b"\0")
    except OSError:
        return False
    return f"{_env.TRIAL_ID}={marker}".encode() not in environ
