"""One rank's busy time per optimizer step: its own work, without its wait for the other ranks.

In DDP every rank waits for the slowest at the step's gradient all-reduce, so every rank records
the same step time and the step time alone cannot say which rank is slow. A rank's *busy time* is
its step (from the step's micro-batches being fetched to the end of ``optimizer.step()``) minus its
*wait*, every stretch of the step where the runtime can see the rank waiting for the others:

- the gradient all-reduce: from the moment its last gradient of the step's last micro-step is
  accumulated (it has reached the all-reduce; a hook on every parameter's gradient accumulation
  records the moment) to the end of that backward (DDP's reducer has waited for the all-reduce and
  copied the averaged gradients back). It includes the all-reduce's own transfer time, which every
  rank pays;
- DDP's pre-forward (``DistributedDataParallel._pre_forward``, timed around on the wrapped module:
  every forward through DDP, with gradients or without): it holds DDP's forward-time
  synchronisation, the broadcast of the module's buffers from rank 0 (``broadcast_buffers``, e.g.
  BatchNorm's running statistics, at a step's first forward) and, once, in the second step's first
  forward, the rebuild of the gradient buckets (a broadcast of the bucket order from rank 0). Either
  blocks the rank until the slowest has reached the same forward. Measured (2 gloo ranks, rank 1
  sleeping 20 ms per sample of 16, ``tests/scripts/user_train.py``), before these were timed: rank
  0's second step waited 328 ms there for rank 1's sleep, counted as busy (334 ms, against 6 ms in
  the later steps; ``diagnose``'s median said 181 ms against rank 1's 333); with BatchNorm every
  step did (rank 0 busy 328 ms, rank 1 329 ms). It also holds DDP's own host bookkeeping of a forward (its
  logger, ``prepare_for_forward``, moving inputs that are not on the device yet): microseconds, now
  counted as wait;
- the runtime's own collectives inside the step (:meth:`BusyMeter.waiting`): the parameter
  broadcasts of a sharded optimizer (``optimizer_sharding='zero1'``), where a rank waits for each
  owner's update.

What is not counted as wait (so it is busy if it falls inside the step): collectives of the script
itself (an all-reduce of a metric or of the loss for logging, ``SyncBatchNorm``'s all-gathers,
``all_gather_object``), and of a framework around the loop (a logger's ``sync_dist``). Outside the
measured stretch, neither busy nor wait: fetching the step's micro-batches, the scalar all-reduce
of ``count=`` (:mod:`~autobalance.runtime._weighting`, before the step's start mark), the clock's
all-reduce of the measured-step count, and everything between one step's ``optimizer_step`` and the
next step's start.

- CPU: wall time (``time.perf_counter``), so an emulated slow rank's sleeps count as work
  (:mod:`~autobalance.runtime._emulate`); thread CPU time would miss them and the intra-op threads.
- CUDA: events on the current stream (the CPU runs ahead of the GPU: host clocks measure launches,
  not work); read once per step after the step's synchronisation.

The report carries the median over the measured steps of each (``busy_time_s``,
``allreduce_wait_s``: every wait above, the gradient all-reduce's being the usual bulk).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from autobalance.runtime._parts import Part

if TYPE_CHECKING:
    from torch import nn

    from autobalance.runtime._plan import Plan

__all__ = ["BusyMeter"]


class _Marks:
    """Timestamps of one step: wall seconds on CPU, CUDA events on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start: Any = None
        self.ready: Any = None
        self.backward_end: Any = None
        self.waits: list[tuple[Any, Any]] = []
        """Other waits of the step (DDP's pre-forward, the runtime's own collectives): (from, to)."""

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a: Any, b: Any) -> float:
        if not self.cuda:
            return float(b - a)
        b.synchronize()
        return float(a.elapsed_time(b)) / 1000.0


class BusyMeter(Part):
    """Measures this rank's busy time and its wait for the others per step (see the module docstring)."""

    def __init__(self, *, device: torch.device) -> None:
        self.device = device
        self.marks = _Marks(device)
        self.busy_s: list[float] = []
        """Busy seconds of every counted step (warm-up included)."""
        self.wait_s: list[float] = []
        """Wait seconds of the same steps (the all-reduce's and the others, see the module docstring)."""
        self._last_micro = False
        self._handles: list[Any] = []

    def on_wrapped(self, plan: Plan, wrapped: nn.Module) -> None:
        model = plan.model if plan.model is not None else wrapped
        for p in model.parameters():
            if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        if plan.ddp is not None:
            self._time_pre_forward(plan.ddp)

    def _time_pre_forward(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Count DDP's pre-forward as wait (see the module docstring): its forward-time sync is there.
        Wrapped on this DDP instance only; a torch without ``_pre_forward`` leaves it busy."""
        pre_forward = getattr(ddp, "_pre_forward", None)
        if not callable(pre_forward):
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.waiting():
                return pre_forward(*args, **kwargs)

        ddp._pre_forward = timed  # type: ignore[method-assign]

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count what runs inside as this rank's wait for the others (a collective), when inside a step."""
        if self.marks.start is None:
            yield
            return
        begin = self.marks.now()
        try:
            yield
        finally:
            self.marks.waits.append((begin, self.marks.now()))

    def _grad_ready(self, _param: torch.Tensor) -> None:
        if not self._last_micro:
            return
        if self.marks.cuda:  # one event re-recorded: the last gradient of the backward stays
            if self.marks.ready is None:
                self.marks.ready = torch.cuda.Event(enable_timing=True)
            self.marks.ready.record()
        else:
            self.marks.ready = time.perf_counter()

    def on_step_start(self, plan: Plan) -> None:
        self.marks.start = self.marks.now()
        self.marks.ready = None
        self.marks.backward_end = None
        self.marks.waits = []

    def before_backward(self, plan: Plan) -> None:
        mine = plan.layout.micro_batches[plan.rank]
        self._last_micro = plan._micro_index == len(mine) - 1
        if self._last_micro and not self.marks.cuda:
            self.marks.ready = None

    def after_backward(self, plan: Plan) -> None:
        if self._last_micro:
            self.marks.backward_end = self.marks.now()
            self._last_micro = False

    def after_step(self, plan: Plan) -> None:
        marks = self.marks
        if marks.start is None:
            return
        end = marks.now()
        total = marks.seconds(marks.start, end)
        wait = 0.0
        if marks.ready is not None and marks.backward_end is not None:
            wait = max(0.0, marks.seconds(marks.ready, marks.backward_end))
        wait += sum(max(0.0, marks.seconds(a, b)) for a, b in marks.waits)
        marks.waits = []
        self.busy_s.append(max(0.0, total - wait))
        self.wait_s.append(wait)
        marks.start = None

    def figures(self, measured_steps: int) -> tuple[float | None, float | None]:
        """Median busy and wait seconds of the last ``measured_steps`` steps (None without any)."""
        if measured_steps <= 0 or not self.busy_s:
            return None, None
        busy, wait = self.busy_s[-measured_steps:], self.wait_s[-measured_steps:]
        return statistics.median(busy), statistics.median(wait)
