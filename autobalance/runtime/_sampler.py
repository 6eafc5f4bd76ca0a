"""Uneven data sharding: every sample once per epoch, in proportion to the per-rank split."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from autobalance._config import BalanceConfig, micro_step_sizes, split_at_least, split_evenly

__all__ = ["EpochSchedule", "StepLayout", "UnevenBatchSampler", "epoch_schedule"]


@dataclass(kw_only=True)
class StepLayout:
    """One optimizer step: for each rank, the sample indices of each of its micro-batches."""

    micro_batches: list[list[list[int]]]
    """``micro_batches[rank][m]`` = dataset indices of micro-batch ``m`` on ``rank``."""

    @property
    def total(self) -> int:
        return sum(len(mb) for rank in self.micro_batches for mb in rank)


@dataclass(kw_only=True)
class EpochSchedule:
    steps: list[StepLayout]
    dropped: int
    """Samples left out this epoch (only a tail smaller than the number of ranks)."""


def epoch_schedule(
    *, num_samples: int, config: BalanceConfig, epoch: int, seed: int, shuffle: bool = True,
    reverse_within: bool = False,
) -> EpochSchedule:
    """The whole epoch's assignment of samples to ranks, micro-batches and steps.

    Full steps take ``global_batch`` samples: micro-step ``m`` gives rank ``r`` the next
    ``config.micro_step_sizes(r)[m]`` samples (``micro_batches[r]`` with equal micro-batches). A
    final partial step splits the remaining samples over the ranks in proportion to their samples
    per step (each rank at least one), each rank's share in as few micro-batches as keep every one
    within its largest micro-batch, sizes differing by at most one; so every sample is used exactly
    once; a tail smaller than the number of ranks is dropped. With ``param_sharding`` on, the partial
    step gives every rank the same number of micro-steps (:func:`_tail_sizes`; a tail that cannot be
    split so is dropped).
    Every rank computes the same schedule from (seed, epoch), so no communication is needed.
    ``reverse_within``: each micro-batch's samples in reverse order (the same samples in the same
    micro-batches: a verification floor run).
    """
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(num_samples, generator=g).tolist()
    else:
        order = list(range(num_samples))
    world = config.world_size
    sizes = [config.micro_step_sizes(rank) for rank in range(world)]
    steps: list[StepLayout] = []
    pos = 0
    while num_samples - pos >= config.global_batch:
        layout: list[list[list[int]]] = [[] for _ in range(world)]
        for m in range(config.accumulation):
            for rank in range(world):
                size = sizes[rank][m]
                layout[rank].append(order[pos : pos + size])
                pos += size
        steps.append(StepLayout(micro_batches=layout))
    remaining = num_samples - pos
    tail = _tail_sizes(remaining, config) if remaining >= world else None
    if tail is not None:
        layout = [[] for _ in range(world)]
        for rank, chunks in enumerate(tail):
            for size in chunks:
                layout[rank].append(order[pos : pos + size])
                pos += size
        steps.append(StepLayout(micro_batches=layout))
        remaining = 0
    if reverse_within:
        for step in steps:
            step.micro_batches = [[mb[::-1] for mb in rank] for rank in step.micro_batches]
    return EpochSchedule(steps=steps, dropped=remaining)


def _tail_sizes(remaining: int, config: BalanceConfig) -> list[list[int]] | None:
    """Per rank, the micro-batch sizes of the epoch's partial last step of ``remaining`` samples: split
    in proportion to the ranks' samples per step, each rank's share in as few micro-batches as keep
    every one within its largest. With ``param_sharding`` on, every rank runs the same number of
    micro-steps (the most any rank needs; samples moved to the ranks short of one per micro-step):
    each forward all-gathers, so a rank with fewer would leave the others waiting. None: no such
    split (fewer samples than ranks x micro-steps), the tail is dropped."""
    weights = [float(n) for n in config.samples_per_rank]
    shares = split_evenly(remaining, weights)
    counts = [-(-share // largest) for share, largest in zip(shares, config.micro_batches, strict=True)]
    if config.param_sharding == "off":
        return [micro_step_sizes(share, count) for share, count in zip(shares, counts, strict=True)]
    steps = max(counts)
    if remaining < steps * config.world_size:
        return None
    shares = split_at_least(remaining, weights, steps)
    return [micro_step_sizes(share, steps) for share in shares]


class UnevenBatchSampler:
    """A batch sampler that yields this rank's micro-batches, step after step."""

    def __init__(
        self, *, num_samples: int, config: BalanceConfig, rank: int, seed: int = 0, shuffle: bool = True,
        reverse_within: bool = False,
    ) -> None:
        self.num_samples = num_samples
        self.config = config
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.reverse_within = reverse_within
        self.epoch = 0
        self._schedule: EpochSchedule | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._schedule = None

    @property
    def schedule(self) -> EpochSchedule:
        if self._schedule is None:
            self._schedule = epoch_schedule(
                num_samples=self.num_samples,
                config=self.config,
                epoch=self.epoch,
                seed=self.seed,
                shuffle=self.shuffle,
                reverse_within=self.reverse_within,
            )
        return self._schedule

    def __iter__(self) -> Iterator[list[int]]:
        for step in self.schedule.steps:
            yield from step.micro_batches[self.rank]

    def __len__(self) -> int:
        return sum(len(step.micro_batches[self.rank]) for step in self.schedule.steps)
