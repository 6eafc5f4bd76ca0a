"""Every status a rank, a trial or the study records, and the text that marks an out-of-memory or a
lost peer."""

from __future__ import annotations

import enum

__all__ = [
    "FAILED_STATUSES",
    "INFEASIBLE_STATUSES",
    "MEASURED_STATUSES",
    "NOT_COUNTED",
    "OOM_MARKERS",
    "OUTCOME_STATUSES",
    "PEER_FAILURE_MARKERS",
    "REPORT_STATUSES",
    "TOLD_STATUSES",
    "Status",
    "looks_like_oom",
    "looks_like_peer_failure",
]


class Status(enum.StrEnum):
    """A status as written to a rank's report, a trial outcome or a trial's ``status`` attribute.

    A ``str``: it compares equal to, and serialises as, its value (``Status.OK == "ok"``)."""

    OK = "ok"
    """Measured."""
    OOM = "oom"
    """Ran out of memory (a rank's report, or the trial: infeasible)."""
    ERROR = "error"
    """The script raised something other than an out-of-memory."""
    PEER_FAILED = "peer_failed"
    """A rank's collective broke because another rank died (the victim, not the cause)."""
    TIMEOUT = "timeout"
    """No result within the trial timeout: infeasible."""
    CRASH = "crash"
    """A rank died or left no usable report (killed, exited early, garbage report)."""
    INTERRUPTED = "interrupted"
    """The tuner was stopped; the trial is run again on the next start."""
    PRUNED = "pruned"
    """Stopped early: clearly slower than the best feasible trial."""
    PREDICTED_OOM = "predicted_oom"
    """Recorded without launching: the memory model says it cannot fit."""
    SURPLUS = "surplus"
    """Asked by a worker when the study already had its trials (another worker took the last one)."""
    STALE = "stale"
    """Its worker stopped beating (killed); failed by another worker and run again."""


REPORT_STATUSES = (Status.OK, Status.OOM, Status.ERROR, Status.PEER_FAILED)
"""What a rank may put in its report's ``status``."""

OUTCOME_STATUSES = (Status.OK, Status.OOM, Status.TIMEOUT, Status.ERROR, Status.CRASH, Status.INTERRUPTED,
                    Status.PRUNED)
"""What the launcher makes of one torchrun job."""

MEASURED_STATUSES = (Status.OK, Status.OOM)
"""Trials whose configuration was run to a verdict (reused for a repeated configuration, fitted by the models)."""

INFEASIBLE_STATUSES = (Status.OOM, Status.TIMEOUT, Status.PREDICTED_OOM)
"""Trials that violate the memory constraint whatever their peaks."""

TOLD_STATUSES = (Status.OK, *INFEASIBLE_STATUSES)
"""Trials told to the study with objective values (the others fail or are pruned)."""

FAILED_STATUSES = (Status.TIMEOUT, Status.ERROR, Status.CRASH)
"""Trials shown as failed (not merely over the memory limit) in the report."""

NOT_COUNTED = (None, Status.INTERRUPTED, Status.STALE, Status.SURPLUS)
"""Statuses of FAIL trials that do not count towards ``--trials`` (they are run again)."""

OOM_MARKERS = ("OutOfMemoryError", "out of memory", "DefaultCPUAllocator: can't allocate")
"""Text of an out-of-memory error (CUDA's allocator, the CPU allocator), matched case-insensitively."""

PEER_FAILURE_MARKERS = ("DistBackendError", "DistNetworkError", "Connection closed by peer", "Connection reset by peer",
                        "Broken pipe", "NCCL communicator", "DistStoreError")
"""Text of an error a rank gets because another rank died (the victim, not the cause)."""


def looks_like_oom(text: str) -> bool:
    low = text.lower()
    return any(marker.lower() in low for marker in OOM_MARKERS)


def looks_like_peer_failure(text: str) -> bool:
    return any(marker in text for marker in PEER_FAILURE_MARKERS)
