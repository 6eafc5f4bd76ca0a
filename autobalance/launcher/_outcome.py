"""What one trial came to, judged from the ranks' reports and exit codes - never from grepping
for the word "error"."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STATUSES", "TrialOutcome", "classify", "read_reports"]

STATUSES = ("ok", "oom", "timeout", "error", "crash", "interrupted", "pruned")
"""ok: measured; oom / timeout: infeasible; error: the script raised (not OOM); crash: a rank died
or left no usable report (killed, exited early, garbage report); interrupted: the tuner was stopped;
pruned: stopped early by the tuner because it was clearly slower than the best feasible trial."""


@dataclass(kw_only=True)
class TrialOutcome:
    """The result of one torchrun job."""

    status: str
    """One of :data:`STATUSES`."""
    reason: str
    """One line saying why (the failing rank and what happened)."""
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Valid per-rank reports by global rank."""
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

    @property
    def feasible_measurement(self) -> bool:
        return self.status == "ok"


def read_reports(trial_dir: str, world_size: int) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """Valid reports by rank, and a problem description for each rank whose report is unusable."""
    reports: dict[int, dict[str, Any]] = {}
    problems: dict[int, str] = {}
    for rank in range(world_size):
        path = os.path.join(trial_dir, f"rank{rank}.json")
        if not os.path.exists(path):
            continue
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            problems[rank] = f"report of rank {rank} is unreadable ({type(exc).__name__}: {str(exc)[:120]})"
            continue
        if not isinstance(data, dict) or data.get("status") not in ("ok", "oom", "error", "peer_failed"):
            problems[rank] = f"report of rank {rank} is not a valid autobalance report"
            continue
        reports[rank] = data
    return reports, problems


def _rank_logs(trial_dir: str) -> dict[int, str]:
    """stderr of each local rank from torchrun's ``--log-dir`` (text tail)."""
    logs: dict[int, str] = {}
    for path in glob.glob(os.path.join(trial_dir, "logs", "**", "stderr.log"), recursive=True):
        rank_dir = os.path.basename(os.path.dirname(path))
        if rank_dir.isdigit():
            with open(path, errors="replace") as fh:
                logs[int(rank_dir)] = fh.read()[-20000:]
    return logs


def _traceback_in(text: str) -> str:
    start = text.rfind("Traceback (most recent call last)")
    return text[start:] if start >= 0 else ""


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

    def outcome(status: str, reason: str, rank: int | None = None, tb: str = "") -> TrialOutcome:
        return TrialOutcome(
            status=status, reason=reason, reports=reports, returncode=returncode, wall_s=wall_s,
            failing_rank=rank, traceback=tb, trial_dir=trial_dir,
        )

    if interrupted:
        return outcome("interrupted", "the tuner was interrupted; the trial's processes were killed")
    if pruned:
        return outcome("pruned", "stopped early: its step time was clearly worse than the best feasible trial's")
    for rank, rep in sorted(reports.items()):
        if rep["status"] == "oom":
            return outcome("oom", f"rank {rank} ran out of memory: {rep.get('error') or ''}"[:300], rank,
                           rep.get("traceback") or "")
    for rank, rep in sorted(reports.items()):
        if rep["status"] == "error":
            return outcome("error", f"rank {rank} raised {rep.get('error') or 'an error'}"[:300], rank,
                           rep.get("traceback") or "")
    if timed_out:
        waiting = sorted(set(range(world_size)) - set(reports))
        return outcome("timeout", f"no result within --trial-timeout {timeout_s:g}s (ranks {waiting} did not report); "
                       "killed the whole job")
    if problems:
        rank = min(problems)
        return outcome("crash", problems[rank], rank)
    if returncode == 0 and len(reports) == world_size and all(r["status"] == "ok" for r in reports.values()):
        return outcome("ok", "measured")
    logs = _rank_logs(trial_dir)
    missing = sorted(set(range(world_size)) - {r for r, rep in reports.items() if rep["status"] == "ok"})
    for rank in missing:
        local = rank % max(1, len(logs) or 1)
        text = logs.get(rank, logs.get(local, ""))
        tb = _traceback_in(text)
        if tb and ("OutOfMemoryError" in tb or "out of memory" in tb.lower()):
            return outcome("oom", f"rank {rank} ran out of memory before autobalance.plan() was set up", rank, tb)
        if tb and "peer_failed" not in {r.get("status") for r in reports.values()} and rank not in reports:
            last = tb.strip().splitlines()[-1] if tb.strip() else "an error"
            return outcome("error", f"rank {rank} failed before reporting: {last}"[:300], rank, tb)
    if returncode == 0:
        return outcome("crash", f"rank {missing[0] if missing else '?'} exited 0 without a report "
                       "(did the script stop before plan.steps() finished the trial's steps?)", missing[0] if missing else None)
    if returncode is not None and returncode < 0:
        return outcome("crash", f"torchrun was killed by signal {-returncode}")
    return outcome("crash", f"rank(s) {missing} died without a report (killed or crashed); torchrun exit code {returncode}",
                   missing[0] if missing else None, "\n".join(logs.get(r, "")[-2000:] for r in sorted(logs)))
