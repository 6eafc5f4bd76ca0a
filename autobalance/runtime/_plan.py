"""``autobalance.plan()``: apply one balance configuration to a real DDP training loop.

:class:`Plan` is the training loop's API (``wrap``, ``dataloader``, ``steps``, ``micro_step``,
``backward``, ``optimizer_step``, ``memory``, ``report``). What every run does lives here; what only
some runs do are parts (:mod:`~autobalance.runtime._parts`) called at fixed points. The pieces:

- :mod:`~autobalance.runtime._setup`: settings from the environment, device, process group;
- :mod:`~autobalance.runtime._choice`: which configuration applies, and where it came from;
- :mod:`~autobalance.runtime._meter`: the memory cap and the peaks;
- :mod:`~autobalance.runtime._clock`: step times, warm-up and measured steps, progress;
- :mod:`~autobalance.runtime._exit`: how a trial ends and its report is written once;
- :mod:`~autobalance.runtime._report`: the per-rank report's format;
- :mod:`~autobalance.runtime._wrapping`: ``wrap()``'s pipeline (checkpointing, device, DDP);
- :mod:`~autobalance.runtime._loader`: ``dataloader()`` and the start of each epoch of ``steps()``;
- :mod:`~autobalance.runtime._precision`: autocast, the fp16 GradScaler, the optimizer step;
- parts: :mod:`~autobalance.runtime._compile`, :mod:`~autobalance.runtime._breakdown`,
  :mod:`~autobalance.runtime._verify`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from autobalance import _env
from autobalance._config import BalanceConfig
from autobalance._errors import UsageError
from autobalance.protocol import Status
from autobalance.runtime._batch_dependent import BatchDependence
from autobalance.runtime._breakdown import Breakdown
from autobalance.runtime._busy import BusyMeter
from autobalance.runtime._checkpoint import BlockRun
from autobalance.runtime._choice import choose_config, default_config
from autobalance.runtime._clock import StepClock
from autobalance.runtime._compile import CompileState
from autobalance.runtime._emulate import FewerSMs, SlowRank
from autobalance.runtime._exit import (
    TrialComplete,
    TrialEnd,
    classify_exception,
    set_parent_death_signal,
    setup_failure_reported,
)
from autobalance.runtime._fsdp import ShardedModel, full_state_dict, load_full_state_dict
from autobalance.runtime._loader import epoch_steps, make_loader, start_epoch
from autobalance.runtime._memory import MemorySnapshot
from autobalance.runtime._meter import MemoryMeter
from autobalance.runtime._parts import Part
from autobalance.runtime._precision import (
    TORCH_DTYPES,
    autocast,
    check_dtype_supported,
    make_scaler,
    scaled_backward,
    step_optimizer,
)
from autobalance.runtime._report import build_report
from autobalance.runtime._sampler import StepLayout, UnevenBatchSampler
from autobalance.runtime._setup import init_distributed, int_env, resolve_device
from autobalance.runtime._verify import VerifyRun
from autobalance.runtime._weighting import StepWeights
from autobalance.runtime._wrapping import wrap_model
from autobalance.runtime._zero import OptimizerInfo, ShardedOptimizer

__all__ = ["Plan", "TrialComplete", "classify_exception", "plan"]

CURRENT_PLAN: Plan | None = None
"""The plan most recently built in this process (the warm worker reports through it)."""


class Plan:
    """One rank's view of a balance configuration, with the helpers that apply it.

    Build it with :func:`plan`; then ``wrap`` the model, build the loader with ``dataloader``,
    iterate ``steps``, run each micro-batch under ``micro_step`` with ``backward``, and finish
    each step with ``optimizer_step``.
    """

    def __init__(
        self,
        *,
        config: BalanceConfig,
        defaults: BalanceConfig,
        source: str,
        device: torch.device,
        rank: int,
        world_size: int,
        local_rank: int,
        seed: int,
        blocks: str | None,
        cap_bytes: int | None,
        trial: _env.TrialEnv,
    ) -> None:
        config.validate_for(world_size=world_size)
        check_dtype_supported(config.dtype, device)
        self.config = config
        self.defaults = defaults
        self.source = source
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.seed = seed
        self.blocks_path = blocks
        self.cap_bytes = cap_bytes
        self.trial_dir = trial.trial_dir or None
        self.trial = trial
        """The variables ``plan()`` read (:class:`autobalance._env.TrialEnv`)."""
        self.trial_id = trial.trial_id
        self.measuring = self.trial_dir is not None
        self.scaler: Any = make_scaler(config.dtype, device)
        self.model: nn.Module | None = None
        self.ddp: nn.parallel.DistributedDataParallel | None = None
        self.sharded: ShardedModel | None = None
        """FSDP2's units when the configuration shards parameters (``plan.ddp`` is then None)."""
        self.model_info: dict[str, Any] = {}
        self.block_run: BlockRun | None = None
        """The repeated blocks ``plan.wrap`` found (checkpointing's and regional compilation's)."""
        self._sampler: UnevenBatchSampler | None = None
        self._epoch = 0
        self._layout: StepLayout | None = None
        self._micro_index = 0
        self._step_samples = 0
        self._weights = StepWeights(world_size=world_size, device=device)
        self._steps_done = 0
        # the optional parts: each is None when off, and only those that are on are called
        budgets = config.activation_budget
        self.compile_state = (CompileState(mode=config.compile, budget=budgets[rank] if budgets else None,
                                           sizes=config.micro_step_sizes(rank), backend=trial.compile_backend,
                                           scope=config.compile_scope)
                              if config.compile != "off" else None)
        self.verify = VerifyRun.from_trial_dir(self.trial_dir)
        self.meter = MemoryMeter(device=device, cap_bytes=cap_bytes, measuring=self.measuring)
        self.breakdown = Breakdown(device=device, meter=self.meter, diagnose=trial.diagnose) if self.measuring else None
        self.clock = StepClock(trial_dir=self.trial_dir, rank=rank, device=device,
                               compile_steps=1 if self.compile_state is not None else 0,
                               one_step=self.verify is not None, trial=trial)
        self.ending = TrialEnd(self)
        self.batch_watch = (BatchDependence() if self.measuring and self.compile_state is None else None)
        self.busy = BusyMeter(device=device) if self.measuring else None
        self.slow_rank = SlowRank.from_env(rank, trial)
        self.fewer_sms = FewerSMs.from_env(rank, device, trial)
        """An emulated smaller GPU (``AUTOBALANCE_EMULATE_SMS``), entered here for the whole run."""
        self._parts: list[Part] = [p for p in (self.compile_state, self.breakdown, self.verify, self.batch_watch,
                                               self.slow_rank, self.busy)
                                   if p is not None]
        self.data_info: dict[str, Any] | None = None
        """The dataset as :meth:`dataloader` saw it (samples, global batch, steps per epoch, dropped)."""
        self._repeat_step = False
        """A part asked for the step to be run again (an overflowed fp16 verification step)."""
        self.optimizer_info = OptimizerInfo(sharding=config.optimizer_sharding)
        """The optimizer as the plan saw it (sharded or not, its state's bytes on this rank)."""

    # ----------------------------------------------------------------- public properties
    @property
    def micro_batch(self) -> int:
        """This rank's micro-batch size."""
        return self.config.micro_batches[self.rank]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def autocast_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.config.dtype]

    @property
    def in_trial(self) -> bool:
        return self.trial_dir is not None

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken so far."""
        return self._steps_done

    @property
    def layout(self) -> StepLayout:
        """The current optimizer step's micro-batches (every rank's sample indices)."""
        if self._layout is None:
            raise UsageError("micro_step/backward called outside plan.steps(); call them inside its loop.")
        return self._layout

    # ----------------------------------------------------------------- model and data
    def wrap(
        self,
        model: nn.Module,
        *,
        blocks: str | None = None,
        find_unused_parameters: bool = False,
        loss: Callable[..., torch.Tensor] | None = None,
        embeddings: list[str] | None = None,
    ) -> nn.Module:
        """Checkpoint this rank's chosen blocks, move to the device, then wrap in DDP.

        ``loss``: the script's loss function ``loss(output, *targets)``. The returned module then
        computes it: ``loss = model(x, y)`` (inside ``plan.micro_step()``), so a compiled
        configuration compiles the model and its loss as one graph (the logits are then not kept at
        full size for the backward). Checkpoints keep the model's own ``state_dict`` keys.

        With ``param_sharding`` on, FSDP2 shards the model instead of DDP (``embeddings``: the dotted
        names of the embedding-like modules to shard, when discovery should not pick them); build the
        optimizer on the returned model's parameters, and save with :meth:`full_state_dict`.
        """
        return wrap_model(self, model, parts=self._parts, blocks=blocks,
                          find_unused_parameters=find_unused_parameters, loss=loss, embeddings=embeddings)

    def dataloader(
        self, dataset: Any, *, shuffle: bool = True, seed: int | None = None, **loader_kwargs: Any
    ) -> torch.utils.data.DataLoader[Any]:
        """A loader that yields this rank's micro-batches; uneven shards, every sample once per epoch."""
        self._sampler, self.data_info, loader = make_loader(
            dataset, config=self.config, rank=self.rank, seed=self.seed if seed is None else seed, shuffle=shuffle,
            warn_small=not self.in_trial and self.rank == 0, loader_kwargs=loader_kwargs,
            reverse_within=self.verify is not None and self.verify.reverse)
        return loader

    def steps_per_epoch(self, loader: Any = None) -> int:
        """Optimizer steps in one epoch of ``loader`` (the one :meth:`dataloader` made; default: the
        latest) under the configuration in force: the number a per-step schedule is sized by, e.g.
        ``CosineAnnealingLR(optimizer, T_max=epochs * plan.steps_per_epoch(loader))``, stepped once
        after each ``plan.optimizer_step``. The same on every rank and in every epoch. Not
        ``len(loader)``: that counts this rank's micro-batches (``accumulation`` per step, and an uneven
        split's partial last step differs from rank to rank), so a schedule sized by it is too long
        as soon as a tuned configuration accumulates."""
        return epoch_steps(self._sampler, loader)

    def steps(
        self, loader: Iterable[Any], *, count: Callable[[Any], Any] | None = None
    ) -> Iterator[list[Any]]:
        """One epoch of optimizer steps: each item is this rank's list of micro-batches.

        ``count``: for a loss that is a mean over something other than samples (real tokens,
        with padding or ``ignore_index``), a function of one micro-batch (as the loader yields it)
        returning how many units its loss averages over, e.g.
        ``count=lambda batch: (batch[1] != -100).sum()``. Each micro-batch's loss is then weighted
        by its share of the whole optimizer step's count over all ranks and micro-steps (one scalar
        all-reduce per step, before the first backward), so the update is the global mean over
        those units for any split. Without it, losses are taken as per-sample means.

        In a trial, stops the run (exit code 0) once warm-up and measured steps are done.
        """
        schedule = start_epoch(self._sampler, loader, epoch=self._epoch, world_size=self.world_size,
                               global_batch=self.config.global_batch)
        self._epoch += 1
        batches = iter(loader)
        self.clock.start()
        for layout in schedule.steps:
            items = [next(batches) for _ in layout.micro_batches[self.rank]]
            self._repeat_step = True
            while self._repeat_step:  # once, unless a part asks for the step again (see optimizer_step)
                self._repeat_step = False
                self._layout = layout
                self._step_samples = layout.total
                self._micro_index = 0
                self._weights.start_step(layout, self.rank, items, count, step=self._steps_done)
                for part in self._parts:
                    part.on_step_start(self)
                yield items
            if any([part.trial_done(self) for part in self._parts]) or self.clock.done(self._steps_done):
                self.ending.finish()

    @contextlib.contextmanager
    def micro_step(self, batch: Any = None) -> Iterator[None]:
        """Autocast to the chosen dtype; ``no_sync`` on every micro-step but the last of a step."""
        mine = self.layout.micro_batches[self.rank]
        if self._micro_index >= len(mine):
            raise UsageError(
                f"micro_step called {self._micro_index + 1} times in a step of {len(mine)} micro-batches; "
                "call it once per micro-batch that plan.steps() yielded."
            )
        last = self._micro_index == len(mine) - 1
        contexts = [part.on_micro_step(self) for part in self._parts]
        with contextlib.ExitStack() as stack:
            if not last and self.ddp is not None:
                stack.enter_context(self.ddp.no_sync())
            if self.sharded is not None:
                self.sharded.set_sync(last)
            stack.enter_context(autocast(self.config.dtype, self.device))
            for context in contexts:
                if context is not None:
                    stack.enter_context(context)
            yield
        self._micro_index += 1

    def _loss_weight(self) -> float:
        """What this micro-batch's mean loss is multiplied by (see :mod:`~autobalance.runtime._weighting`):
        its share of the step's samples, or of the step's ``count=`` over all ranks. A private seam: the
        tests replace it from their own code to build a known-wrong runtime (``tests/bugs``)."""
        return self._weights.weight(self._micro_index)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this micro-batch's mean loss, weighted so that DDP's average over ranks
        equals the mean-loss gradient over the whole global batch (uneven splits included)."""
        weight = self._loss_weight()
        for part in self._parts:
            part.before_backward(self)
        scaled_backward(loss * weight, scaler=self.scaler, device=self.device)
        for part in self._parts:
            part.after_backward(self)

    def optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer this configuration asks for: ``optimizer`` itself, or with
        ``optimizer_sharding='zero1'`` a :class:`~autobalance.runtime._zero.ShardedOptimizer` keeping
        this rank's share of the state only (the one changed line:
        ``opt = plan.optimizer(torch.optim.AdamW(model.parameters(), lr=...))``). Call it before the
        first step; the update is the unsharded one's (see :mod:`~autobalance.runtime._zero`)."""
        self.optimizer_info.wrapped = True
        shares = self.config.sharding_shares()
        if shares is None:
            return optimizer
        sharded = ShardedOptimizer(optimizer, shares=shares)
        if self.busy is not None:
            sharded.waiting = self.busy.waiting  # its broadcasts wait for each owner's update
        self.optimizer_info.sharded = sharded
        return sharded

    def full_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """The model's and optimizer's full state on rank 0 (CPU, keyed by parameter names; the other
        ranks get empty dicts) for ``torch.save``: sharded or not, a collective (every rank calls it)."""
        return full_state_dict(model, optimizer)

    def load_full_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                             state: dict[str, Any]) -> None:
        """Load :meth:`full_state_dict`'s result, read on rank 0, into this run's model and optimizer,
        sharded or not (a collective)."""
        load_full_state_dict(model, optimizer, state)

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, *, clip_grad_norm: float | None = None
    ) -> None:
        """Step the optimizer (through the GradScaler for fp16), zero the gradients, measure."""
        for part in self._parts:
            part.before_optimizer_step(self, optimizer)
        step_optimizer(optimizer, scaler=self.scaler, clip_grad_norm=clip_grad_norm)
        for part in self._parts:
            part.after_optimizer_step(self, optimizer)
        self.optimizer_info.after_step(optimizer, rank=self.rank)
        optimizer.zero_grad(set_to_none=True)
        if any([part.repeat_step(self) for part in self._parts]):
            self._repeat_step = True  # the same micro-batches again, as the same (uncounted) step
            return
        self.step_done()

    def step_done(self) -> None:
        """An optimizer step is done: count it, let the parts see it, measure it (also called by a
        framework's loop, :class:`~autobalance.runtime._external.FrameworkLoop`)."""
        self._steps_done += 1
        for part in self._parts:
            part.after_step(self)
        self._layout = None
        if self.measuring:
            self._measure_step()

    def _measure_step(self) -> None:
        self.meter.after_step()
        seconds = self.clock.lap()
        if seconds is not None:
            claimed = [part.step_timed(self, seconds) for part in self._parts]
            self.clock.record(seconds, claimed=any(claimed), samples=self._step_samples)
        self.clock.write_progress(self._steps_done)

    # ----------------------------------------------------------------- measurement
    def memory(self) -> MemorySnapshot:
        """This rank's peak memory so far."""
        return self.meter.snapshot()

    def report(self, *, status: Status = Status.OK, error: str | None = None, tb: str | None = None) -> dict[str, Any]:
        """This rank's figures as a JSON-ready dict (what a trial writes to ``rank<R>.json``)."""
        return build_report(self, status=status, error=error, tb=tb)


def plan(
    *,
    micro_batch: int = 1,
    accumulation: int = 1,
    dtype: str = "fp32",
    checkpoint: int | list[int] | None = None,
    bucket_cap_mb: float = 25.0,
    gradient_as_bucket_view: bool = False,
    global_batch: int | None = None,
    config: BalanceConfig | dict[str, Any] | str | None = None,
    config_file: str | None = None,
    study: str | None = None,
    storage: str | None = None,
    on_mismatch: str = "warn",
    device: str | None = None,
    memory_cap_gib: float | None = None,
    blocks: str | None = None,
    seed: int = 0,
) -> Plan:
    """The balance configuration for this run, and the helpers that apply it.

    Where the configuration comes from, first match wins:

    1. a trial (the launcher sets ``AUTOBALANCE_TRIAL_DIR``): ``AUTOBALANCE_CONFIG``, or the
       script's defaults below for the baseline trial;
    2. explicit arguments: ``config=``, ``config_file=`` or ``study=`` (with ``storage=``);
    3. the environment: ``AUTOBALANCE_CONFIG_FILE``, or ``AUTOBALANCE_STUDY`` (+ ``AUTOBALANCE_STORAGE``);
    4. the script's defaults: ``micro_batch`` on every rank, ``accumulation``, ``dtype``,
       ``checkpoint`` (first N blocks, or a list of block indices), ``bucket_cap_mb``,
       ``gradient_as_bucket_view``.

    Initialises the process group (gloo on CPU, NCCL on CUDA) when launched by torchrun and not
    yet initialised; in a trial its timeout is short so a lost peer cannot hang this rank.
    """
    if on_mismatch not in ("warn", "error"):
        raise UsageError(f"on_mismatch={on_mismatch!r} is unknown; use 'warn' or 'error'.")
    in_trial = _env.in_trial()
    job = _env.TrialEnv.read_job(os.environ)  # what the process group and the device need before the read below
    if in_trial:
        set_parent_death_signal(job.trial_id)
    dev = resolve_device(device, job)
    if dev.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dev = torch.device("cuda", torch.cuda.current_device())
    timeout = int_env(_env.PG_TIMEOUT_S, 60 if in_trial else 1800)
    rank, world_size, local_rank = init_distributed(dev.type, timeout)
    trial = _env.TrialEnv.read(os.environ, rank=rank)  # once per plan(): a warm worker's changes per trial
    cap_bytes = trial.cap_for(rank)
    if cap_bytes is None and memory_cap_gib is not None:
        cap_bytes = int(memory_cap_gib * 2**30)
    defaults = default_config(
        world_size=world_size,
        micro_batch=micro_batch,
        accumulation=accumulation,
        dtype=dtype,
        checkpoint=checkpoint,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
        global_batch=trial.global_batch if trial.global_batch is not None else global_batch,
    )
    with setup_failure_reported(trial):  # e.g. a configuration from the environment that does not validate
        chosen, source = choose_config(
            in_trial=in_trial,
            defaults=defaults,
            config=config,
            config_file=config_file,
            study=study,
            storage=storage,
            on_mismatch=on_mismatch,
            device=dev,
            world_size=world_size,
            cap_bytes=cap_bytes,
            trial_config=trial.config_json,
            trial=trial,
        )
        result = Plan(
            config=chosen,
            defaults=defaults,
            source=source,
            device=dev,
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            seed=seed,
            blocks=blocks,
            cap_bytes=cap_bytes,
            trial=trial,
        )
    global CURRENT_PLAN
    CURRENT_PLAN = result
    if result.in_trial and not trial.warm:
        result.ending.install()
    return result
