"""``autobalance.plan()``: apply one balance configuration to a real DDP training loop."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autobalance import _env
from autobalance._config import DTYPES, BalanceConfig, split_evenly
from autobalance._errors import AutobalanceError, ConfigError, UsageError
from autobalance.protocol import (
    RankDevice,
    RankMemory,
    RankReport,
    RankTiming,
    Status,
    looks_like_oom,
    looks_like_peer_failure,
)
from autobalance.runtime._breakdown import Breakdown
from autobalance.runtime._checkpoint import apply_checkpointing, find_blocks
from autobalance.runtime._compile import CompileState
from autobalance.runtime._memory import (
    CpuMemoryTracker,
    MemorySnapshot,
    NvmlDevice,
    cpu_capacity_bytes,
)
from autobalance.runtime._report import write_report
from autobalance.runtime._sampler import StepLayout, UnevenBatchSampler
from autobalance.runtime._verify import VerifyRun, gradients
from autobalance.runtime._weighting import micro_batch_weight

__all__ = ["Plan", "TrialComplete", "classify_exception", "plan"]

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrialComplete(SystemExit):
    """Raised out of ``plan.steps()`` once a trial has measured its steps (exit code 0)."""

    def __init__(self) -> None:
        super().__init__(0)


def classify_exception(exc: BaseException) -> Status:
    """``oom`` for out-of-memory, ``peer_failed`` for a collective broken by another rank, else ``error``."""
    if isinstance(exc, torch.OutOfMemoryError):
        return Status.OOM
    text = str(exc)
    if isinstance(exc, RuntimeError) and looks_like_oom(text):
        return Status.OOM
    dist_errors = tuple(
        cls
        for cls in (getattr(dist, "DistBackendError", None), getattr(dist, "DistNetworkError", None))
        if cls is not None
    )
    if dist_errors and isinstance(exc, dist_errors):
        return Status.PEER_FAILED
    if isinstance(exc, RuntimeError) and looks_like_peer_failure(text):
        return Status.PEER_FAILED
    return Status.ERROR


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not an integer; set it to a whole number.") from None


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not a number; set it to seconds, e.g. 1.5.") from None
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{name}={raw!r} must be a finite number >= 0; set it to seconds, e.g. 1.5.")
    return value


def _cap_for_rank(raw: str | None, rank: int) -> int | None:
    if not raw:
        return None
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    try:
        values = [int(float(p)) for p in parts]
    except ValueError:
        raise UsageError(
            f"{_env.MEMORY_CAP_BYTES}={raw!r} is not a byte count or a comma-separated list of them."
        ) from None
    if len(values) == 1:
        return values[0]
    if rank >= len(values):
        raise UsageError(
            f"{_env.MEMORY_CAP_BYTES}={raw!r} has {len(values)} entries but this is rank {rank}; "
            "give one cap per rank."
        )
    return values[rank]


CURRENT_PLAN: Plan | None = None
"""The plan most recently built in this process (the warm worker reports through it)."""


def _warm() -> bool:
    return os.environ.get(_env.WARM) == "1"


def _set_parent_death_signal() -> None:
    """Die with the parent (torchrun's agent): a killed tuner must not leave workers behind."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
        if _parent_gone():  # the parent died before prctl took effect
            os._exit(1)
    except OSError:
        pass


def _parent_gone() -> bool:
    """Whether this rank was orphaned: re-parented to init, or to a subreaper that is not torchrun
    (torchrun's environment carries the trial's marker, see the launcher)."""
    ppid = os.getppid()
    if ppid == 1:
        return True
    marker = os.environ.get(_env.TRIAL_ID)
    if not marker:
        return False
    try:
        with open(f"/proc/{ppid}/environ", "rb") as fh:
            environ = fh.read().split(b"\0")
    except OSError:
        return False
    return f"{_env.TRIAL_ID}={marker}".encode() not in environ


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
    ) -> None:
        config.validate_for(world_size=world_size)
        if config.dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError(
                f"dtype='bf16' but {torch.cuda.get_device_name(device)} has no bf16 support; use 'fp16' or 'fp32'."
            )
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
        self.trial_dir = os.environ.get(_env.TRIAL_DIR) or None
        self.trial_id = os.environ.get(_env.TRIAL_ID, "")
        self.warmup_steps = _int_env(_env.WARMUP, 1)
        self.measured_steps = _int_env(_env.STEPS, 3)
        self.measure_s = _float_env(_env.MEASURE_S, 0.0)
        self.max_steps = max(self.measured_steps, _int_env(_env.MAX_STEPS, 50))
        self._target_steps = self.measured_steps
        """Measured steps of this trial: ``measured_steps``, or more once ``measure_s`` sets it."""
        self.measuring = self.trial_dir is not None
        self.scaler: Any = None
        if config.dtype == "fp16":
            self.scaler = torch.amp.GradScaler(device.type)
        self.model: nn.Module | None = None
        self.ddp: nn.parallel.DistributedDataParallel | None = None
        self.model_info: dict[str, Any] = {}
        self._sampler: UnevenBatchSampler | None = None
        self._epoch = 0
        self._layout: StepLayout | None = None
        self._micro_index = 0
        self._step_samples = 0
        self._step_counts: list[float] | None = None
        """With ``plan.steps(loader, count=...)``: this rank's count per micro-batch of the step."""
        self._step_count_total = 0.0
        """... and the step's total count over every rank and micro-batch (one scalar all-reduce)."""
        self._steps_done = 0
        self._step_times: list[float] = []
        self._step_start: float | None = None
        self._started_at = time.time()
        self._first_step_at: float | None = None
        self._report_written = False
        self._tracker: CpuMemoryTracker | None = None
        self._nvml: NvmlDevice | None = None
        self._outside_pytorch = 0
        self._nvml_peak: int | None = None
        self._nvml_scope = "none"
        self._live_before_training: int | None = None
        self.compile_state: CompileState | None = None
        if config.compile != "off":
            budgets = config.activation_budget
            self.compile_state = CompileState(mode=config.compile, budget=budgets[rank] if budgets else None)
        self._compile_steps = 1 if self.compile_state is not None else 0
        """Optimizer steps spent compiling (timed as compile_s, not as a measured step)."""
        self.verify = VerifyRun.from_trial_dir(self.trial_dir)
        self._loss_weighting = os.environ.get(_env.TEST_DISABLE_LOSS_WEIGHTING) != "1"
        self._setup_memory()
        self._breakdown = Breakdown(device=device, tracker=self._tracker) if self.measuring else None

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
        return _TORCH_DTYPES[self.config.dtype]

    @property
    def in_trial(self) -> bool:
        return self.trial_dir is not None

    # ----------------------------------------------------------------- model and data
    def wrap(
        self,
        model: nn.Module,
        *,
        blocks: str | None = None,
        find_unused_parameters: bool = False,
    ) -> nn.Module:
        """Checkpoint this rank's chosen blocks, move to the device, then wrap in DDP."""
        if self._breakdown is not None:
            self._breakdown.on_wrap_entry(model)
        path, block_list = find_blocks(model, blocks or self.blocks_path)
        self.config.validate_for(world_size=self.world_size, num_layers=len(block_list))
        if self.verify is not None:
            self.verify.on_wrap(model, rank=self.rank)
        apply_checkpointing(block_list, self.config.checkpoint[self.rank])
        model = model.to(self.device)
        if self._breakdown is not None:
            self._breakdown.on_model_moved(model)
        params = list(model.parameters())
        self.model_info = {
            "blocks_path": path,
            "num_blocks": len(block_list),
            "num_parameters": sum(p.numel() for p in params),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
            "find_unused_parameters": find_unused_parameters,
            "compile": self.config.compile,
        }
        if self._tracker is not None:
            self._tracker.track_existing(params)
            self._tracker.track_existing(model.buffers())
            self._live_before_training = self._tracker.live_bytes
        elif self.device.type == "cuda":
            self._live_before_training = torch.cuda.memory_allocated(self.device)
        self.model = model
        wrapped: nn.Module = model
        if self.world_size > 1 and dist.is_initialized():
            self.ddp = nn.parallel.DistributedDataParallel(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                bucket_cap_mb=self.config.bucket_cap_mb,
                gradient_as_bucket_view=self.config.gradient_as_bucket_view,
                find_unused_parameters=find_unused_parameters,
            )
            wrapped = self.ddp
        if self._breakdown is not None:
            self._breakdown.on_wrapped(wrapped, find_unused_parameters=find_unused_parameters,
                                       num_blocks=len(block_list), micro_batch=self.micro_batch,
                                       checkpointed=len(self.config.checkpoint[self.rank]),
                                       compiled=self.compile_state is not None)
        if self.compile_state is not None:
            self.compile_state.apply(model)  # in place, inside DDP (which stays as it is)
        return wrapped

    def dataloader(
        self, dataset: Any, *, shuffle: bool = True, seed: int | None = None, **loader_kwargs: Any
    ) -> torch.utils.data.DataLoader[Any]:
        """A loader that yields this rank's micro-batches; uneven shards, every sample once per epoch."""
        for forbidden in ("batch_size", "sampler", "batch_sampler", "shuffle", "drop_last"):
            if forbidden in loader_kwargs:
                raise UsageError(
                    f"dataloader({forbidden}=...) is set by the plan; drop that argument."
                )
        self._sampler = UnevenBatchSampler(
            num_samples=len(dataset),
            config=self.config,
            rank=self.rank,
            seed=self.seed if seed is None else seed,
            shuffle=shuffle,
        )
        return torch.utils.data.DataLoader(dataset, batch_sampler=self._sampler, **loader_kwargs)

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
        sampler = self._sampler
        if sampler is None or getattr(loader, "batch_sampler", None) is not sampler:
            raise UsageError(
                "plan.steps(loader) needs the loader made by plan.dataloader(dataset); build it there."
            )
        assert sampler is not None
        sampler.set_epoch(self._epoch)
        self._epoch += 1
        batches = iter(loader)
        if self._step_start is None:
            self._step_start = time.perf_counter()
            self._first_step_at = time.time()
        for layout in sampler.schedule.steps:
            mine = layout.micro_batches[self.rank]
            self._layout = layout
            self._step_samples = layout.total
            self._micro_index = 0
            items = [next(batches) for _ in mine]
            if count is not None:
                self._count_step(items, count)
            else:
                self._step_counts = None
            if self.verify is not None and self._steps_done == 0:
                self.verify.on_first_step(rank=self.rank)
            yield items
            if self.verify is not None and self._steps_done >= 1:
                self._finish_trial()  # a verification run: one optimizer step, saved
            if self.in_trial and self._steps_done >= self._compile_steps + self.warmup_steps + self._target_steps:
                self._finish_trial()

    def _count_step(self, items: list[Any], count: Callable[[Any], Any]) -> None:
        """Each micro-batch's count (``count=`` of ``plan.steps``) and the step's total over all
        ranks: one scalar all-reduce, before the step's first backward."""
        counts: list[float] = []
        for i, item in enumerate(items):
            value = count(item)
            value = float(value.item() if isinstance(value, torch.Tensor) else value)
            if not math.isfinite(value) or value < 0:
                raise UsageError(
                    f"count= returned {value!r} for micro-batch {i} of step {self._steps_done}; it must be "
                    "a finite number >= 0 (how many units, e.g. real tokens, the micro-batch's loss averages over)."
                )
            counts.append(value)
        total = torch.tensor([sum(counts)], dtype=torch.float64, device=self.device)
        if self.world_size > 1 and dist.is_initialized():
            dist.all_reduce(total)
        self._step_counts = counts
        self._step_count_total = float(total.item())
        if self._step_count_total <= 0:
            raise UsageError(
                f"count= returned 0 for every micro-batch of step {self._steps_done} on every rank: the step's "
                "loss averages over nothing. Check the count function (e.g. (labels != -100).sum())."
            )

    @contextlib.contextmanager
    def micro_step(self, batch: Any = None) -> Iterator[None]:
        """Autocast to the chosen dtype; ``no_sync`` on every micro-step but the last of a step."""
        layout = self._require_layout()
        mine = layout.micro_batches[self.rank]
        if self._micro_index >= len(mine):
            raise UsageError(
                f"micro_step called {self._micro_index + 1} times in a step of {len(mine)} micro-batches; "
                "call it once per micro-batch that plan.steps() yielded."
            )
        last = self._micro_index == len(mine) - 1
        sync = contextlib.nullcontext() if (last or self.ddp is None) else self.ddp.no_sync()
        autocast = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.config.dtype != "fp32"
            else contextlib.nullcontext()
        )
        if self.verify is not None:
            self.verify.set_mode(self.model)
        if self._breakdown is not None:
            self._breakdown.on_micro_step_entry()
        paused = self._tracker_paused() if self.compile_state is not None else contextlib.nullcontext()
        with sync, autocast, paused:
            yield
        self._micro_index += 1

    @contextlib.contextmanager
    def _tracker_paused(self) -> Iterator[None]:
        """Dynamo does not compile under a dispatch mode: the CPU tracker steps aside while the
        compiled model runs (tensors allocated there go uncounted; gradients are added after)."""
        tracker = self._tracker
        if tracker is None:
            yield
            return
        tracker.__exit__(None, None, None)
        try:
            yield
        finally:
            tracker.__enter__()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this micro-batch's mean loss, weighted so that DDP's average over ranks
        equals the mean-loss gradient over the whole global batch (uneven splits included)."""
        layout = self._require_layout()
        if self._step_counts is not None:
            count, total = self._step_counts[self._micro_index], self._step_count_total
        else:
            count, total = len(layout.micro_batches[self.rank][self._micro_index]), self._step_samples
        weight = micro_batch_weight(count=count, step_total=total, world_size=self.world_size) if self._loss_weighting else 1.0
        if self._breakdown is not None:
            self._breakdown.on_backward_entry()
        scaled = loss * weight
        with torch.autocast(self.device.type, enabled=False):
            if self.scaler is not None:
                self.scaler.scale(scaled).backward()
            else:
                scaled.backward()
        if self.compile_state is not None and self._tracker is not None and self.model is not None:
            self._tracker.track_existing(p.grad for p in self.model.parameters() if p.grad is not None)
        if self._breakdown is not None:
            self._breakdown.on_backward_exit(self.model)

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, *, clip_grad_norm: float | None = None
    ) -> None:
        """Step the optimizer (through the GradScaler for fp16), zero the gradients, measure."""
        if self._breakdown is not None:
            self._breakdown.on_optimizer_step_entry(optimizer)
        verify_grads = None
        if self.verify is not None and self.model is not None and self._steps_done == 0:
            scale = float(self.scaler.get_scale()) if self.scaler is not None else 1.0
            verify_grads = gradients(self.model, scale=scale)
        if clip_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        if self._breakdown is not None:
            self._breakdown.on_optimizer_step_exit(optimizer)
        if verify_grads is not None and self.verify is not None and self.model is not None:
            layout = self._require_layout()
            self.verify.save_step(model=self.model, rank=self.rank, grads=verify_grads, layout=layout.micro_batches,
                                  info={"config": self.config.to_dict(), "loss_weighting": self._loss_weighting,
                                        "training": self.model.training})
        optimizer.zero_grad(set_to_none=True)
        if self._breakdown is not None:
            self._breakdown.on_step_done()
        self._steps_done += 1
        self._layout = None
        if self.measuring:
            self._measure_step()

    # ----------------------------------------------------------------- measurement
    def memory(self) -> MemorySnapshot:
        """This rank's peak memory so far."""
        if self.device.type == "cuda":
            # the breakdown resets CUDA's peak statistics once; peaks from before that are kept
            floor = self._breakdown.peak_floor() if self._breakdown is not None else (0, 0)
            return MemorySnapshot(
                peak_allocated=max(floor[0], torch.cuda.max_memory_allocated(self.device)),
                peak_reserved=max(floor[1], torch.cuda.max_memory_reserved(self.device)),
                outside_pytorch=self._outside_pytorch,
                nvml_used_peak=self._nvml_peak,
            )
        peak = self._tracker.peak_bytes if self._tracker is not None else 0
        return MemorySnapshot(peak_allocated=peak, peak_reserved=peak, outside_pytorch=0, nvml_used_peak=None)

    def report(self, *, status: Status = Status.OK, error: str | None = None, tb: str | None = None) -> dict[str, Any]:
        """This rank's figures as a JSON-ready dict (what a trial writes to ``rank<R>.json``)."""
        measured = self._step_times[self.warmup_steps :] if self.in_trial else self._step_times
        step_time = statistics.median(measured) if measured else None
        mem = self.memory()
        return RankReport(
            status=status,
            error=error,
            traceback=tb,
            rank=self.rank,
            local_rank=self.local_rank,
            world_size=self.world_size,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            trial_id=self.trial_id,
            device=self._device_info(),
            config=self.config.to_dict(),
            source=self.source,
            defaults=self.defaults.to_dict(),
            model=self.model_info,
            steps_done=self._steps_done,
            warmup_steps=self.warmup_steps,
            step_times_s=measured,
            step_time_s=step_time,
            measured_steps=len(measured),
            samples_per_s=(self.config.global_batch / step_time) if step_time else None,
            memory=RankMemory(
                peak_allocated=mem.peak_allocated,
                peak_reserved=mem.peak_reserved,
                outside_pytorch=mem.outside_pytorch,
                nvml_used_peak=mem.nvml_used_peak,
                nvml_scope=self._nvml_scope,
                peak_device=mem.peak_device,
                before_training=self._live_before_training,
            ),
            timing=RankTiming(
                startup_s=(self._first_step_at - self._started_at) if self._first_step_at else None,
                compile_s=self.compile_state.compile_s if self.compile_state is not None else None,
                steps_s=sum(self._step_times),
                measure_s=self.measure_s,
                wall_s=time.time() - self._started_at,
            ),
            compile=(self.compile_state.to_dict(device_type=self.device.type) if self.compile_state is not None
                     else {"mode": "off"}),
            activation_budget=self.compile_state.budget_used if self.compile_state is not None else None,
            verify={"dropout": self.verify.dropout, "loss_weighting": self._loss_weighting}
            if self.verify is not None else None,
            breakdown=self._breakdown.to_dict() if self._breakdown is not None else None,
            torch_version=torch.__version__,
            cuda_version=torch.version.cuda,
            written_at=datetime.datetime.now(datetime.UTC).isoformat(),
        ).to_dict()

    def _device_info(self) -> RankDevice:
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            return RankDevice(type="cuda", name=props.name, capacity_bytes=int(props.total_memory),
                              cap_bytes=self.cap_bytes, uuid=self._nvml.uuid if self._nvml else None)
        return RankDevice(type="cpu", name="cpu", capacity_bytes=cpu_capacity_bytes(), cap_bytes=self.cap_bytes)

    def _setup_memory(self) -> None:
        if self.device.type == "cuda":
            if self.cap_bytes is not None:
                total = torch.cuda.get_device_properties(self.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, self.cap_bytes / total), self.device)
            if self.measuring:
                try:
                    self._nvml = NvmlDevice(self.device.index or 0)
                except Exception as exc:  # NVML is optional: report allocator figures only
                    warnings.warn(f"autobalance: NVML unavailable ({exc}); device memory outside PyTorch not measured.", stacklevel=2)
        elif self.measuring or self.cap_bytes is not None:
            self._tracker = CpuMemoryTracker(budget_bytes=self.cap_bytes)
            self._tracker.__enter__()

    def _measure_step(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if self._nvml is not None:
                # what NVML attributes to this process; the device-wide figure counts other processes too
                own = self._nvml.process_used_bytes()
                used = own if own is not None else self._nvml.used_bytes()
                self._nvml_scope = "process" if own is not None else "device"
                self._nvml_peak = max(self._nvml_peak or 0, used)
                self._outside_pytorch = max(
                    self._outside_pytorch, used - torch.cuda.memory_reserved(self.device)
                )
        now = time.perf_counter()
        if self._step_start is not None:
            if self.compile_state is not None and self.compile_state.compile_s is None:
                self.compile_state.first_step_done(now - self._step_start)  # compiled in this step
                if self.verify is not None:  # a verification run has this one step only
                    self._step_times.append(now - self._step_start)
            else:
                self._step_times.append(now - self._step_start)
                if len(self._step_times) == self.warmup_steps + 1 and self.measure_s > 0 and self.verify is None:
                    self._set_target_steps(self._step_times[-1])
                    now = time.perf_counter()  # the agreement is not part of the next step
        self._step_start = now
        if self.trial_dir is not None and self.rank == 0:
            self._write_progress()

    def _set_target_steps(self, first_measured_s: float) -> None:
        """Measure for about ``measure_s``: every rank takes the slowest rank's first measured step
        (one tiny all-reduce, at the same point on every rank), so all stop after the same step."""
        slowest = first_measured_s
        if self.in_trial and dist.is_available() and dist.is_initialized():
            on = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
            t = torch.tensor([first_measured_s], dtype=torch.float64, device=on)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            slowest = float(t.item())
        wanted = math.ceil(self.measure_s / max(slowest, 1e-6))
        self._target_steps = max(self.measured_steps, min(self.max_steps, wanted))

    def _write_progress(self) -> None:
        """Step times so far, for the tuner's pruner (rank 0 only; the ranks step in lockstep)."""
        assert self.trial_dir is not None
        path = os.path.join(self.trial_dir, "progress.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"steps_done": self._steps_done, "warmup_steps": self.warmup_steps,
                       "step_times_s": self._step_times}, fh)
        os.replace(tmp, path)

    def _require_layout(self) -> StepLayout:
        if self._layout is None:
            raise UsageError("micro_step/backward called outside plan.steps(); call them inside its loop.")
        return self._layout

    # ----------------------------------------------------------------- trial lifecycle
    def _write(self, status: Status, error: str | None = None, tb: str | None = None) -> None:
        """Write this rank's report once; a rank that cannot (disk full, directory gone or read-only)
        says why on stderr and leaves with REPORT_FAILED_EXIT_CODE instead of passing for a script error."""
        if self.trial_dir is None or self._report_written:
            return
        self._report_written = True
        try:
            write_report(self.trial_dir, self.rank, self.report(status=status, error=error, tb=tb))
        except Exception as exc:
            _report_not_written(self.rank, self.trial_dir, status, exc)

    def _finish_trial(self) -> None:
        self._write(Status.OK)
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker = None
        if dist.is_initialized() and not _warm():
            dist.destroy_process_group()
        raise TrialComplete()

    def _on_uncaught(self, exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        status = classify_exception(exc)
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(text)
        try:
            self._write(status, error=f"{exc_type.__name__}: {exc}"[:2000], tb=text[-20000:])
        except BaseException as write_exc:  # never let a failing report hide the original error
            _report_not_written(self.rank, self.trial_dir or "", status, write_exc)
        finally:
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(_env.OOM_EXIT_CODE if status == Status.OOM else _env.ERROR_EXIT_CODE)

    def _on_exit(self) -> Status | None:
        """The script ended before the trial's steps were done: report it. Returns the status written
        (``ok`` when the data ran out during a longer ``measure_s`` measurement, after the minimum)."""
        if self.trial_dir is not None and not self._report_written and self._target_steps > self.measured_steps \
                and len(self._step_times) >= self.warmup_steps + self.measured_steps:
            self._write(Status.OK)
            return Status.OK
        if self.trial_dir is not None and not self._report_written:
            self._write(
                Status.ERROR,
                error=(
                    f"the script ended after {self._steps_done} optimizer steps, before the trial's "
                    f"{self.warmup_steps} warm-up + {self.measured_steps} measured steps; give it more data "
                    "or lower --steps"
                ),
            )
            return Status.ERROR
        return None


def _report_not_written(rank: int, trial_dir: str, status: Status, exc: BaseException) -> None:
    """Say on stderr why the report is missing (one line the launcher recognises), then exit."""
    try:
        sys.stderr.write(
            f"\n{_env.REPORT_FAILED_MARKER} rank {rank} could not write its {str(status)!r} report to {trial_dir} "
            f"({type(exc).__name__}: {str(exc)[:300]})\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(_env.REPORT_FAILED_EXIT_CODE)


@contextlib.contextmanager
def _setup_failure_reported(in_trial: bool) -> Iterator[None]:
    """In a trial, a configuration that is rejected still leaves an ``error`` report (then raises)."""
    try:
        yield
    except AutobalanceError as exc:
        if in_trial:
            _write_setup_report(exc)
        raise


def _write_setup_report(exc: BaseException) -> None:
    trial_dir = os.environ.get(_env.TRIAL_DIR) or ""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0") or 0)
    report = RankReport(
        status=Status.ERROR,
        error=f"{type(exc).__name__}: {exc}"[:2000],
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-20000:],
        rank=rank,
        world_size=dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1") or 1),
        hostname=socket.gethostname(),
        pid=os.getpid(),
        trial_id=os.environ.get(_env.TRIAL_ID, ""),
        written_at=datetime.datetime.now(datetime.UTC).isoformat(),
    )
    try:
        write_report(trial_dir, rank, report.to_dict())
    except Exception as write_exc:
        _report_not_written(rank, trial_dir, Status.ERROR, write_exc)


# --------------------------------------------------------------------- construction
def _init_distributed(device_type: str, timeout_s: int) -> tuple[int, int, int]:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
        if device_type == "cuda":
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(**kwargs)
        # the group autobalance created is torn down at exit: a live gloo/NCCL group at
        # interpreter shutdown can abort the process ("terminate called without an active exception")
        atexit.register(_destroy_process_group_at_exit)
    if dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
    return rank, world_size, local_rank


def _destroy_process_group_at_exit() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _resolve_device(device: str | None) -> torch.device:
    choice = device or os.environ.get(_env.DEVICE) or ("cuda" if torch.cuda.is_available() else "cpu")
    if choice not in ("cpu", "cuda"):
        raise UsageError(f"device={choice!r} is not supported; use 'cpu' or 'cuda'.")
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("device='cuda' but no CUDA device is visible; use device='cpu'.")
    return torch.device(choice)


def _defaults(
    *,
    world_size: int,
    micro_batch: int,
    accumulation: int,
    dtype: str,
    checkpoint: int | list[int] | None,
    bucket_cap_mb: float,
    gradient_as_bucket_view: bool,
    global_batch: int | None,
) -> BalanceConfig:
    blocks = list(range(checkpoint)) if isinstance(checkpoint, int) else list(checkpoint or [])
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is unknown; use one of {', '.join(DTYPES)}.")
    if global_batch is None:
        return BalanceConfig.uniform(
            world_size=world_size,
            micro_batch=micro_batch,
            accumulation=accumulation,
            dtype=dtype,
            checkpoint=blocks,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
    if global_batch % accumulation or global_batch // accumulation < world_size:
        accumulation = 1
    if global_batch < world_size:
        raise ConfigError(
            f"global_batch={global_batch} is smaller than the {world_size} ranks; use at least one sample per rank."
        )
    return BalanceConfig(
        micro_batches=split_evenly(global_batch // accumulation, [1.0] * world_size),
        accumulation=accumulation,
        global_batch=global_batch,
        checkpoint=[list(blocks) for _ in range(world_size)],
        dtype=dtype,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )


def _broadcast_json(payload: str | None, *, device: torch.device) -> str:
    """Rank 0's JSON text to every rank (as bytes in a tensor: nothing is pickled)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert payload is not None
        return payload
    dev = device if device.type == "cuda" else torch.device("cpu")
    data = (payload or "").encode()
    size = torch.tensor([len(data)], dtype=torch.long, device=dev)
    dist.broadcast(size, src=0)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=dev)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return bytes(buf.cpu().tolist()).decode()


def _load_stored(
    *,
    study: str | None,
    storage: str | None,
    config_file: str | None,
    on_mismatch: str,
    device: torch.device,
    world_size: int,
    cap_bytes: int | None,
) -> tuple[BalanceConfig, str]:
    """The saved best configuration, read on rank 0 and broadcast so all ranks apply the same row."""
    from autobalance import store

    text: str | None = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            saved = store.load_saved_config(study=study, storage=storage, config_file=config_file)
            nnodes = max(1, world_size // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
            current = store.current_fingerprint(
                device_type=device.type,
                world_size=world_size,
                nnodes=nnodes,
                cap_bytes=[cap_bytes] * world_size,
            )
            script = sys.argv[0] if sys.argv and os.path.isfile(sys.argv[0]) else None
            store.check_compatibility(saved, current=current, script_path=script, policy=on_mismatch)
            text = json.dumps({"config": saved.config.to_dict(), "source": f"store:{saved.study_name}#{saved.trial_number}"})
        except Exception as exc:
            text = json.dumps({"failure": str(exc), "kind": type(exc).__name__})
    shared = json.loads(_broadcast_json(text, device=device))
    if "failure" in shared:
        import autobalance._errors as errors

        kind = getattr(errors, shared["kind"], None)
        if not (isinstance(kind, type) and issubclass(kind, errors.AutobalanceError)):
            kind = errors.StorageError
        raise kind(shared["failure"])
    return BalanceConfig.from_dict(shared["config"]), shared["source"]


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
    if in_trial:
        _set_parent_death_signal()
    dev = _resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dev = torch.device("cuda", torch.cuda.current_device())
    timeout = _int_env(_env.PG_TIMEOUT_S, 60 if in_trial else 1800)
    rank, world_size, local_rank = _init_distributed(dev.type, timeout)
    cap_bytes = _cap_for_rank(os.environ.get(_env.MEMORY_CAP_BYTES), rank)
    if cap_bytes is None and memory_cap_gib is not None:
        cap_bytes = int(memory_cap_gib * 2**30)
    env_global = os.environ.get(_env.GLOBAL_BATCH) if in_trial else None
    defaults = _defaults(
        world_size=world_size,
        micro_batch=micro_batch,
        accumulation=accumulation,
        dtype=dtype,
        checkpoint=checkpoint,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
        global_batch=int(env_global) if env_global else global_batch,
    )
    with _setup_failure_reported(in_trial):  # e.g. a configuration from the environment that does not validate
        chosen, source = _choose_config(
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
        )
    global CURRENT_PLAN
    CURRENT_PLAN = result
    if result.in_trial and not _warm():
        sys.excepthook = result._on_uncaught
        atexit.register(result._on_exit)
    return result


def _choose_config(
    *,
    in_trial: bool,
    defaults: BalanceConfig,
    config: BalanceConfig | dict[str, Any] | str | None,
    config_file: str | None,
    study: str | None,
    storage: str | None,
    on_mismatch: str,
    device: torch.device,
    world_size: int,
    cap_bytes: int | None,
) -> tuple[BalanceConfig, str]:
    if in_trial:
        raw = os.environ.get(_env.CONFIG)
        return (BalanceConfig.from_json(raw), "trial") if raw else (defaults, "defaults")
    if config is not None:
        if isinstance(config, BalanceConfig):
            return config, "argument"
        if isinstance(config, str):
            return BalanceConfig.from_json(config), "argument"
        return BalanceConfig.from_dict(config), "argument"
    file_ = config_file or (None if study else os.environ.get(_env.CONFIG_FILE))
    study_ = study or (None if config_file else os.environ.get(_env.STUDY))
    if file_ or study_:
        return _load_stored(
            study=study_,
            storage=storage or os.environ.get(_env.STORAGE),
            config_file=file_,
            on_mismatch=on_mismatch,
            device=device,
            world_size=world_size,
            cap_bytes=cap_bytes,
        )
    return defaults, "defaults"
