"""PyTorch Lightning: a DDP strategy that applies a balance configuration (``pip install -e '.[lightning]'``).

One added line (the strategy) and ``strategy=`` in a Lightning script::

    from autobalance.integrations.lightning import BalanceStrategy
    strategy = BalanceStrategy(micro_batch=8)                                       # ab
    trainer = L.Trainer(max_epochs=1, strategy=strategy, devices=strategy.devices)  # ab: strategy=
    trainer.fit(module, train_dataloaders=loader)

:class:`BalanceStrategy` builds the plan (``autobalance.plan(**plan_kwargs)``, or takes ``plan=``) and,
at the framework's own points:

- the training loader: rebuilt over this rank's batch sampler (its micro-batch sizes; every rank the
  same number of micro-steps; the dataset, ``collate_fn`` and workers of the script's loader kept);
- ``trainer.accumulate_grad_batches``: the configuration's accumulation;
- checkpointing: this rank's chosen blocks of the ``LightningModule`` (found as ``plan.wrap`` finds
  them, or ``blocks=``), before DDP;
- precision: the dtype's precision plugin (``32-true``, ``bf16-mixed``, ``16-mixed`` with a GradScaler),
  replacing the Trainer's ``precision=``;
- DDP: ``bucket_cap_mb`` and ``gradient_as_bucket_view``, and the rank weighting hook;
- compile: the ``LightningModule``'s ``__call__`` (``self(x)`` in ``training_step``) with this rank's
  activation budget;
- a trial's reports (warm-up and measured steps, peaks, verification), then it leaves ``fit``;
- the per-batch SIGTERM broadcast of Lightning's training loop (2.5+; a collective before every
  micro-batch, so every micro-batch waits for the slowest rank) counted as the rank's wait, not its
  work: without it a fast rank's busy time includes the slow rank's micro-batches, and the search
  takes the fast rank for the slow one.

Automatic optimization only (one optimizer). ``training_step`` returns the micro-batch's mean loss over
its samples; a loss that is a mean over other units (the real tokens of padded sequences) returns
its count beside it, the one line that keeps the update the mean over the whole step's tokens for any
split (as ``plan.steps(count=)`` does)::

    return {"loss": loss, "count": (labels != -100).sum()}   # ab: the tokens the loss averages over
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy

from autobalance.runtime import FrameworkLoop, Plan
from autobalance.runtime import plan as make_plan

__all__ = ["BalanceCallback", "BalanceStrategy"]


class BalanceCallback(pl.Callback):
    """The loop's points that Lightning calls callbacks at (added by :class:`BalanceStrategy`)."""

    def __init__(self, loop: FrameworkLoop) -> None:
        self.loop = loop

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.loop.micro_batch_start()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self.loop.before_optimizer_step(optimizer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.loop.micro_index == self.loop.accumulation:  # this micro-batch ended an optimizer step
            for optimizer in trainer.optimizers:
                self.loop.after_optimizer_step(optimizer)
            self.loop.step_end()


class BalanceStrategy(DDPStrategy):
    """Lightning's DDP strategy with a balance configuration applied (see the module docstring).

    ``plan``: a plan built by the script (``autobalance.plan(...)``); else one is built from
    ``plan_kwargs`` (``micro_batch=``, ``accumulation=``, ``dtype=``, ``study=`` ...: the script's
    defaults, a trial's configuration or a stored best, as ``autobalance.plan`` decides).
    ``blocks``: the dotted path of the module list to checkpoint (found automatically otherwise).
    ``ddp_kwargs``: further keyword arguments of ``DistributedDataParallel``.
    """

    def __init__(self, plan: Plan | None = None, *, blocks: str | None = None,
                 ddp_kwargs: dict[str, Any] | None = None, **plan_kwargs: Any) -> None:
        self.ab_plan = plan if plan is not None else make_plan(**plan_kwargs)
        self.ab_loop = FrameworkLoop(self.ab_plan, framework="lightning")
        self.ab_blocks = blocks
        self._ab_count: Any = None
        """The ``count`` the current micro-batch's ``training_step`` returned (None: a per-sample mean)."""
        config = self.ab_plan.config
        super().__init__(bucket_cap_mb=config.bucket_cap_mb,
                         gradient_as_bucket_view=config.gradient_as_bucket_view, **(ddp_kwargs or {}))

    @property
    def devices(self) -> int:
        """This node's ranks (``LOCAL_WORLD_SIZE`` under torchrun, else 1): ``Trainer(devices=...)``,
        which Lightning checks against the world size."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def _precision_for_dtype(self) -> Precision:
        dtype, device = self.ab_plan.config.dtype, self.ab_plan.device.type
        if dtype == "bf16":
            return MixedPrecision("bf16-mixed", device)
        if dtype == "fp16":
            return MixedPrecision("16-mixed", device)
        return Precision()

    def setup(self, trainer: pl.Trainer) -> None:
        trainer.accumulate_grad_batches = self.ab_loop.accumulation
        self.precision_plugin = self._precision_for_dtype()
        self.ab_plan.scaler = getattr(self.precision_plugin, "scaler", None)
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(cb, BalanceCallback) for cb in callbacks):
            callbacks.append(BalanceCallback(self.ab_loop))
        assert self.model is not None
        self.ab_loop.prepare_model(self.model, blocks=self.ab_blocks)
        self._count_sigterm_broadcast_as_wait(trainer)
        super().setup(trainer)

    def _count_sigterm_broadcast_as_wait(self, trainer: pl.Trainer) -> None:
        epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        broadcast = getattr(epoch_loop, "_broadcast_sigterm_tensor", None)
        if self.ab_plan.busy is None or broadcast is None or getattr(broadcast, "_ab_counted", False):
            return  # nothing measures busy time outside a trial: production's loop is left as it is
        loop = self.ab_loop

        def counted() -> None:
            with loop.waiting():
                broadcast()

        counted._ab_counted = True  # type: ignore[attr-defined]
        epoch_loop._broadcast_sigterm_tensor = counted  # type: ignore[union-attr]

    def configure_ddp(self) -> None:
        super().configure_ddp()
        assert self.model is not None
        self.ab_loop.attach(self.model)

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or not isinstance(dataloader, torch.utils.data.DataLoader):
            return dataloader
        return torch.utils.data.DataLoader(
            dataloader.dataset, batch_sampler=self.ab_loop.batch_sampler(dataloader.dataset),
            collate_fn=dataloader.collate_fn, num_workers=dataloader.num_workers,
            pin_memory=dataloader.pin_memory, worker_init_fn=dataloader.worker_init_fn,
            persistent_workers=dataloader.persistent_workers if dataloader.num_workers > 0 else False)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        self._ab_count = out.get("count") if isinstance(out, Mapping) else None
        return out

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        loop = self.ab_loop
        count, self._ab_count = self._ab_count, None
        closure_loss = closure_loss * loop.loss_factor(count)
        loop.before_backward()
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        loop.after_backward()
        loop.micro_batch_end()
        return out
