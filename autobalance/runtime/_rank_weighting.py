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

A loss that is a mean over other units than samples (real tokens of padded sequences) is weighted by
:class:`StepWeighting` per optimizer step, in one of three modes:

- ``samples`` (no count): the above, the hook's weight ``n_r / N``;
- ``counts`` (the integration hands each micro-batch's count ``c_i``: Lightning's ``{"loss", "count"}``,
  Accelerate's ``backward(loss, count=)``): the update is the gradient of ``sum_i c_i l_i / T`` over all
  ranks and micro-steps (``T = sum_i c_i``), as ``plan.steps(count=)`` gives. The framework hands the
  micro-batches one at a time, so ``T`` is known only at the step's last micro-batch: each loss is
  multiplied by ``accumulation * c_i / P_r`` (``P_r``: this rank's guess of ``T`` from its first
  micro-batch, so the gradients keep their usual scale), one scalar all-reduce before the last
  backward gives ``T``, and the hook's weight ``P_r / T`` (summed) turns the rank's accumulated
  ``sum_i c_i g_i / P_r`` into its exact share (one process without DDP: the gradients are
  multiplied by ``P / T`` after the last backward);
- ``normalised`` (the framework already divided each loss by the step's total over every rank and
  multiplied it by the world size: transformers' ``num_items_in_batch`` with
  ``average_tokens_across_devices``): no factor, the hook's weight ``1 / W`` (DDP's own average).
"""

# no ``from __future__ import annotations``: DDP checks the hook's annotations at run time (GradBucket, Future)
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autobalance._config import BalanceConfig
from autobalance._errors import UsageError

__all__ = ["RankWeight", "StepWeighting", "micro_step_factor", "rank_weight", "register_rank_weighting",
           "weighted_sum_hook"]


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


def count_value(count: Any, *, where: str) -> float:
    """A micro-batch's count as a float (a tensor's ``.item()``); a one-line error unless finite and >= 0."""
    try:
        value = float(count.item() if isinstance(count, torch.Tensor) else count)
    except (TypeError, ValueError, RuntimeError):
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise UsageError(
            f"count={count!r} for {where}: it must be a finite number >= 0 (how many units, e.g. real "
            "tokens, the micro-batch's loss averages over), such as (labels != -100).sum()."
        )
    return value


class StepWeighting:
    """One rank's loss weights per optimizer step when a framework calls ``backward`` (see the module
    docstring: the ``samples``, ``counts`` and ``normalised`` modes). Every micro-batch of a step must
    be in the step's mode (the first one's)."""

    def __init__(self, *, config: BalanceConfig, rank: int, world_size: int, device: torch.device,
                 framework: str, waiting: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.framework = framework
        self.waiting = waiting
        self.hook: RankWeight | None = None
        """The rank weighting hook's state (None: no DDP module, one process)."""
        self.mode: str | None = None
        """This step's mode (None before its first micro-batch's loss)."""
        self.total: float | None = None
        """``counts``: the step's count over every rank and micro-batch, once reduced."""
        self.rescale: float | None = None
        """``counts`` without a hook: what the gradients are multiplied by after the last backward."""
        self._counts: dict[int, float] = {}
        self._guess = 1.0
        self._steps = 0

    def _enter(self, mode: str, micro_index: int) -> None:
        if self.mode is None:
            self.mode = mode
        elif self.mode != mode:
            said = {"samples": "without a count", "counts": "with a count",
                    "normalised": "normalised by the framework"}
            raise UsageError(
                f"{self.framework}: micro-batch {micro_index} of step {self._steps} has a loss {said[mode]}, the "
                f"step's first {said[self.mode]}; hand a count for every micro-batch or for none."
            )

    def samples(self, *, micro_index: int, size: int) -> float:
        """``samples`` mode: :func:`micro_step_factor`; the hook weights the rank by ``n_r / N``."""
        self._enter("samples", micro_index)
        if self.hook is not None:
            self.hook.weight = rank_weight(self.config, self.rank)
        return micro_step_factor(self.config, self.rank, micro_index, size=size)

    def normalised(self, *, micro_index: int) -> float:
        """``normalised`` mode: factor 1; the hook averages the ranks (weight ``1 / W``), as DDP does."""
        self._enter("normalised", micro_index)
        if self.hook is not None:
            self.hook.weight = 1.0 / self.world_size
        return 1.0

    def counted(self, count: Any, *, micro_index: int, last: bool) -> float:
        """``counts`` mode: ``accumulation * c_i / P_r``; at the step's ``last`` micro-batch, the scalar
        all-reduce of the counts and the hook's weight ``P_r / T`` (see the module docstring)."""
        value = count_value(count, where=f"micro-batch {micro_index} of step {self._steps}")
        self._enter("counts", micro_index)
        if not self._counts:
            self._guess = max(value, 1.0) * self.config.accumulation * self.world_size
        self._counts[micro_index] = value
        if last:
            total = torch.tensor([sum(self._counts.values())], dtype=torch.float64, device=self.device)
            if self.world_size > 1:
                if self.hook is None:
                    raise UsageError(
                        f"{self.framework}: a loss with a count on {self.world_size} ranks without the "
                        "framework's DistributedDataParallel module; use its DDP strategy."
                    )
                with self.waiting():
                    dist.all_reduce(total)
            self.total = float(total.item())
            if self.total <= 0:
                raise UsageError(
                    f"{self.framework}: every micro-batch of step {self._steps} on every rank has count 0: the "
                    "step's loss averages over nothing. Check the count (e.g. (labels != -100).sum())."
                )
            if self.hook is not None:
                self.hook.weight = self._guess / self.total
            else:
                self.rescale = self._guess / self.total
        return self.config.accumulation * value / self._guess

    def after_backward(self, parameters: Any) -> None:
        """``counts`` on one process: the last backward's gradients multiplied by ``P / T``."""
        if self.rescale is None:
            return
        with torch.no_grad():
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(self.rescale)
        self.rescale = None

    def step_end(self) -> None:
        self.mode, self.total, self.rescale = None, None, None
        self._counts = {}
        self._steps += 1
