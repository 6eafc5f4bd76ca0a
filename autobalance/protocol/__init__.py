"""The protocol between the rooms: statuses, a rank's report, the study's attribute names and
which trial is feasible / the best.

The floor of the package: it imports nothing else of autobalance (and neither torch nor optuna at
import time), so the runtime, the launcher, the tuner, the report and the CLI can all use it.
"""

from __future__ import annotations

from autobalance.protocol._attrs import CONSTRAINTS_KEY, StudyAttr, TrialAttr
from autobalance.protocol._rank_time import SLOW_RATIO, SlowRank, busy_wait_text, slow_rank
from autobalance.protocol._rate import RATE_SOURCES, exchange_rate, exchange_rate_text
from autobalance.protocol._report import (
    GENERIC_CPU_NAME,
    REPORT_SCHEMA,
    InvalidReport,
    RankDevice,
    RankMemory,
    RankReport,
    RankTiming,
    cpu_model_name,
    report_path,
    report_problem,
    timed_steps,
)
from autobalance.protocol._speedup import SpeedUp, speed_up
from autobalance.protocol._status import (
    FAILED_STATUSES,
    INFEASIBLE_STATUSES,
    MEASURED_STATUSES,
    NOT_COUNTED,
    OOM_MARKERS,
    OUTCOME_STATUSES,
    PEER_FAILURE_MARKERS,
    REPORT_STATUSES,
    TOLD_STATUSES,
    Status,
    looks_like_oom,
    looks_like_peer_failure,
)
from autobalance.protocol._trials import (
    best_trial,
    best_value,
    is_feasible,
    objective_value,
    over_limit,
    pooled_values,
    rank_trials,
    ranked_trials,
    study_ranks,
    time_in_steps_s,
    trial_ranks,
    weighted_objective,
    would_be_best,
)
from autobalance.protocol._units import GIB, MIB, memory_pair, memory_text

__all__ = [
    "CONSTRAINTS_KEY",
    "FAILED_STATUSES",
    "GENERIC_CPU_NAME",
    "GIB",
    "INFEASIBLE_STATUSES",
    "MEASURED_STATUSES",
    "MIB",
    "NOT_COUNTED",
    "OOM_MARKERS",
    "OUTCOME_STATUSES",
    "PEER_FAILURE_MARKERS",
    "RATE_SOURCES",
    "REPORT_SCHEMA",
    "REPORT_STATUSES",
    "SLOW_RATIO",
    "TOLD_STATUSES",
    "InvalidReport",
    "RankDevice",
    "RankMemory",
    "RankReport",
    "RankTiming",
    "SlowRank",
    "SpeedUp",
    "Status",
    "StudyAttr",
    "TrialAttr",
    "best_trial",
    "best_value",
    "busy_wait_text",
    "cpu_model_name",
    "exchange_rate",
    "exchange_rate_text",
    "is_feasible",
    "looks_like_oom",
    "looks_like_peer_failure",
    "memory_pair",
    "memory_text",
    "objective_value",
    "over_limit",
    "pooled_values",
    "rank_trials",
    "ranked_trials",
    "report_path",
    "report_problem",
    "slow_rank",
    "speed_up",
    "study_ranks",
    "time_in_steps_s",
    "timed_steps",
    "trial_ranks",
    "weighted_objective",
    "would_be_best",
]
