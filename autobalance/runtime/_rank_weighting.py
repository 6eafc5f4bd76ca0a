"""Exact uneven updates when a framework owns ``backward``: weight the ranks inside DDP's all-reduce.

DDP's own all-reduce averages the ranks' gradients (``sum_r g_r / W``). Rank ``r``'s gradient
``g_r`` is the gradient of its mean loss over its ``n_r`` samples of the step (a framework divides
each micro-batch's mean loss by the number of micro-steps; :func:`micro_step_factor` makes
micro-steps of unequal sizes exact). The global batch's mean loss over all ``N = sum_r n_r`` samples
has the gradient ``sum_r (n_r / N) g_r``, which the average gives only when every ``n_r`` is equal.
The communication hook :func:`weighted_sum_hook` multiplies each bucket by ``n_r / N`` and
all-reduces with ``SUM``: the averaged update of an even split, the exact update of an uneven one.

The runtime's own loop (``plan.backward``) weights the loss instead and needs no hook; the
integrations (:mod:`autobalance.integrations`) register this one on the framework's DDP module.
"""

# no ``from __future__ import annotations``: DDP checks the hook's annotations at run time (GradBucket, Future)
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autobalance._config import BalanceConfig
from autobalance._errors import UsageError

__all__ = ["RankWeight", "micro_step_factor", "rank_weight", "register_rank_weighting", "weighted_sum_hook"]


@dataclass(kw_only=True)
class RankWeight:
    """The state of :func:`weighted_sum_hook` on one rank."""

    weight: float
    """This rank's share of the optimizer step's samples, ``n_r / N``."""
    process_group: Any = None
    """The group to all-reduce over (``None``: the default group)."""
    calls: int = 0
    """Buckets all-reduced so far (a test reads it: the hook ran)."""


def rank_weight(config: BalanceConfig, rank: int) -> float:
    """``n_r / N``: rank ``rank``'s samples per optimizer step over the global batch."""
    return config.samples_per_rank[rank] / config.global_batch


def micro_step_factor(config: BalanceConfig, rank: int, micro_index: int, size: int | None = None) -> float:
    """What a framework's micro-batch loss (its mean loss already divided by the ``accumulation``
    micro-steps) is multiplied by so that the rank's accumulated gradient is the gradient of its mean
    loss over all its samples of the step: ``accumulation * size / n_r`` (1 when the rank's
    micro-steps are equal). ``size``: the micro-batch's samples (default: the configuration's)."""
    sizes = config.micro_step_sizes(rank)
    if not 0 <= micro_index < len(sizes):
        raise UsageError(
            f"micro_index={micro_index} is outside rank {rank}'s {len(sizes)} micro-steps; "
            "count micro-batches from 0 within each optimizer step."
        )
    n = size if size is not None else sizes[micro_index]
    return config.accumulation * n / config.samples_per_rank[rank]


def weighted_sum_hook(state: RankWeight, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``sum_r w_r * g_r`` over the ranks instead of ``sum_r g_r / W``."""
    state.calls += 1
    tensor = bucket.buffer()
    tensor.mul_(state.weight)
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def register_rank_weighting(ddp: torch.nn.parallel.DistributedDataParallel, *, weight: float,
                            process_group: Any = None) -> RankWeight:
    """Register :func:`weighted_sum_hook` on ``ddp`` with this rank's ``weight`` (``n_r / N``);
    returns its state. A DDP module takes one communication hook, once."""
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise UsageError(
            f"register_rank_weighting(ddp={type(ddp).__name__}) needs a DistributedDataParallel module; "
            "pass the framework's DDP-wrapped model."
        )
    if not 0.0 < weight <= 1.0:
        raise UsageError(f"register_rank_weighting(weight={weight}) must be in (0, 1]: n_r / N of this rank.")
    state = RankWeight(weight=weight, process_group=process_group)
    ddp.register_comm_hook(state, weighted_sum_hook)  # type: ignore[arg-type]
    return state
