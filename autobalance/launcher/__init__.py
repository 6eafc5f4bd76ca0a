"""Starts and kills torchrun jobs, collects and classifies their reports."""

from __future__ import annotations

from autobalance.launcher._multinode import Coordinator, run_worker
from autobalance.launcher._outcome import STATUSES, TrialOutcome, classify, read_reports
from autobalance.launcher._procs import (
    become_subreaper,
    interrupts_deferred,
    kill_trial_processes,
    trial_processes,
)
from autobalance.launcher._torchrun import TrialLaunch, build_command, run_trial, trial_environment
from autobalance.launcher._warm import WarmPool, cold_reason

__all__ = [
    "STATUSES",
    "Coordinator",
    "TrialLaunch",
    "TrialOutcome",
    "WarmPool",
    "become_subreaper",
    "build_command",
    "classify",
    "cold_reason",
    "interrupts_deferred",
    "kill_trial_processes",
    "read_reports",
    "run_trial",
    "run_worker",
    "trial_environment",
    "trial_processes",
]
