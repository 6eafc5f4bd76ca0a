"""Loss weighting: the one place that says how much each micro-batch's mean loss counts.

DDP averages gradients over the ``world_size`` ranks and gradient accumulation sums the
micro-steps, so weighting micro-batch ``i`` (``count_i`` samples, mean loss ``l_i``) by
``world_size * count_i / step_total`` makes the all-reduced gradient the gradient of
``sum_i count_i * l_i / step_total``: the mean loss over the whole optimizer step, whatever the
sizes of the micro-batches on any rank (uneven ranks, micro-steps that differ by one, the partial
last step of an epoch). ``count`` is a sample count today; a loss averaged over tokens would pass
its token count and the step's total token count instead (same formula).
"""

from __future__ import annotations

__all__ = ["micro_batch_weight"]


def micro_batch_weight(*, count: float, step_total: float, world_size: int) -> float:
    """Factor for one micro-batch's mean loss so that DDP's averaged gradient equals the gradient
    of the mean loss over the whole optimizer step (``world_size * count / step_total``)."""
    if step_total <= 0:
        raise ValueError(f"step_total={step_total} is not positive")
    return world_size * count / step_total
