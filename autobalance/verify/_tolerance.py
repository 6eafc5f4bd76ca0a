"""Part 1's bound from a measured rounding floor, and the limits of part 2.

The floor ``f`` is the relative error between the fp32 reference run and the same run with each
micro-batch's samples in reverse order: the same samples in the same micro-batches (so the same loss
weighting, whatever the loss: sum, token mean, a term over the micro-batch), only another summation
order - and, on a GPU, the run-to-run noise of its atomics. Per figure (gradients, updated
parameters, buffers)::

    bound = min(BOUND_MAX, max(BOUND_MIN, FLOOR_FACTOR * f))

Measured on one H200, a ~270M GPT, TF32 held off (``benchmarks/2026-12-03-h200/verify_floor.json``,
``python3 benchmarks/verify_floor.py``): gradients ``f`` = 1.5e-6 (the same run again: 4.6e-7);
correct arrangements of the same global batch (4x8, 16x2, 32x1, 6,6,5,5,5,5 against 8x4) 1.1-3.1e-6,
at most 2.1 ``f``; one micro-batch reweighted by 1e-3: 7.1e-4 = 470 ``f``. With ``FLOOR_FACTOR`` = 20
the bound (3.0e-5) sits 10x above the correct arrangements and 23x below that reweighting. Updated
parameters: ``f`` = 2.1e-8, correct up to 4.9e-8, the reweighting 6.4e-6. ``BOUND_MIN`` is the
constant every CPU test ran with before (a floor of 0: micro-batches of one sample, a deterministic
device); ``BOUND_MAX``: above it a reweighting of 1e-3 could pass, so a floor that high is reported
(:data:`Failure.FLOOR`) rather than trusted.

An error over the bound but within ``ROUNDING_FACTOR * f`` is most likely rounding (a model whose
arrangements round further apart than its sample order does); further out it is the configuration's
math. The baseline's own bf16/fp16 error (part 2's ``noise``) above ``NOISE_LIMIT`` (gradients) or
``UPDATE_LIMIT`` (the update) is not rounding (bf16 on the H200 GPT: 4.6e-3): gradients clipped while
still scaled, or a loss scale applied or removed twice.
"""

from __future__ import annotations

from autobalance.verify._result import Check

__all__ = ["BOUND_MAX", "BOUND_MIN", "FLOOR_FACTOR", "NOISE_FACTOR", "NOISE_LIMIT", "ROUNDING_FACTOR",
           "UPDATE_LIMIT", "bound_from_floor", "floor_too_high", "noise_problem", "rounding_likely"]

FLOOR_FACTOR = 20.0
BOUND_MIN = 1e-6
BOUND_MAX = 1e-4
ROUNDING_FACTOR = 100.0
NOISE_FACTOR = 4.0
"""Mixed precision: the tuned configuration may be this many times as far from the fp32 reference
as the baseline configuration is in the same dtype (different splits round different sums)."""
NOISE_LIMIT = 0.1
UPDATE_LIMIT = 0.5


def bound_from_floor(floor: Check) -> tuple[float, float, float]:
    """(gradients, updated parameters, buffers): see the module doc."""
    return tuple(min(BOUND_MAX, max(BOUND_MIN, FLOOR_FACTOR * f))  # type: ignore[return-value]
                 for f in (floor.grad_rel, floor.param_rel, floor.buffer_rel))


def floor_too_high(floor: Check) -> bool:
    """The floor's gradients alone reach the bound's ceiling: nothing below it can be told apart."""
    return FLOOR_FACTOR * floor.grad_rel > BOUND_MAX


def rounding_likely(check: Check, floor: Check) -> bool:
    """``check`` failed within ``ROUNDING_FACTOR`` times the floor in every figure it failed."""
    assert check.tolerance is not None
    pairs = ((check.grad_rel, check.tolerance[0], floor.grad_rel), (check.param_rel, check.tolerance[1], floor.param_rel),
             (check.buffer_rel, check.tolerance[2], floor.buffer_rel))
    failed = [(err, f) for err, bound, f in pairs if err > bound]
    return bool(failed) and all(err <= ROUNDING_FACTOR * max(f, BOUND_MIN / FLOOR_FACTOR) for err, f in failed)


def noise_problem(noise: Check) -> str | None:
    """Why the baseline's own bf16/fp16 step is not rounding (None: it is)."""
    if noise.grad_rel > NOISE_LIMIT:
        return f"its gradients are {noise.grad_rel:.1e} from the fp32 step's (rounding stays below {NOISE_LIMIT:g})"
    if noise.update_rel > UPDATE_LIMIT:
        return f"its update is {noise.update_rel:.1e} from the fp32 step's (rounding stays below {UPDATE_LIMIT:g})"
    return None
