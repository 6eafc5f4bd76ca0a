"""One rank's memory: the cap applied, the peak measured.

On CUDA the cap is ``set_per_process_memory_fraction`` and the peak comes from the caching
allocator; in a trial NVML adds what this process holds outside PyTorch (sampled after each step).
On CPU a :class:`~autobalance.runtime._memory.CpuMemoryTracker` (a dispatch mode, entered here for
the life of the trial) counts live tensors and enforces the cap. A compiled model runs with the
tracker paused (Dynamo does not compile under a dispatch mode); its gradients are counted after
each backward.

A compiled trial's first step compiles; :meth:`MemoryMeter.close_compile_step` keeps that step's
peaks apart (``compile_step``) and restarts the peaks for the steady state (``steady``). The
trial's peak stays the larger of the two (:meth:`snapshot`), which the tuner judges: production
compiles in its first step too.

Outside-PyTorch memory is read through a :class:`~autobalance.runtime._memory.DeviceProbe` (NVML on
CUDA; on CPU none, unless a test installed a fake one).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from autobalance.runtime._memory import (
    CpuMemoryTracker,
    DeviceProbe,
    MemorySnapshot,
    NvmlDevice,
    NvmlProbe,
    device_probe,
)

__all__ = ["MemoryMeter"]


class MemoryMeter:
    """Applies a rank's memory cap and measures its peaks; see the module docstring."""

    def __init__(self, *, device: torch.device, cap_bytes: int | None, measuring: bool) -> None:
        self.device = device
        self.tracker: CpuMemoryTracker | None = None
        self.nvml: NvmlDevice | None = None
        self.outside_pytorch = 0
        self.nvml_peak: int | None = None
        self.nvml_scope = "none"
        self.before_training: int | None = None
        """Live bytes once the model is on the device (before DDP and the first step)."""
        self.peak_floor = (0, 0)
        """CUDA peaks (allocated, reserved) from before the statistics were reset (by the breakdown)."""
        self.probe: DeviceProbe | None = None
        self.compile_step: MemorySnapshot | None = None
        """Peaks up to the end of the compiling step (compiled trials), kept apart from the steady state's."""
        if device.type == "cuda":
            if cap_bytes is not None:
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
            if measuring:
                try:
                    self.nvml = NvmlDevice(device.index or 0)
                    self.probe = device_probe(device)
                    if isinstance(self.probe, NvmlProbe):
                        self.probe.nvml = self.nvml  # one NVML handle
                except Exception as exc:  # NVML is optional: report allocator figures only
                    warnings.warn(f"autobalance: NVML unavailable ({exc}); device memory outside PyTorch not measured.",
                                  stacklevel=3)
        else:
            if measuring or cap_bytes is not None:
                self.tracker = CpuMemoryTracker(budget_bytes=cap_bytes)
                self.tracker.__enter__()
            if measuring:
                self.probe = device_probe(device)  # None, unless a test installed a fake NVML

    def on_model_moved(self, model: nn.Module) -> None:
        if self.tracker is not None:
            self.tracker.track_existing(model.parameters())
            self.tracker.track_existing(model.buffers())
            self.before_training = self.tracker.live_bytes
        elif self.device.type == "cuda":
            self.before_training = torch.cuda.memory_allocated(self.device)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The CPU tracker steps aside (while a compiled model runs: tensors allocated there go uncounted)."""
        tracker = self.tracker
        if tracker is None:
            yield
            return
        tracker.__exit__(None, None, None)
        try:
            yield
        finally:
            tracker.__enter__()

    def track(self, tensors: Iterable[Any]) -> None:
        """Count tensors created while the tracker was paused (a compiled model's gradients)."""
        if self.tracker is not None:
            self.tracker.track_existing(tensors)

    def after_step(self) -> None:
        """A step ended: on CUDA wait for it, and sample what NVML attributes to this process."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.probe is not None:
            # what NVML attributes to this process; the device-wide figure counts other processes too
            reading = self.probe.read()
            if reading is not None:
                self.nvml_scope = reading.scope
                self.nvml_peak = max(self.nvml_peak or 0, reading.used)
                self.outside_pytorch = max(self.outside_pytorch, reading.outside)

    def _since_reset(self) -> MemorySnapshot:
        """Peaks since the compiling step ended (or since the start, with the breakdown's floor)."""
        if self.device.type == "cuda":
            floor = self.peak_floor if self.compile_step is None else (0, 0)
            return MemorySnapshot(
                peak_allocated=max(floor[0], torch.cuda.max_memory_allocated(self.device)),
                peak_reserved=max(floor[1], torch.cuda.max_memory_reserved(self.device)),
                outside_pytorch=self.outside_pytorch,
                nvml_used_peak=self.nvml_peak,
            )
        peak = self.tracker.peak_bytes if self.tracker is not None else 0
        return MemorySnapshot(peak_allocated=peak, peak_reserved=peak, outside_pytorch=self.outside_pytorch,
                              nvml_used_peak=self.nvml_peak)

    def snapshot(self) -> MemorySnapshot:
        """The peaks so far: over the whole trial, the compiling step included."""
        now, first = self._since_reset(), self.compile_step
        if first is None:
            return now
        return MemorySnapshot(
            peak_allocated=max(now.peak_allocated, first.peak_allocated),
            peak_reserved=max(now.peak_reserved, first.peak_reserved),
            outside_pytorch=max(now.outside_pytorch, first.outside_pytorch),
            nvml_used_peak=None if now.nvml_used_peak is None and first.nvml_used_peak is None
            else max(now.nvml_used_peak or 0, first.nvml_used_peak or 0),
        )

    def steady(self) -> MemorySnapshot | None:
        """Peaks of the steps after the compiling step; None for a trial that did not compile."""
        return self._since_reset() if self.compile_step is not None else None

    def close_compile_step(self) -> None:
        """The compiling step is over (its peaks sampled by :meth:`after_step`): keep them apart and
        restart the peaks for the steady state."""
        if self.compile_step is not None:
            return
        self.compile_step = self._since_reset()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.tracker is not None:
            self.tracker.reset_peak()
        self.outside_pytorch = 0
        self.nvml_peak = None

    def close(self) -> None:
        """Leave the CPU tracker: the trial is over (its report is written)."""
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.tracker = None
