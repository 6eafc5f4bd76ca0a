"""No blind start-up on a GPU: which dtypes the model strategy may propose, and when the wrapped
sampler may explore.

On a CUDA device the dtype prior says fp32 without TF32 costs about twice bf16 per sample on a
tensor-core GPU (on one H200, 1331-1340 ms per step where bf16 ran 170-230 ms: field notes), so:

- **bf16 first.** Until a bf16 trial was measured (or bf16 failed), only bf16 is proposed; fp16 is
  the first dtype when bf16 is not searched.
- **fp16 next**, once the first half-precision dtype was measured or failed.
- **fp32 only when asked or learned**: the search space holds no half-precision dtype (``--dtypes
  fp32``); ``--dtypes`` names fp32 or the script runs fp32 matmuls in TF32 (then like fp16, after the
  first dtype); every half-precision dtype failed (trials that ran and ended in an error, a crash or
  a timeout, none measured); or the study measured fp32 faster per sample than every half-precision
  dtype.

Trials left to the sampler before that get the first allowed dtype fixed (the sampler picks the
rest), so the sampler's random start-up never spends a trial on fp32 with most blocks checkpointed.
On a GPU the sampler explores freely only once the models' proposals stop improving
(:func:`proposals_stalled`); on CPU every third trial is the sampler's, as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from autobalance.protocol import Status, TrialAttr, weighted_objective
from autobalance.tuner.search._constants import IMPROVES, STALL_AFTER
from autobalance.tuner.search._space import SearchSpace

__all__ = ["HALF_DTYPES", "IMPROVES", "MODEL_SOURCES", "STALL_AFTER", "proposable_dtypes", "proposals_stalled"]

HALF_DTYPES = ("bf16", "fp16")
"""Half-precision dtypes, in the order they are measured first."""
MODEL_SOURCES = ("memory-model", "compiled-model")
"""``proposed_by`` of the models' proposals."""
_FAILED = (Status.ERROR, Status.CRASH, Status.TIMEOUT)


def _launched(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """Finished trials that ran their configuration (not predicted, not reused), by number."""
    return sorted((t for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
                   and t.user_attrs.get(TrialAttr.CONFIG)
                   and t.user_attrs.get(TrialAttr.STATUS) not in (None, Status.PREDICTED_OOM, Status.INTERRUPTED,
                                                                  Status.STALE, Status.SURPLUS)
                   and t.user_attrs.get(TrialAttr.REUSED_FROM) is None), key=lambda t: t.number)


def _dtype_states(trials: Sequence[FrozenTrial]) -> tuple[set[str], set[str]]:
    """(dtypes with a measured trial, dtypes whose launched trials all failed without a measurement)."""
    measured: set[str] = set()
    tried: dict[str, list[str]] = {}
    for t in _launched(trials):
        dtype = str(t.user_attrs[TrialAttr.CONFIG].get("dtype"))
        status = str(t.user_attrs.get(TrialAttr.STATUS))
        tried.setdefault(dtype, []).append(status)
        if status in (Status.OK, Status.PRUNED):
            measured.add(dtype)
    failed = {d for d, statuses in tried.items()
              if d not in measured and any(s in _FAILED for s in statuses)}
    return measured, failed


def proposable_dtypes(*, space: SearchSpace, device: str, trials: Sequence[FrozenTrial], tf32: bool = False,
                      asked: bool = False, per_sample_ms: dict[str, float] | None = None) -> tuple[list[str], str]:
    """The dtypes the models may propose now, in the space's order, and why in words (``""``: all of
    them). ``tf32``: the script runs fp32 matmuls in TF32; ``asked``: ``--dtypes`` names fp32 (then,
    as with TF32, fp32 comes after the first half-precision dtype); ``per_sample_ms``: the step-time
    model's measured cost per sample by dtype."""
    if device != "cuda":
        return list(space.dtypes), ""
    half = [d for d in HALF_DTYPES if d in space.dtypes]
    if not half:
        return list(space.dtypes), ""
    measured, failed = _dtype_states(trials)
    first = half[0]
    allowed = {first}
    why = f"{first} first (the dtype prior on a GPU)"
    if first in measured or first in failed:
        allowed |= set(half)
        why = "half precision first (fp32 without TF32 costs about twice bf16 on a GPU)"
    if "fp32" in space.dtypes:
        k = per_sample_ms or {}
        faster = ("fp32" in k and any(d in k for d in half)
                  and all(k["fp32"] < k[d] for d in half if d in k))
        if all(d in failed for d in half) or faster or ((tf32 or asked) and len(allowed) > 1):
            allowed.add("fp32")
    out = [d for d in space.dtypes if d in allowed]
    return out, ("" if len(out) == len(space.dtypes) else why)


def proposals_stalled(trials: Sequence[FrozenTrial], objective: dict[str, Any]) -> bool:
    """Whether the last :data:`STALL_AFTER` launched model proposals did not improve the best
    objective of the trials before them (an infeasible trial's value carries its violation, so it
    never improves on a feasible best). False before that many model proposals ran."""
    best = math.inf
    misses = 0
    for t in _launched(trials):
        values = t.values if t.state == TrialState.COMPLETE else None
        value = weighted_objective(values, objective) if values else math.inf
        if t.user_attrs.get("proposed_by") in MODEL_SOURCES:
            improved = value < best - IMPROVES * abs(best) if math.isfinite(best) else math.isfinite(value)
            misses = 0 if improved else misses + 1
        best = min(best, value)
    return misses >= STALL_AFTER
