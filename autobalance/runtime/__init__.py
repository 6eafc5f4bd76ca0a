"""The training-side runtime: applies a configuration, measures, reports.

It imports nothing from the tuner or the launcher (checked by a test).
"""

from __future__ import annotations

from autobalance.runtime._checkpoint import apply_checkpointing, find_blocks
from autobalance.runtime._memory import CpuMemoryTracker, MemorySnapshot, NvmlDevice
from autobalance.runtime._plan import Plan, TrialComplete, classify_exception, plan
from autobalance.runtime._report import report_path, write_report
from autobalance.runtime._sampler import (
    EpochSchedule,
    StepLayout,
    UnevenBatchSampler,
    epoch_schedule,
)
from autobalance.runtime._weighting import micro_batch_weight
from autobalance.runtime._with_loss import ModelWithLoss

__all__ = [
    "CpuMemoryTracker",
    "EpochSchedule",
    "MemorySnapshot",
    "ModelWithLoss",
    "NvmlDevice",
    "Plan",
    "StepLayout",
    "TrialComplete",
    "UnevenBatchSampler",
    "apply_checkpointing",
    "classify_exception",
    "epoch_schedule",
    "find_blocks",
    "micro_batch_weight",
    "plan",
    "report_path",
    "write_report",
]
