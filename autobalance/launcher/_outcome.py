"""What one trial came to, judged from the ranks' reports and exit codes - never from grepping
for the word "error"."""

from __future__ import annotations

import glob
import json
import os
import signal
from dataclasses import dataclass, field
from typing import Any

from autobalance._env import NO_PLAN_EXIT_CODE as _NO_PLAN_EXIT_CODE
from autobalance._env import REPORT_FAILED_EXIT_CODE as _REPORT_FAILED_EXIT_CODE
from autobalance._env import REPORT_FAILED_MARKER as _REPORT_FAILED_MARKER
from autobalance.launcher._failure_order import (
    TorchrunFailure,
    by_report_time,
    failure_order,
    torchrun_failures,
)
from autobalance.protocol import (
    OUTCOME_STATUSES,
    InvalidReport,
    RankReport,
    Status,
    looks_like_oom,
    looks_like_peer_failure,
    report_path,
)

__all__ = ["STATUSES", "TrialOutcome", "classify", "read_reports"]

STATUSES = OUTCOME_STATUSES
"""ok: measured; oom / timeout: infeasible; error: the script raised (not OOM); crash: a rank died
or left no usable report (killed, exited early, garbage report); interrupted: the tuner was stopped;
pruned: stopped early by the tuner because it was clearly slower than the best feasible trial."""


@dataclass(kw_only=True)
class TrialOutcome:
    """The result of one torchrun job."""

    status: Status
    """One of :data:`STATUSES`."""
    reason: str
    """One line saying why (the failing rank and what happened)."""
    reports: dict[int, RankReport] = field(default_factory=dict)
    """Valid per-rank reports by global rank, parsed once where they were read (:func:`read_reports`);
    a report given as its JSON object is parsed here (:class:`~autobalance.protocol.InvalidReport`
    when it is not a valid one)."""
    returncode: int | None = None
    """torchrun's exit code (None when it was killed by the timeout)."""
    wall_s: float = 0.0
    """Wall time of the whole job, start-up included."""
    failing_rank: int | None = None
    """The rank the failure is attributed to, when known."""
    traceback: str = ""
    """The failing rank's traceback or the tail of its stderr."""
    leftover_pids: list[int] = field(default_factory=list)
    """Processes that had to be SIGKILLed after torchrun ended (for diagnostics)."""
    trial_dir: str = ""
    """Where reports and logs of this trial live."""
    pool_start_s: float = 0.0
    """Of ``wall_s``: waiting for a warm pool that was (re)started for this trial to come up."""
    recycled: str | None = None
    """A warm trial after which its pool was restarted: why (what the workers held over a fresh one)."""
    remeasured: dict[str, Any] | None = None
    """A trial measured twice and merged (the tuner's re-measurement): why, and each run's step time."""
    started_at: float | None = None
    """Epoch seconds when the job was started (set by the tuner; with the ranks' reports it gives the
    time from launch to the first step)."""

    def __post_init__(self) -> None:
        self.reports = {r: rep if isinstance(rep, RankReport) else RankReport.from_dict(rep)
                        for r, rep in self.reports.items()}

    @property
    def feasible_measurement(self) -> bool:
        return self.status == Status.OK


def read_reports(trial_dir: str, world_size: int) -> tuple[dict[int, RankReport], dict[int, str]]:
    """Valid reports by rank (parsed: the one place a rank's JSON becomes a :class:`RankReport`), and
    a problem description for each rank whose report is unusable."""
    reports: dict[int, RankReport] = {}
    problems: dict[int, str] = {}
    for rank in range(world_size):
        path = report_path(trial_dir, rank)
        if not os.path.exists(path):
            continue
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            problems[rank] = f"report of rank {rank} is unreadable ({type(exc).__name__}: {str(exc)[:120]})"
            continue
        try:  # through protocol.report_problem: nothing in a report is trusted
            reports[rank] = RankReport.from_dict(data)
        except InvalidReport as exc:
            problems[rank] = f"report of rank {rank} is not a valid autobalance report ({exc})"[:300]
    return reports, problems


def _node_dirs(trial_dir: str) -> list[str]:
    """Where each node's torchrun wrote ``torchrun.log`` and ``logs/``: the trial directory (this
    node) and, for a trial that spans nodes, ``node-<worker id>/`` of each worker node."""
    return [trial_dir, *sorted(d for d in glob.glob(os.path.join(trial_dir, "node-*")) if os.path.isdir(d))]


def _node_failures(trial_dir: str) -> list[dict[int, TorchrunFailure] | None]:
    """The failures in each node's torchrun summary (by global rank; None: no summary), in
    :func:`_node_dirs` order."""
    found: list[dict[int, TorchrunFailure] | None] = []
    for node in _node_dirs(trial_dir):
        try:
            with open(os.path.join(node, "torchrun.log"), errors="replace") as fh:
                found.append(torchrun_failures(fh.read()[-200000:]))
        except OSError:
            found.append(None)
    return found


def _merged(per_node: list[dict[int, TorchrunFailure] | None]) -> dict[int, TorchrunFailure] | None:
    """Every node's failures by global rank (None: no node's torchrun wrote a summary)."""
    if all(f is None for f in per_node):
        return None
    return {rank: failure for f in per_node for rank, failure in (f or {}).items()}


def _rank_logs(trial_dir: str, per_node: list[dict[int, TorchrunFailure] | None]) -> dict[int, str]:
    """stderr of each rank (text tail) by global rank, from every node's ``--log-dir``. torchrun
    names a rank's directory by its local rank: on one node that is the global rank; on several, a
    rank torchrun listed as failed is placed by its summary entry and the others are left out (a
    node's place in the job is the rendezvous's choice)."""
    logs: dict[int, str] = {}
    nodes = _node_dirs(trial_dir)
    for node, failures in zip(nodes, per_node, strict=True):
        to_global = {f.local_rank: f.rank for f in (failures or {}).values()}
        for path in glob.glob(os.path.join(node, "logs", "**", "stderr.log"), recursive=True):
            rank_dir = os.path.basename(os.path.dirname(path))
            if not rank_dir.isdigit():
                continue
            rank = to_global.get(int(rank_dir), int(rank_dir) if len(nodes) == 1 else None)
            if rank is None:
                continue
            try:
                with open(path, errors="replace") as fh:
                    logs[rank] = fh.read()[-20000:]
            except OSError:
                continue
    return logs


def _traceback_in(text: str) -> str:
    start = text.rfind("Traceback (most recent call last)")
    return text[start:] if start >= 0 else ""


def _is_peer_failure(tb: str) -> bool:
    last = tb.strip().splitlines()[-1] if tb.strip() else ""
    return looks_like_peer_failure(last)


def _how_it_ended(rank: int, codes: dict[int, int] | None, *, nodes: int) -> str:
    if codes is None:
        return "died without a report (killed or crashed)"
    code = codes.get(rank)
    if code is None and nodes > 1:
        return ("ended without a report, and no node's torchrun listed it as failed (it exited 0, or its node's "
                "torchrun was stopped before it could say)")
    if code is None:
        return ("finished normally (exit code 0) without a report: the script did not call autobalance.plan(), or "
                "stopped before plan.steps() finished the trial's steps")
    if code == _NO_PLAN_EXIT_CODE:
        return "finished normally without calling autobalance.plan(): nothing was measured"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (signal {-code}) before it reported"
    if code == _REPORT_FAILED_EXIT_CODE:
        return "could not write its report"
    return f"exited with code {code} without a report"


def classify(
    *,
    trial_dir: str,
    world_size: int,
    returncode: int | None,
    timed_out: bool,
    interrupted: bool,
    wall_s: float,
    timeout_s: float,
    pruned: bool = False,
) -> TrialOutcome:
    reports, problems = read_reports(trial_dir, world_size)

    def outcome(status: Status, reason: str, rank: int | None = None, tb: str = "") -> TrialOutcome:
        return TrialOutcome(
            status=status, reason=reason, reports=reports, returncode=returncode, wall_s=wall_s,
            failing_rank=rank, traceback=tb, trial_dir=trial_dir,
        )

    if interrupted:
        return outcome(Status.INTERRUPTED, "the tuner was interrupted; the trial's processes were killed")
    if pruned:
        return outcome(Status.PRUNED, "stopped early: its step time was clearly worse than the best feasible trial's")
    # the first failure in time names the trial (a later one may be a consequence of it)
    for rank in by_report_time(trial_dir, [r for r, rep in reports.items() if rep.status == Status.OOM]):
        rep = reports[rank]
        return outcome(Status.OOM, f"rank {rank} ran out of memory: {rep.error or ''}"[:300], rank,
                       rep.traceback or "")
    for rank in by_report_time(trial_dir, [r for r, rep in reports.items() if rep.status == Status.ERROR]):
        rep = reports[rank]
        return outcome(Status.ERROR, f"rank {rank} raised {rep.error or 'an error'}"[:300], rank,
                       rep.traceback or "")
    per_node = _node_failures(trial_dir)
    failures = _merged(per_node)
    # this node's torchrun saw a rank die on its own (not one it stopped) before the job was killed at the
    # timeout: that death came first, the timeout is its consequence. Only this node's: another node's
    # ranks may have died of this node's kill (their peers vanished) before these lines run
    died_first = per_node[0] is not None and any(not f.torn_down for f in per_node[0].values())
    if timed_out and not died_first:
        waiting = sorted(set(range(world_size)) - set(reports))
        return outcome(Status.TIMEOUT, f"no result within --trial-timeout {timeout_s:g}s (ranks {waiting} did not report); "
                       "killed the whole job")
    if problems:
        rank = min(problems)
        return outcome(Status.CRASH, problems[rank], rank)
    if len(reports) == world_size and all(r.status == Status.OK for r in reports.values()):
        # every rank measured and reported; a failure while tearing down does not spoil that
        return outcome(Status.OK, "measured" if returncode == 0 else f"measured (torchrun exit code {returncode} afterwards)")
    logs = _rank_logs(trial_dir, per_node)
    codes = None if failures is None else {r: f.exitcode for r, f in failures.items()}
    # first failure first: a rank torchrun had to stop (its teardown) is never the cause of the others
    silent = failure_order([r for r in range(world_size) if r not in reports], failures)
    for rank in silent:  # a rank that said why its report is missing (disk full, directory unwritable)
        text = logs.get(rank, "")
        at = text.rfind(_REPORT_FAILED_MARKER)
        if at >= 0:
            line = text[at + len(_REPORT_FAILED_MARKER):].strip().splitlines()[0]
            return outcome(Status.CRASH, f"no report: {line}"[:300], rank, _traceback_in(text[:at]))
    for rank in silent:  # a rank that failed before autobalance.plan() could report (import error, ...)
        tb = _traceback_in(logs.get(rank, ""))
        if not tb or _is_peer_failure(tb):
            continue
        if looks_like_oom(tb):
            return outcome(Status.OOM, f"rank {rank} ran out of memory before autobalance.plan() was set up", rank, tb)
        last = tb.strip().splitlines()[-1]
        return outcome(Status.ERROR, f"rank {rank} failed before reporting: {last}"[:300], rank, tb)
    # the cause is a rank without a report whose peers (if any) only saw it vanish
    culprits = [r for r in silent if not _is_peer_failure(_traceback_in(logs.get(r, "")))] or silent
    if culprits:
        rank = culprits[0]
        victims = sorted(r for r, rep in reports.items() if rep.status == Status.PEER_FAILED)
        tail = f"; ranks {victims} lost their connection to it" if victims else ""
        stopped = sorted(r for r in silent if r != rank and failures and r in failures and failures[r].torn_down)
        if stopped:  # still running when it died: torchrun's teardown ended them before they noticed
            tail += f"; ranks {stopped} were stopped by torchrun when it ended the job"
        reason = f"rank {rank} {_how_it_ended(rank, codes, nodes=len(per_node))}{tail}"
        if returncode is not None and returncode < 0 and codes is None:
            reason += f"; torchrun was killed by signal {-returncode}"
        return outcome(Status.CRASH, reason[:300], rank, "\n".join(logs.get(r, "")[-2000:] for r in sorted(logs)))
    if returncode is not None and returncode < 0:
        return outcome(Status.CRASH, f"torchrun was killed by signal {-returncode}")
    return outcome(Status.CRASH, f"every rank reported but the job failed (reports: "
                   f"{ {r: str(rep.status) for r, rep in sorted(reports.items())} }; torchrun exit code {returncode})")
