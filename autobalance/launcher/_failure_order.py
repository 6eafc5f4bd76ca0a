"""Which rank failed first: the order of a trial's failures in time, not in rank number.

When one rank dies, torchrun tears the job down: it sends its closing signal (SIGTERM) to every
rank still running and lists those ranks among the failures too. On a busy machine a peer may not
notice the death (and say so in its report) before that signal arrives, so "rank 0 was killed by
SIGTERM" can sit next to "rank 1 was killed by SIGKILL". The cause is the rank that failed first:

1. a rank that torchrun did not have to stop (it had already ended) comes before any rank that
   torchrun sent its closing signal to (those are the teardown, never the cause);
2. then the earliest failure time (torchrun's per-failure time, from the rank's error file when it
   wrote one, else when torchrun observed it);
3. then torchrun's own "Root Cause (first observed failure)";
4. then the rank number.

Reports written by failing ranks are ordered by when they were written (their files' times).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from autobalance.protocol import report_path

__all__ = ["TorchrunFailure", "by_report_time", "failure_order", "torchrun_failures"]

_ENTRY = re.compile(
    r"\[\d+\]:\s*\n\s*time\s*:\s*(?P<time>\S+)\s*\n(?:\s*host\s*:[^\n]*\n)?"
    r"\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)(?:\s*\(pid:\s*(?P<pid>\d+)\))?"
)
_CLOSING = re.compile(r"Sending process (\d+) closing signal (\w+)")
_ROOT = "Root Cause (first observed failure)"


@dataclass(kw_only=True)
class TorchrunFailure:
    """One rank's entry in torchrun's failure summary."""

    rank: int
    local_rank: int
    """Its rank on its node (the name of its directory under torchrun's ``--log-dir``)."""
    exitcode: int
    pid: int | None
    time: str
    """torchrun's time of the failure (``YYYY-MM-DD_HH:MM:SS``: sorts as text)."""
    root_cause: bool
    """torchrun named it the first observed failure."""
    torn_down: bool
    """torchrun sent this rank its closing signal: it was still running when the job was stopped."""


def torchrun_failures(log_text: str) -> dict[int, TorchrunFailure] | None:
    """The failures in torchrun's summary (``ChildFailedError``) by global rank; None without one."""
    if "ChildFailedError" not in log_text:
        return None
    closed = {int(pid) for pid, _sig in _CLOSING.findall(log_text)}
    root_at = log_text.rfind(_ROOT)
    found: dict[int, TorchrunFailure] = {}
    for m in _ENTRY.finditer(log_text):
        rank = int(m["rank"])
        pid = int(m["pid"]) if m["pid"] else None
        entry = TorchrunFailure(rank=rank, local_rank=int(m["local"]), exitcode=int(m["code"]), pid=pid, time=m["time"],
                                root_cause=root_at >= 0 and m.start() > root_at,
                                torn_down=pid is not None and pid in closed)
        if rank in found:  # listed twice (root cause repeated): keep what both entries say
            entry.root_cause = entry.root_cause or found[rank].root_cause
        found[rank] = entry
    return found


def failure_order(ranks: list[int], failures: dict[int, TorchrunFailure] | None) -> list[int]:
    """``ranks`` sorted so the rank that failed first comes first (see the module's rules)."""
    def key(rank: int) -> tuple[bool, str, bool, int]:
        f = (failures or {}).get(rank)
        if f is None:  # not in the summary: nothing says it was torn down or when
            return (False, "~", True, rank)
        return (f.torn_down, f.time, not f.root_cause, rank)

    return sorted(ranks, key=key)


def by_report_time(trial_dir: str, ranks: list[int]) -> list[int]:
    """``ranks`` sorted by when each wrote its report (earliest first; ties and unknowns by rank)."""
    def key(rank: int) -> tuple[int, int]:
        try:
            return (os.stat(report_path(trial_dir, rank)).st_mtime_ns, rank)
        except OSError:
            return (2**63, rank)

    return sorted(ranks, key=key)
