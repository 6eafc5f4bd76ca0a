"""A plan driven by a loop it does not own (Lightning, the Hugging Face ``Trainer``, Accelerate).

The framework owns the sampler's loader, the micro-steps, ``backward``, the accumulation and the
optimizer step; :class:`FrameworkLoop` is what its integration (:mod:`autobalance.integrations`)
calls at the framework's own points, so a trial measures, verifies and reports as with
``plan.steps()``:

==============================  =================================================================
call                            where the integration calls it
==============================  =================================================================
``prepare_model``               before the framework wraps the model (checkpointing, facts, parts)
``attach``                      after the framework built DDP: the rank weighting hook
``batch_sampler``               the framework's training loader (full steps only, see below)
``micro_batch_start/_end``      around each micro-batch's forward and backward
``loss_factor``                 the micro-batch's loss is multiplied by it before ``backward``
``before/after_optimizer_step`` around the optimizer step (gradients all-reduced)
``step_end``                    after the step: counted, measured; ends a trial once it is done
``waiting``                     around a collective of the framework's own inside the loop (its
                                wait for the other ranks is not this rank's work)
==============================  =================================================================

Exactness: the framework divides each micro-batch's mean loss by the ``accumulation``;
:func:`~autobalance.runtime._rank_weighting.micro_step_factor` corrects micro-steps of unequal
sizes within a rank, and :func:`~autobalance.runtime._rank_weighting.weighted_sum_hook` weights the
ranks by ``n_r / N`` in DDP's all-reduce. A loss that is a mean over tokens hands its count
(``loss_factor(count=)``), or is normalised by the framework itself (``framework_normalised``):
:class:`~autobalance.runtime._rank_weighting.StepWeighting` then weights it by its share of the step's
count on every rank instead. Every rank must run the same number of micro-steps per
optimizer step (the framework's accumulation is one number), so the batch sampler yields only the
epoch's full steps: the partial last step of :func:`~autobalance.runtime.epoch_schedule` is
dropped with the tail (its samples come first in another epoch's permutation).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autobalance._errors import ConfigError, UsageError
from autobalance.runtime._checkpoint import checkpoint_model, find_blocks
from autobalance.runtime._rank_weighting import (
    RankWeight,
    StepWeighting,
    rank_weight,
    register_rank_weighting,
)
from autobalance.runtime._sampler import EpochSchedule, StepLayout, UnevenBatchSampler
from autobalance.runtime._wrapping import model_facts

if TYPE_CHECKING:
    from autobalance.runtime._plan import Plan

__all__ = ["FrameworkLoop", "FullStepSampler"]


class FullStepSampler(UnevenBatchSampler):
    """This rank's micro-batches of the epoch's full optimizer steps (the partial last step is
    dropped, so every rank runs ``accumulation`` micro-steps per step). A new ``iter()`` starts the
    next epoch (another permutation), as ``DistributedSampler.set_epoch`` does in a framework."""

    def __init__(self, *, loop: FrameworkLoop, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loop = loop
        self._iterations = 0

    @property
    def schedule(self) -> EpochSchedule:
        full = super().schedule
        steps = [s for s in full.steps if s.total == self.config.global_batch]
        dropped = full.dropped + sum(s.total for s in full.steps if s.total != self.config.global_batch)
        return EpochSchedule(steps=steps, dropped=dropped)

    def __iter__(self) -> Any:
        if self._iterations:
            self.set_epoch(self.epoch + 1)
        self._iterations += 1
        self.loop.epoch_started(self.schedule)
        return super().__iter__()


class FrameworkLoop:
    """One rank's plan as a framework's loop drives it (see the module docstring)."""

    def __init__(self, plan: Plan, *, framework: str) -> None:
        sharding = getattr(plan.config, "optimizer_sharding", "off")
        if sharding != "off":
            raise ConfigError(
                f"optimizer_sharding={sharding!r} with the {framework} integration: the framework owns the "
                "optimizer step; use a configuration with optimizer_sharding='off' (tune with sharding off)."
            )
        params = getattr(plan.config, "param_sharding", "off")
        if params != "off":
            raise ConfigError(
                f"param_sharding={params!r} with the {framework} integration: the framework wraps the model in its "
                "own DDP; use a configuration with param_sharding='off' (or the plan's own loop, plan.wrap)."
            )
        self.plan = plan
        self.framework = framework
        self.weighting: RankWeight | None = None
        """The rank weighting hook's state, once :meth:`attach` registered it."""
        self.weights = StepWeighting(config=plan.config, rank=plan.rank, world_size=plan.world_size,
                                     device=plan.device, framework=framework, waiting=self.waiting)
        """Each micro-batch's loss factor and the hook's weight, per step (by samples or by counts)."""
        self._schedule: EpochSchedule | None = None
        self._step_in_epoch = 0
        self._micro = 0
        self._contexts: contextlib.ExitStack | None = None
        self._step_open = False

    @property
    def config(self) -> Any:
        return self.plan.config

    @property
    def accumulation(self) -> int:
        return int(self.plan.config.accumulation)

    # ------------------------------------------------------------------ model and data
    def prepare_model(self, model: nn.Module, *, blocks: str | None = None, move: bool = True) -> nn.Module:
        """Checkpoint this rank's chosen blocks (in place), record the model's facts and call the
        parts' wrap hooks; the framework moves and wraps it afterwards (``move``: to the plan's
        device now)."""
        plan = self.plan
        path, block_list = find_blocks(model, blocks or plan.blocks_path)
        plan.config.validate_for(world_size=plan.world_size, num_layers=len(block_list))
        parts = plan._parts
        for part in parts:
            part.on_wrap(plan, model)
        checkpoint_model(model, block_list, plan.config.checkpoint, plan.rank)
        plan.block_run = block_list
        if move:
            model = model.to(plan.device)
        for part in parts:
            part.on_model_moved(plan, model)
        plan.model_info = model_facts(model, blocks_path=path, num_blocks=len(block_list),
                                      compile=plan.config.compile, find_unused_parameters=False,
                                      loss_in_model=False)
        plan.model_info["framework"] = self.framework
        plan.meter.on_model_moved(model)
        plan.model = model
        return model

    def attach(self, wrapped: nn.Module, *, weighting: bool = True) -> None:
        """The framework built its DDP module (or none, on one rank): register the rank weighting
        hook and call the parts' ``on_wrapped`` (a compiled configuration compiles the inner model)."""
        plan = self.plan
        if plan.model is None:
            raise UsageError(f"{self.framework}: attach() before prepare_model(); prepare the model first.")
        if isinstance(wrapped, nn.parallel.DistributedDataParallel):
            plan.ddp = wrapped
            if weighting and self.weighting is None:
                self.weighting = register_rank_weighting(wrapped, weight=rank_weight(plan.config, plan.rank))
                self.weights.hook = self.weighting
        elif plan.world_size > 1:
            raise UsageError(
                f"{self.framework}: attach(wrapped={type(wrapped).__name__}) with {plan.world_size} ranks needs "
                "the framework's DistributedDataParallel module; use its DDP strategy."
            )
        for part in plan._parts:
            part.on_wrapped(plan, wrapped)

    def batch_sampler(self, dataset: Any, *, shuffle: bool = True, seed: int | None = None) -> FullStepSampler:
        """This rank's batch sampler for the framework's training loader (full steps only)."""
        plan = self.plan
        sampler = FullStepSampler(loop=self, num_samples=len(dataset), config=plan.config, rank=plan.rank,
                                  seed=plan.seed if seed is None else seed, shuffle=shuffle,
                                  reverse_within=plan.verify is not None and plan.verify.reverse)
        schedule = sampler.schedule
        if not schedule.steps:
            raise UsageError(
                f"{self.framework}: the dataset has {len(dataset)} samples, fewer than one global batch "
                f"({plan.config.global_batch}); give the trainer at least one global batch of samples."
            )
        plan._sampler = sampler
        plan.data_info = {"samples": len(dataset), "global_batch": plan.config.global_batch,
                          "steps_per_epoch": len(schedule.steps), "dropped": schedule.dropped}
        return sampler

    def dataloader(self, dataset: Any, *, shuffle: bool = True, **loader_kwargs: Any) -> torch.utils.data.DataLoader[Any]:
        """A loader of this rank's micro-batches over :meth:`batch_sampler`."""
        for forbidden in ("batch_size", "sampler", "batch_sampler", "shuffle", "drop_last"):
            if forbidden in loader_kwargs:
                raise UsageError(f"{self.framework}: dataloader({forbidden}=...) is set by the plan; drop that argument.")
        return torch.utils.data.DataLoader(dataset, batch_sampler=self.batch_sampler(dataset, shuffle=shuffle),
                                           **loader_kwargs)

    def epoch_started(self, schedule: EpochSchedule) -> None:
        self._schedule = schedule
        self._step_in_epoch = 0
        self._micro = 0

    # ------------------------------------------------------------------ the loop's points
    @property
    def layout(self) -> StepLayout:
        if self._schedule is None or self._step_in_epoch >= len(self._schedule.steps):
            raise UsageError(
                f"{self.framework}: a training micro-batch outside the plan's loader; the trainer must train on "
                "the loader the integration builds (its batch sampler)."
            )
        return self._schedule.steps[self._step_in_epoch]

    @property
    def micro_index(self) -> int:
        """The current micro-batch's index within its optimizer step."""
        return self._micro

    def micro_batch_start(self) -> None:
        """A micro-batch's forward begins: at a step's first, the step starts (parts, clock); the
        parts' micro-step contexts are entered (left by :meth:`micro_batch_end`)."""
        plan = self.plan
        if self._micro == 0 and not self._step_open:
            layout = self.layout
            plan._layout = layout
            plan._step_samples = layout.total
            plan._micro_index = 0
            self._step_open = True
            for part in plan._parts:
                part.on_step_start(plan)
            plan.clock.start()
        plan._micro_index = self._micro
        stack = contextlib.ExitStack()
        for part in plan._parts:
            context = part.on_micro_step(plan)
            if context is not None:
                stack.enter_context(context)
        self._contexts = stack

    def loss_factor(self, count: Any = None) -> float:
        """The factor for this micro-batch's loss (before the framework divides it by the
        accumulation). Without ``count`` the loss is a mean over the micro-batch's samples: exact
        micro-steps of unequal sizes within this rank, the ranks weighted by ``n_r / N``. With
        ``count`` (a number or a 0-d tensor: how many units, e.g. real tokens, the loss averages over)
        the update is the mean over every rank's and micro-step's units, as ``plan.steps(count=)``
        gives (:class:`~autobalance.runtime._rank_weighting.StepWeighting`; the step's last
        micro-batch all-reduces the counts)."""
        if count is None:
            mine = self.layout.micro_batches[self.plan.rank]
            return self.weights.samples(micro_index=self._micro, size=len(mine[self._micro]))
        return self.weights.counted(count, micro_index=self._micro, last=self._micro == self.accumulation - 1)

    def framework_normalised(self) -> float:
        """This micro-batch's loss is already normalised by the framework over the whole step on every
        rank and multiplied by the world size (transformers' ``num_items_in_batch`` with
        ``average_tokens_across_devices``): the factor 1, and the ranks averaged as DDP does."""
        return self.weights.normalised(micro_index=self._micro)

    def before_backward(self) -> None:
        for part in self.plan._parts:
            part.before_backward(self.plan)

    def after_backward(self) -> None:
        if self.plan.model is not None:
            self.weights.after_backward(self.plan.model.parameters())
        for part in self.plan._parts:
            part.after_backward(self.plan)

    def micro_batch_end(self) -> None:
        """The micro-batch's backward is done: leave its contexts, count it."""
        if self._contexts is not None:
            self._contexts.close()
            self._contexts = None
        self._micro += 1

    def waiting(self) -> contextlib.AbstractContextManager[None]:
        """A context around a collective the framework runs inside the step (Lightning broadcasts a
        SIGTERM flag before every micro-batch): the time inside is this rank's wait for the others, not
        its busy time (:mod:`~autobalance.runtime._busy`), so a fast rank is not taken for a slow one."""
        busy = self.plan.busy
        return busy.waiting() if busy is not None else contextlib.nullcontext()

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        for part in self.plan._parts:
            part.before_optimizer_step(self.plan, optimizer)

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        for part in self.plan._parts:
            part.after_optimizer_step(self.plan, optimizer)

    def step_end(self) -> None:
        """The optimizer step is done: count and measure it; a trial whose steps are done writes its
        report and leaves the framework's loop (:class:`~autobalance.runtime.TrialComplete`)."""
        plan = self.plan
        if self._micro != self.accumulation:
            raise UsageError(
                f"{self.framework}: an optimizer step after {self._micro} micro-batches, but the configuration "
                f"has {self.accumulation}; let the integration set the trainer's gradient accumulation."
            )
        self._micro = 0
        self._step_in_epoch += 1
        self._step_open = False
        self.weights.step_end()
        plan.step_done()
        if any([part.trial_done(plan) for part in plan._parts]) or plan.clock.done(plan.steps_done):
            plan.ending.finish()
