"""Verification: prove that a tuned configuration computes the script's own update before it is saved.

``_result`` (a check, a verdict, the causes), ``_tolerance`` (part 1's bound from the measured rounding
floor; part 2's limits), ``_runs`` (launching the one-step runs, what several verifications share),
``_verifier`` (the rule: floor, math, dtype, RNG replay). The study-facing side (which trials to
verify, the ``verify`` command) lives in the tuner.
"""

from __future__ import annotations

from autobalance.verify._result import (
    BUFFER_CAUSES,
    FP32_CAUSES,
    TOKEN_MEAN_FIXES,
    Check,
    Failure,
    Verification,
    fp32_causes,
    relative,
)
from autobalance.verify._runs import RunFailed, SharedRuns, StepResult, VerifyTarget, run_key
from autobalance.verify._tolerance import (
    BOUND_MAX,
    BOUND_MIN,
    FLOOR_FACTOR,
    NOISE_FACTOR,
    NOISE_LIMIT,
    ROUNDING_FACTOR,
    UPDATE_LIMIT,
    bound_from_floor,
    floor_too_high,
    noise_problem,
    rounding_likely,
)
from autobalance.verify._verifier import Verifier, recomputes, without_recompute

__all__ = [
    "BOUND_MAX",
    "BOUND_MIN",
    "BUFFER_CAUSES",
    "FLOOR_FACTOR",
    "FP32_CAUSES",
    "NOISE_FACTOR",
    "NOISE_LIMIT",
    "ROUNDING_FACTOR",
    "TOKEN_MEAN_FIXES",
    "UPDATE_LIMIT",
    "Check",
    "Failure",
    "RunFailed",
    "SharedRuns",
    "StepResult",
    "Verification",
    "Verifier",
    "VerifyTarget",
    "bound_from_floor",
    "floor_too_high",
    "fp32_causes",
    "noise_problem",
    "recomputes",
    "relative",
    "rounding_likely",
    "run_key",
    "without_recompute",
]
