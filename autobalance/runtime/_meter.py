"""One rank's memory: the cap applied, the peak measured.

On CUDA the cap is ``set_per_process_memory_fraction`` and the peak comes from the caching
allocator; in a trial NVML adds what this process holds outside PyTorch (sampled after each step).
On CPU a :class:`~autobalance.runtime._memory.CpuMemoryTracker` (a dispatch mode, entered here for
the life of the trial) counts live tensors and enforces the cap. A compiled model runs with the
tracker paused (Dynamo does not compile under a dispatch mode); its gradients are counted after
each backward.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from autobalance.runtime._memory import CpuMemoryTracker, MemorySnapshot, NvmlDevice

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
        if device.type == "cuda":
            if cap_bytes is not None:
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
            if measuring:
                try:
                    self.nvml = NvmlDevice(device.index or 0)
                except Exception as exc:  # NVML is optional: report allocator figures only
                    warnings.warn(f"autobalance: NVML unavailable ({exc}); device memory outside PyTorch not measured.",
                                  stacklevel=3)
        elif measuring or cap_bytes is not None:
            self.tracker = CpuMemoryTracker(budget_bytes=cap_bytes)
            self.tracker.__enter__()

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
        if self.device.type != "cuda":
            return
        torch.cuda.synchronize(self.device)
        if self.nvml is not None:
            # what NVML attributes to this process; the device-wide figure counts other processes too
            own = self.nvml.process_used_bytes()
            used = own if own is not None else self.nvml.used_bytes()
            self.nvml_scope = "process" if own is not None else "device"
            self.nvml_peak = max(self.nvml_peak or 0, used)
            self.outside_pytorch = max(self.outside_pytorch, used - torch.cuda.memory_reserved(self.device))

    def snapshot(self) -> MemorySnapshot:
        """The peaks so far."""
        if self.device.type == "cuda":
            floor = self.peak_floor
            return MemorySnapshot(
                peak_allocated=max(floor[0], torch.cuda.max_memory_allocated(self.device)),
                peak_reserved=max(floor[1], torch.cuda.max_memory_reserved(self.device)),
                outside_pytorch=self.outside_pytorch,
                nvml_used_peak=self.nvml_peak,
            )
        peak = self.tracker.peak_bytes if self.tracker is not None else 0
        return MemorySnapshot(peak_allocated=peak, peak_reserved=peak, outside_pytorch=0, nvml_used_peak=None)

    def close(self) -> None:
        """Leave the CPU tracker: the trial is over (its report is written)."""
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.tracker = None
