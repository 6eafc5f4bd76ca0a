"""The training-side runtime: applies a configuration, measures, reports.

It imports nothing from the tuner or the launcher (checked by a test).
"""

from __future__ import annotations

from autobalance.runtime._checkpoint import apply_checkpointing, find_blocks
from autobalance.runtime._external import FrameworkLoop, FullStepSampler
from autobalance.runtime._fsdp import find_embeddings, full_state_dict, load_full_state_dict
from autobalance.runtime._memory import CpuMemoryTracker, MemorySnapshot, NvmlDevice
from autobalance.runtime._plan import Plan, TrialComplete, classify_exception, plan
from autobalance.runtime._rank_weighting import (
    RankWeight,
    micro_step_factor,
    rank_weight,
    register_rank_weighting,
    weighted_sum_hook,
)
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
    "FrameworkLoop",
    "FullStepSampler",
    "MemorySnapshot",
    "ModelWithLoss",
    "NvmlDevice",
    "Plan",
    "RankWeight",
    "StepLayout",
    "TrialComplete",
    "UnevenBatchSampler",
    "apply_checkpointing",
    "classify_exception",
    "epoch_schedule",
    "find_blocks",
    "find_embeddings",
    "full_state_dict",
    "load_full_state_dict",
    "micro_batch_weight",
    "micro_step_factor",
    "plan",
    "rank_weight",
    "register_rank_weighting",
    "report_path",
    "weighted_sum_hook",
    "write_report",
]
