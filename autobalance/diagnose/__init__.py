"""``autobalance diagnose``: run the script once with MemTracker's per-module breakdown on every
rank, and say where the memory goes and why the ranks differ (likely causes, the tune command).

It runs a trial (through the launcher), so it lives apart from ``report``, which only reads studies.
"""

from __future__ import annotations

from autobalance.diagnose._diagnose import (
    Diagnosis,
    Finding,
    RankBreakdown,
    analyse,
    print_diagnosis,
    run_diagnose,
    tune_command,
)

__all__ = [
    "Diagnosis",
    "Finding",
    "RankBreakdown",
    "analyse",
    "print_diagnosis",
    "run_diagnose",
    "tune_command",
]
