"""Hugging Face ``Trainer``: a Trainer that applies a balance configuration (``pip install -e '.[hf]'``).

Two changed lines in a ``Trainer`` script::

    from autobalance.integrations.hf import BalanceTrainer
    trainer = BalanceTrainer(model=model, args=args, train_dataset=ds, data_collator=collate)  # was Trainer(...)

:class:`BalanceTrainer` builds the plan from the ``TrainingArguments`` (``per_device_train_batch_size``,
``gradient_accumulation_steps``, ``bf16``/``fp16``, ``ddp_bucket_cap_mb``, ``seed``, and
``gradient_checkpointing``'s blocks are the script's defaults; a trial's configuration or a stored
best overrides them, as ``autobalance.plan`` decides; or pass ``plan=``) and applies it:

- the training loader: this rank's micro-batches over the training set (the ``data_collator`` kept),
  every rank the same number of micro-steps;
- ``gradient_accumulation_steps``, ``bf16``/``fp16``, ``ddp_bucket_cap_mb`` and Accelerate's
  ``gradient_as_bucket_view``: set from the configuration before the Trainer is built;
- checkpointing: this rank's chosen blocks (found as ``plan.wrap`` finds them, or ``blocks=``);
  transformers' own ``gradient_checkpointing`` is turned off (it would checkpoint every block on top);
- the loss, as transformers computes it: where transformers normalises by tokens (the model accepts
  ``num_items_in_batch``, or a ``compute_loss_func`` is given: transformers' own test), the loss is
  the global token mean over the step's micro-steps and ranks exactly as ``Trainer`` computes it
  (its ``num_items_in_batch``, its label counting, ``average_tokens_across_devices``), for any split:
  the ranks averaged as DDP does. Else each micro-batch's mean loss, divided by the accumulation, times
  :meth:`~autobalance.runtime.FrameworkLoop.loss_factor`, the ranks weighted by their samples in DDP's
  all-reduce (a per-sample mean: exact for any split). ``average_tokens_across_devices=False`` (each
  rank's own token mean, which depends on the split) is refused on several ranks;
- compile: the model's ``__call__`` with this rank's activation budget; the arguments' ``torch_compile``
  is turned off (the configuration compiles, or not: a compiled configuration is the tuner's choice);
- a trial's reports, then it leaves ``train()``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from autobalance._errors import UsageError
from autobalance.runtime import FrameworkLoop, Plan, find_blocks
from autobalance.runtime import plan as make_plan

_MIXED = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
"""The configuration's dtype as Accelerate's ``mixed_precision``."""

__all__ = ["BalanceTrainer", "plan_from_args"]


_CHECKPOINTING = ("activation_checkpointing", "gradient_checkpointing")
"""transformers' own switches for checkpointing every (n-th) block: 5.25 and later name it
``activation_checkpointing`` (``gradient_checkpointing`` kept as its alias), earlier ones
``gradient_checkpointing``."""


def _checkpoints_every(args: Any) -> int | None:
    """Every how many blocks transformers would checkpoint (its ``every_n_layers``: the blocks whose
    index is a multiple of it), or None when its own checkpointing is off."""
    if not any(getattr(args, name, False) for name in _CHECKPOINTING):
        return None
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or {}
    return max(1, int(kwargs.get("every_n_layers", 1)))


def plan_from_args(args: Any, model: torch.nn.Module | None = None, blocks: str | None = None,
                   **plan_kwargs: Any) -> Plan:
    """``autobalance.plan`` with the ``TrainingArguments`` as the script's defaults. The arguments'
    ``activation_checkpointing`` / ``gradient_checkpointing`` becomes the default "those blocks
    checkpointed" (every block, or every ``every_n_layers``-th: in ``model``'s block list, ``blocks``
    as in :class:`BalanceTrainer`); autobalance then checkpoints, per rank."""
    dtype = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"
    defaults: dict[str, Any] = {
        "micro_batch": int(args.per_device_train_batch_size),
        "accumulation": int(args.gradient_accumulation_steps),
        "dtype": dtype,
        "seed": int(args.seed),
    }
    if getattr(args, "ddp_bucket_cap_mb", None):
        defaults["bucket_cap_mb"] = float(args.ddp_bucket_cap_mb)
    every = _checkpoints_every(args)
    if every is not None and model is not None:
        defaults["checkpoint"] = list(range(0, len(find_blocks(model, blocks)[1]), every))
    defaults.update(plan_kwargs)
    return make_plan(**defaults)


class _LoopCallback(TrainerCallback):
    """The optimizer step's points, where the Trainer calls its callbacks."""

    def __init__(self, trainer: BalanceTrainer) -> None:
        self.trainer = trainer

    def _optimizer(self) -> torch.optim.Optimizer:
        optimizer: Any = self.trainer.optimizer
        inner: torch.optim.Optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper's inside
        return inner

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.ab_loop.before_optimizer_step(self._optimizer())

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.ab_loop.after_optimizer_step(self._optimizer())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.ab_loop.step_end()


class BalanceTrainer(Trainer):
    """``transformers.Trainer`` with a balance configuration applied (see the module docstring).

    ``plan``: a plan built by the script; else one from the ``TrainingArguments`` (:func:`plan_from_args`,
    with ``plan_kwargs`` such as ``study=`` or ``config_file=``). ``blocks``: the dotted path of the
    module list to checkpoint (found automatically otherwise).
    """

    def __init__(self, *args: Any, plan: Plan | None = None, blocks: str | None = None,
                 plan_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        training_args = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
        model = kwargs.get("model") if "model" in kwargs else (args[0] if args else None)
        if training_args is None or model is None:
            raise TypeError("BalanceTrainer needs model= and args= (a TrainingArguments); pass both.")
        self.ab_plan = plan if plan is not None else plan_from_args(training_args, model, blocks,
                                                                    **(plan_kwargs or {}))
        self.ab_loop = FrameworkLoop(self.ab_plan, framework="hf")
        config = self.ab_plan.config
        training_args.gradient_accumulation_steps = config.accumulation
        training_args.per_device_train_batch_size = max(config.micro_batches)
        training_args.bf16 = config.dtype == "bf16"
        training_args.fp16 = config.dtype == "fp16"
        # TrainingArguments resolves its mixed precision once, when built (transformers 5: the
        # ``mixed_precision`` field; 4.x: the ACCELERATE_MIXED_PRECISION variable the Accelerator reads):
        # setting bf16/fp16 afterwards alone leaves the Trainer in the script's own precision
        if hasattr(training_args, "mixed_precision"):
            training_args.mixed_precision = _MIXED[config.dtype]
        else:
            os.environ["ACCELERATE_MIXED_PRECISION"] = _MIXED[config.dtype]
        training_args.ddp_bucket_cap_mb = config.bucket_cap_mb
        # the configuration says which blocks each rank checkpoints: transformers' own checkpointing (every
        # block, on top) would recompute them all and hide what is measured
        for name in _CHECKPOINTING:
            if hasattr(training_args, name):
                setattr(training_args, name, False)
        # likewise compile: the configuration compiles each rank's model with its budget (or not at all);
        # transformers' torch_compile would compile the DDP module around it again. The arguments resolved
        # it when built: a backend the Trainer hands Accelerate's dynamo plugin (accelerate >= 1.2), or
        # the ACCELERATE_DYNAMO_* variables (older accelerate)
        if getattr(training_args, "torch_compile", False):
            training_args.torch_compile = False
            training_args.torch_compile_backend = None
            training_args.torch_compile_mode = None
            os.environ.pop("ACCELERATE_DYNAMO_BACKEND", None)
            os.environ.pop("ACCELERATE_DYNAMO_MODE", None)
        if training_args.ddp_find_unused_parameters is None:  # checkpointing here is non-reentrant: no need
            training_args.ddp_find_unused_parameters = False
        self.ab_loop.prepare_model(model, blocks=blocks)
        super().__init__(*args, **kwargs)
        handler = getattr(self.accelerator, "ddp_handler", None)
        if handler is not None:
            handler.gradient_as_bucket_view = config.gradient_as_bucket_view
        elif config.gradient_as_bucket_view:
            from accelerate.utils import DistributedDataParallelKwargs

            self.accelerator.ddp_handler = DistributedDataParallelKwargs(
                bucket_cap_mb=config.bucket_cap_mb, gradient_as_bucket_view=True)  # type: ignore[arg-type]
        # transformers' token normalisation is kept (see compute_loss); a per-rank token mean is not a loss
        # any other split can compute
        normalises = bool(self.model_accepts_loss_kwargs or self.compute_loss_func is not None)
        across = bool(getattr(self.args, "average_tokens_across_devices", False))  # 4.46 and later have it
        if normalises and not across and self.ab_plan.world_size > 1:
            raise UsageError(
                "BalanceTrainer: TrainingArguments(average_tokens_across_devices=False) on "
                f"{self.ab_plan.world_size} ranks divides each rank's loss by its own tokens, which depends on how "
                "the batch is split; set average_tokens_across_devices=True (transformers' default)."
            )
        self.ab_plan.scaler = getattr(self.accelerator, "scaler", None)
        self.add_callback(_LoopCallback(self))
        self._ab_attached = False
        self._ab_training_step = False

    def get_train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        """This rank's micro-batches over the training set (not re-sharded by Accelerate)."""
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("BalanceTrainer: train_dataset=None; pass the training set to the Trainer.")
        return torch.utils.data.DataLoader(
            dataset, batch_sampler=self.ab_loop.batch_sampler(dataset), collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory)

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        if not self._ab_attached:
            self.ab_loop.attach(model)  # the Trainer's DDP module: the rank weighting hook on it
            self._ab_attached = True
        self.ab_loop.micro_batch_start()
        self._ab_training_step = True
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._ab_training_step = False
        self.ab_loop.after_backward()
        self.ab_loop.micro_batch_end()
        return loss

    def _scaled_for_accumulation(self, num_items_in_batch: Any) -> bool:
        """Whether ``training_step`` takes the loss as already scaled for the accumulation (transformers'
        test: 5.x's ``loss_is_scaled_for_ga`` when set, else normalised by ``num_items_in_batch`` or a
        ``compute_loss_func``; 4.x has the same test without the attribute)."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        return bool(scaled)

    def compute_loss(self, model: torch.nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        out: Any = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        if not self._ab_training_step:  # evaluation: the loss as the Trainer computes it
            return out
        if num_items_in_batch is not None and self._scaled_for_accumulation(num_items_in_batch):
            # transformers' global token mean: divided by the step's tokens on every rank and multiplied by
            # the world size (average_tokens_across_devices), whatever the split: DDP's average is the update
            factor = self.ab_loop.framework_normalised()
        else:
            # a mean over the micro-batch's samples: weighted by them (transformers divides by the accumulation)
            factor = self.ab_loop.loss_factor()
            if self._scaled_for_accumulation(num_items_in_batch):
                factor /= self.ab_loop.accumulation
        self.ab_loop.before_backward()
        if return_outputs:
            loss, outputs = out
            return loss * factor, outputs
        return out * factor
