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

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autobalance._errors import UsageError

if TYPE_CHECKING:
    from autobalance.runtime._sampler import StepLayout

__all__ = ["StepWeights", "micro_batch_weight"]


def micro_batch_weight(*, count: float, step_total: float, world_size: int) -> float:
    """Factor for one micro-batch's mean loss so that DDP's averaged gradient equals the gradient
    of the mean loss over the whole optimizer step (``world_size * count / step_total``)."""
    if step_total <= 0:
        raise ValueError(f"step_total={step_total} is not positive")
    return world_size * count / step_total


class StepWeights:
    """The weights of one optimizer step's micro-batches on this rank: by samples, or by the
    ``count=`` of ``plan.steps`` (each micro-batch's count over the step's total on every rank,
    found with one scalar all-reduce before the step's first backward)."""

    def __init__(self, *, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device
        self._counts: list[float] = []
        """This rank's count per micro-batch of the current step."""
        self._total = 0.0
        """... and the step's total count over every rank and micro-batch."""

    def start_step(self, layout: StepLayout, rank: int, items: list[Any], count: Callable[[Any], Any] | None,
                   *, step: int) -> None:
        """A step begins: its samples per micro-batch, or what ``count`` says of each of ``items``."""
        if count is None:
            self._counts = [float(len(mb)) for mb in layout.micro_batches[rank]]
            self._total = float(layout.total)
            return
        counts: list[float] = []
        for i, item in enumerate(items):
            value = count(item)
            value = float(value.item() if isinstance(value, torch.Tensor) else value)
            if not math.isfinite(value) or value < 0:
                raise UsageError(
                    f"count= returned {value!r} for micro-batch {i} of step {step}; it must be "
                    "a finite number >= 0 (how many units, e.g. real tokens, the micro-batch's loss averages over)."
                )
            counts.append(value)
        total = torch.tensor([sum(counts)], dtype=torch.float64, device=self.device)
        if self.world_size > 1 and dist.is_initialized():
            dist.all_reduce(total)
        self._counts, self._total = counts, float(total.item())
        if self._total <= 0:
            raise UsageError(
                f"count= returned 0 for every micro-batch of step {step} on every rank: the step's "
                "loss averages over nothing. Check the count function (e.g. (labels != -100).sum())."
            )

    def weight(self, micro_index: int) -> float:
        """The factor for micro-batch ``micro_index``'s mean loss (:func:`micro_batch_weight`)."""
        return micro_batch_weight(count=self._counts[micro_index], step_total=self._total, world_size=self.world_size)
