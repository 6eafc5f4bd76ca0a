"""Accelerate: ``prepare`` and ``backward`` beside an ``Accelerator``'s (``pip install -e '.[accelerate]'``).

A custom loop with ``Accelerator`` (lines marked ``# ab``)::

    from autobalance.integrations.accelerate import AccelerateBalance
    balance = AccelerateBalance(micro_batch=8)                                  # ab: the plan
    accelerator = Accelerator(**balance.accelerator_kwargs())                   # ab: accumulation, dtype, DDP
    model, optimizer, loader = balance.prepare(accelerator, model, optimizer, dataset)  # ab: was accelerator.prepare
    for x, y in loader:
        with accelerator.accumulate(model), balance.micro_step():               # ab: balance.micro_step()
            balance.backward(loss_fn(model(x), y))                              # ab: was accelerator.backward
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:                                          # an optimizer step ended
            scheduler.step()                                                    # sized by balance.steps_per_epoch()

:meth:`AccelerateBalance.accelerator_kwargs` gives the ``Accelerator`` the configuration's
``gradient_accumulation_steps``, ``mixed_precision`` and DDP buckets (a ``DistributedDataParallelKwargs``);
:meth:`~AccelerateBalance.prepare` checkpoints this rank's chosen blocks, has the accelerator prepare the
model and optimizer, registers the rank weighting hook on its DDP module and returns a loader of this
rank's micro-batches (moved to the accelerator's device; not re-sharded by Accelerate);
:meth:`~AccelerateBalance.backward` weights the micro-batch's mean loss and calls ``accelerator.backward``
(which divides it by the accumulation); :meth:`~AccelerateBalance.micro_step` counts the micro-steps, and
after the last one of a step measures it (a trial ends there once its steps are done).

A loss that is a mean over tokens (padded sequences, ``ignore_index``) hands its count, the one
changed line that makes the update the mean over the whole step's tokens for any split::

    balance.backward(loss, count=(labels != -100).sum())                       # ab: the tokens it averages

In a warm worker (one process runs the script once per trial or verification run) Accelerate's
process-wide ``AcceleratorState`` and ``GradientState`` outlive the run that built them, and a next
run whose dtype differs fails (``AcceleratorState has already been initialized and cannot be
changed``): :class:`AccelerateBalance` clears both there (the distributed ``PartialState`` stays, the
process group is the worker's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedDataParallelKwargs, send_to_device

from autobalance._errors import UsageError
from autobalance.runtime import FrameworkLoop, Plan
from autobalance.runtime import plan as make_plan

__all__ = ["AccelerateBalance"]

_MIXED = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


class _DeviceLoader:
    """The plan's loader with each batch sent to the accelerator's device."""

    def __init__(self, loader: torch.utils.data.DataLoader[Any], device: torch.device) -> None:
        self.loader = loader
        self.device = device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield send_to_device(batch, self.device)


class AccelerateBalance:
    """A plan applied beside an ``Accelerator`` (see the module docstring).

    ``plan``: a plan built by the script; else ``autobalance.plan(**plan_kwargs)`` (``micro_batch=``,
    ``accumulation=``, ``dtype=``, ``study=`` ...).
    """

    def __init__(self, plan: Plan | None = None, **plan_kwargs: Any) -> None:
        self.plan = plan if plan is not None else make_plan(**plan_kwargs)
        if self.plan.trial.warm:  # the previous run's Accelerator state (see the module docstring)
            AcceleratorState._reset_state(reset_partial_state=False)
            GradientState._reset_state()
        self.loop = FrameworkLoop(self.plan, framework="accelerate")
        self.accelerator: Accelerator | None = None
        self._optimizer: torch.optim.Optimizer | None = None

    def accelerator_kwargs(self) -> dict[str, Any]:
        """``Accelerator(**...)`` keywords: accumulation, mixed precision and DDP buckets of the configuration."""
        config = self.plan.config
        return {
            "gradient_accumulation_steps": config.accumulation,
            "mixed_precision": _MIXED[config.dtype],
            "cpu": self.plan.device.type == "cpu",
            "kwargs_handlers": [DistributedDataParallelKwargs(
                bucket_cap_mb=config.bucket_cap_mb,  # type: ignore[arg-type]
                gradient_as_bucket_view=config.gradient_as_bucket_view)],
        }

    def prepare(self, accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                dataset: Any, *, blocks: str | None = None, shuffle: bool = True,
                **loader_kwargs: Any) -> tuple[Any, Any, Any]:
        """Checkpoint the chosen blocks, ``accelerator.prepare(model, optimizer)``, the rank weighting
        hook, and this rank's loader over ``dataset`` (``loader_kwargs``: ``collate_fn``, workers ...)."""
        if accelerator.gradient_accumulation_steps != self.loop.accumulation:
            raise UsageError(
                f"Accelerator(gradient_accumulation_steps={accelerator.gradient_accumulation_steps}) but the "
                f"configuration has {self.loop.accumulation}; build it with Accelerator(**balance.accelerator_kwargs())."
            )
        wanted = _MIXED[self.plan.config.dtype]
        if str(accelerator.mixed_precision) != wanted:
            raise UsageError(
                f"Accelerator(mixed_precision={str(accelerator.mixed_precision)!r}) but the configuration's dtype is "
                f"{self.plan.config.dtype} ({wanted!r}); build it with Accelerator(**balance.accelerator_kwargs())."
            )
        backend = getattr(getattr(accelerator.state, "dynamo_plugin", None), "backend", None)
        dynamo = str(getattr(backend, "value", backend)).lower()
        if backend is not None and dynamo != "no":
            raise UsageError(
                f"Accelerator(dynamo_backend={dynamo!r}) would compile the "
                "prepared model on top of the configuration's compile; leave dynamo_backend out (the "
                "configuration compiles each rank's model with its budget, or not)."
            )
        self.accelerator = accelerator
        self.loop.prepare_model(model, blocks=blocks)
        model, optimizer = accelerator.prepare(model, optimizer)
        self.loop.attach(model)
        self.plan.scaler = getattr(accelerator, "scaler", None)
        inner = getattr(optimizer, "optimizer", optimizer)
        self._optimizer = inner
        inner.register_step_pre_hook(lambda opt, args, kwargs: self.loop.before_optimizer_step(opt))
        inner.register_step_post_hook(lambda opt, args, kwargs: self.loop.after_optimizer_step(opt))
        loader = self.loop.dataloader(dataset, shuffle=shuffle, **loader_kwargs)
        return model, optimizer, _DeviceLoader(loader, accelerator.device)

    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch of the loader :meth:`prepare` returned, the same on every rank:
        what a per-step schedule is sized by (``CosineAnnealingLR(optimizer, T_max=epochs *
        balance.steps_per_epoch())``, stepped when ``accelerator.sync_gradients``). Not ``len(loader)``,
        which counts micro-batches (``accumulation`` per step)."""
        if self.accelerator is None:
            raise UsageError("balance.steps_per_epoch() before balance.prepare(accelerator, ...); prepare first.")
        return self.plan.steps_per_epoch()

    @contextlib.contextmanager
    def micro_step(self) -> Iterator[None]:
        """One micro-batch (its forward, :meth:`backward` and, on the last, the optimizer step); after
        the step's last micro-batch the step is counted and measured."""
        self.loop.micro_batch_start()
        yield
        if self.loop.micro_index == self.loop.accumulation:
            self.loop.step_end()

    def backward(self, loss: torch.Tensor, *, count: Any = None, **kwargs: Any) -> None:
        """``accelerator.backward`` of the micro-batch's mean loss, weighted for uneven splits.
        ``count``: for a loss that is a mean over other units than samples (the real tokens of padded
        sequences), how many the micro-batch holds, e.g. ``(labels != -100).sum()``: the update is then
        the mean over the whole step's units on every rank (as ``plan.steps(count=)`` gives)."""
        if self.accelerator is None:
            raise UsageError("balance.backward() before balance.prepare(accelerator, ...); prepare first.")
        factor = self.loop.loss_factor(count)
        self.loop.before_backward()
        self.accelerator.backward(loss * factor, **kwargs)
        self.loop.after_backward()
        self.loop.micro_batch_end()
