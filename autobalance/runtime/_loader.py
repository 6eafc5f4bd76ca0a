"""The plan's data side: the loader of this rank's micro-batches, and the start of each epoch."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from autobalance._config import BalanceConfig
from autobalance._errors import UsageError
from autobalance.runtime._sampler import EpochSchedule, UnevenBatchSampler

__all__ = ["epoch_steps", "make_loader", "start_epoch"]

_SET_BY_PLAN = ("batch_size", "sampler", "batch_sampler", "shuffle", "drop_last")


def make_loader(
    dataset: Any, *, config: BalanceConfig, rank: int, seed: int, shuffle: bool, warn_small: bool,
    loader_kwargs: dict[str, Any], reverse_within: bool = False,
) -> tuple[UnevenBatchSampler, dict[str, Any], torch.utils.data.DataLoader[Any]]:
    """The sampler of uneven shards, what it saw of the dataset (the report's ``data``), and the loader.

    ``warn_small``: warn when the dataset is smaller than one global batch but still gives a step
    (outside trials, on rank 0): one line with the dataset's size, the global batch and what to do.
    """
    for forbidden in _SET_BY_PLAN:
        if forbidden in loader_kwargs:
            raise UsageError(f"dataloader({forbidden}=...) is set by the plan; drop that argument.")
    sampler = UnevenBatchSampler(num_samples=len(dataset), config=config, rank=rank, seed=seed, shuffle=shuffle,
                                 reverse_within=reverse_within)
    schedule = sampler.schedule
    data_info = {"samples": len(dataset), "global_batch": config.global_batch,
                 "steps_per_epoch": len(schedule.steps), "dropped": schedule.dropped}
    if warn_small and 0 < len(dataset) < config.global_batch and schedule.steps:
        # (a dataset with no step at all is an error at the start of the epoch: see start_epoch)
        warnings.warn(
            f"autobalance: the dataset has {len(dataset)} samples, fewer than one global batch "
            f"({config.global_batch}): every optimizer step is one partial step of {schedule.steps[0].total} "
            f"samples; give plan.dataloader() at least {config.global_batch} samples, or use a smaller global "
            "batch (micro-batch x accumulation x ranks).",
            stacklevel=3,  # the script's call of plan.dataloader()
        )
    return sampler, data_info, torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **loader_kwargs)


def start_epoch(
    sampler: UnevenBatchSampler | None, loader: Any, *, epoch: int, world_size: int, global_batch: int
) -> EpochSchedule:
    """The schedule of epoch ``epoch`` of the plan's own loader; a loader not made by the plan, or
    an epoch without a single optimizer step, is the script's mistake."""
    if sampler is None or getattr(loader, "batch_sampler", None) is not sampler:
        raise UsageError(
            "plan.steps(loader) needs the loader made by plan.dataloader(dataset); build it there."
        )
    assert sampler is not None
    sampler.set_epoch(epoch)
    if not sampler.schedule.steps:
        raise UsageError(
            f"the dataset has {sampler.num_samples} sample(s), fewer than the {world_size} ranks: an epoch "
            f"has no optimizer step (nothing would train). Give plan.dataloader() at least {world_size} "
            f"samples (one global batch is {global_batch})."
        )
    return sampler.schedule


def epoch_steps(sampler: UnevenBatchSampler | None, loader: Any = None) -> int:
    """Optimizer steps in one epoch of the plan's loader: what a per-step schedule (cosine, warm-up,
    ``max_steps``) is sized by. The same on every rank and in every epoch (it depends on the dataset's
    size and the configuration's global batch only); ``len(loader)`` is this rank's micro-batches
    instead (``accumulation`` per step, and with an uneven split a partial last step that differs
    from rank to rank)."""
    if sampler is None:
        raise UsageError(
            "plan.steps_per_epoch() before plan.dataloader(); build the loader first and pass it: "
            "plan.steps_per_epoch(loader)."
        )
    if loader is not None and getattr(loader, "batch_sampler", None) is not sampler:
        raise UsageError(
            "plan.steps_per_epoch(loader) needs the loader made by plan.dataloader(dataset) (the latest one); "
            "pass that loader."
        )
    return len(sampler.schedule.steps)
