"""What a warm worker carries from one trial to the next, how it is cleaned away, and when the
worker must start afresh instead.

A cold trial is a fresh process: it holds the CUDA context and NCCL's buffers, loads the kernels it
uses, and its caching allocator starts empty. A warm worker runs trial after trial in one process,
so a trial could inherit

- **allocator state**: live tensors the previous script left (module globals, reference cycles),
  cached segments, cuBLAS workspaces (kept per handle and stream, out of ``empty_cache``'s reach);
- **memory outside PyTorch**: kernels loaded by earlier trials stay loaded for the life of the
  process (Triton/Inductor kernels of a compiled trial in particular: on one H200 NVML-minus-reserved
  went 1.29 -> 3.80 GiB after one compiled fp32 trial and stayed there for the eager trials after it);
- **CPU load**: Inductor's compile-worker pool of a compiled trial, Python garbage.

How a warm trial is measured as a cold one would be (the choice, and why):

1. Between trials :func:`clean_between_trials` drops what can be dropped: Dynamo's graphs and
   guards, Inductor's compile workers (they would compete with the next trial for the CPU, and a
   cold trial starts its own), reference cycles (``gc.collect``), cuBLAS workspaces, every cached
   segment (``empty_cache``) and the peak statistics. The next trial's allocator then starts as a
   fresh process's does: its reserved peak is not raised by an earlier trial's segments.
2. Memory outside PyTorch cannot be dropped (CUDA never unloads a module a process loaded), and it
   cannot be discounted exactly either: a warm trial's NVML-minus-reserved is ``context + kernels
   loaded by this trial or an earlier one``; the cold figure is ``context + kernels this trial
   loads``. Charging "a fresh worker's baseline + this trial's own growth" undercounts (a kernel an
   earlier trial already loaded is not growth, yet a cold run of this trial loads and pays for it: a
   configuration repeated would be charged the bare context), which can judge an OOM feasible.
   Charging the worker's figure as measured overcounts by what earlier trials loaded that this one
   does not use: safe, and bounded by recycling. So a warm trial's outside-PyTorch figure is
   **measured in its own worker, never discounted**, and the **worker is recycled** (the pool
   restarts before the next trial) whenever, after cleaning, what it holds exceeds a reference by
   more than :data:`RECYCLE_MARGIN_BYTES`:

   - outside PyTorch: the reference is the figure after the pool's first eager trial (context,
     NCCL and the eager kernels nearly every trial loads, as a cold run does), or a fresh
     worker's figure before any trial when the pool has not run an eager trial yet. A compiled
     trial's kernels exceed it, so the pool restarts after it;
   - live tensors or reserved segments left in the allocator over a fresh worker's (a script that
     keeps tensors in a module-level cache).

   A trial therefore inherits at most the margin over what a cold run holds; what it inherited is
   in its report (``warm``), and the study summary says how often pools were recycled and why.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from typing import Any

from autobalance.runtime._memory import DeviceProbe, DeviceReading

__all__ = ["RECYCLE_MARGIN_BYTES", "CarryoverLedger", "clean_between_trials"]

RECYCLE_MARGIN_BYTES = 64 * 2**20
"""A warm worker holding more than this over its reference is restarted (the issue's tolerance for
warm against cold is 2 % or 64 MiB)."""

_MIB = 2**20


def clean_between_trials(device_type: str) -> None:
    """Drop what the previous trial left in this process (see the module docstring, point 1)."""
    import torch

    if "torch._dynamo" in sys.modules:  # compiled trials: the previous trial's graphs and guards
        torch._dynamo.reset()
    if "torch._inductor.async_compile" in sys.modules:
        with contextlib.suppress(Exception):  # the compile workers: CPU contention, and a cold run starts its own
            from torch._inductor.async_compile import shutdown_compile_workers

            shutdown_compile_workers()
    if "torch._inductor.codecache" in sys.modules:
        with contextlib.suppress(Exception):  # compiled modules (and the kernels they reference)
            from torch._inductor.codecache import PyCodeCache

            PyCodeCache.cache_clear(purge=False)
    gc.unfreeze()  # the trial froze what was alive before its measured steps (see the step clock)
    gc.collect()
    if device_type == "cuda":
        torch.cuda.synchronize()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()  # kept per handle and stream otherwise: a cold run allocates them afresh
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _mib(value: int) -> str:
    return f"{value / _MIB:.0f} MiB"


class CarryoverLedger:
    """One warm worker's readings: at pool start (fresh), before each trial, after each trial's
    cleaning; decides when the worker must be recycled (see the module docstring, point 2)."""

    def __init__(self, *, probe: DeviceProbe | None, margin_bytes: int | None = None) -> None:
        self.probe = probe
        self.margin_bytes = RECYCLE_MARGIN_BYTES if margin_bytes is None else margin_bytes
        self.fresh: DeviceReading | None = None
        """The worker at pool start, before any trial (context, NCCL)."""
        self.settled_outside: int | None = None
        """Outside PyTorch after the pool's first eager trial, cleaned: the reference."""
        self.trials = 0
        self._start: DeviceReading | None = None

    def _read(self) -> DeviceReading | None:
        if self.probe is None:
            return None
        try:
            return self.probe.read()
        except Exception:  # NVML hiccup: no reading, no decision from it
            return None

    def pool_started(self) -> None:
        self.fresh = self._read()

    def trial_starting(self) -> dict[str, Any]:
        """Read what this trial inherits; returns the report's ``warm`` figures known so far."""
        self.trials += 1
        self._start = self._read()
        fresh, start = self.fresh, self._start
        return {
            "pool_trial": self.trials,
            "policy": "measured",
            "margin_bytes": self.margin_bytes,
            "scope": start.scope if start is not None else None,
            "fresh_outside": fresh.outside if fresh is not None else None,
            "fresh_reserved": fresh.reserved if fresh is not None else None,
            "fresh_allocated": fresh.allocated if fresh is not None else None,
            "reference_outside": self._reference(),
            "start_outside": start.outside if start is not None else None,
            "start_reserved": start.reserved if start is not None else None,
            "start_allocated": start.allocated if start is not None else None,
            "inherited_outside": self._over(start.outside if start is not None else None),
        }

    def _reference(self) -> int | None:
        if self.settled_outside is not None:
            return self.settled_outside
        return self.fresh.outside if self.fresh is not None else None

    def _over(self, outside: int | None) -> int | None:
        ref = self._reference()
        return None if outside is None or ref is None else max(0, outside - ref)

    def trial_finished(self, *, compiled: bool) -> dict[str, Any]:
        """After the trial and :func:`clean_between_trials`: the report's remaining ``warm``
        figures, ``recycle`` (why the worker must restart, or None) among them."""
        after = self._read()
        reasons: list[str] = []
        if after is not None:
            if not compiled and self.settled_outside is None:
                self.settled_outside = after.outside  # the first eager trial sets the reference
            grown = self._over(after.outside)
            if grown is not None and grown > self.margin_bytes:
                what = "a compiled trial left" if compiled else "trials left"
                whose = ("the pool's first eager trial" if self.settled_outside is not None
                         else "a fresh worker")
                reasons.append(f"{what} {_mib(grown)} outside PyTorch over {whose} (kernels, workspaces)")
            if self.fresh is not None:
                kept = after.allocated - self.fresh.allocated
                if kept > self.margin_bytes:
                    reasons.append(f"{_mib(kept)} of tensors outlived the trial (a module-level cache?)")
                held = after.reserved - self.fresh.reserved
                if held > self.margin_bytes and held - max(kept, 0) > self.margin_bytes:
                    reasons.append(f"the allocator kept {_mib(held)} reserved after emptying its cache")
        return {
            "compiled": compiled,
            "after_outside": after.outside if after is not None else None,
            "after_reserved": after.reserved if after is not None else None,
            "after_allocated": after.allocated if after is not None else None,
            "recycle": "; ".join(reasons) or None,
        }
