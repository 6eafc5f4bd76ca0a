"""Per-rank memory measurement: the CUDA caching allocator plus NVML, or live tensors on CPU."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "CpuMemoryTracker",
    "DeviceProbe",
    "DeviceReading",
    "MemorySnapshot",
    "NvmlDevice",
    "NvmlProbe",
    "cpu_capacity_bytes",
    "device_probe",
    "install_probe_factory",
]


def cpu_capacity_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


class CpuMemoryTracker(TorchDispatchMode):
    """Counts the bytes of live CPU tensor storages, with a budget that raises an OOM.

    Every op output goes through ``__torch_dispatch__``; each new storage is counted once and
    uncounted when its storage object dies (a weakref callback). Tensors that existed before the
    tracker started are added with :meth:`track_existing` (e.g. a model's parameters).
    """

    def __init__(self, *, budget_bytes: int | None = None) -> None:
        super().__init__()
        self.budget_bytes = budget_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self.window_peak = 0
        """Peak since :meth:`start_window` (the global ``peak_bytes`` is left alone)."""
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        grew = False
        for item in flat:
            if isinstance(item, torch.Tensor):
                grew |= self._track(item)
        if grew and self.budget_bytes is not None and self.live_bytes > self.budget_bytes:
            live = self.live_bytes
            del out, flat
            raise torch.OutOfMemoryError(
                f"CPU memory budget exceeded: {live / 2**20:.1f} MiB live tensors > budget "
                f"{self.budget_bytes / 2**20:.1f} MiB (autobalance memory cap)"
            )
        return out

    def track_existing(self, tensors: Any) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._track(t)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def start_window(self) -> None:
        self.window_peak = self.live_bytes

    def _track(self, tensor: torch.Tensor) -> bool:
        tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor: this rank's shard
        if tensor.device.type != "cpu" or tensor.is_sparse:
            return False
        try:
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
            key = storage._cdata  # the storage itself, whatever its data pointer after a resize
        except (NotImplementedError, RuntimeError, AttributeError):
            return False
        if nbytes == 0 or key in self._refs:
            return False
        self._refs[key] = weakref.ref(storage, self._make_release(key))
        self._sizes[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.window_peak = max(self.window_peak, self.live_bytes)
        return True

    def resized(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage was resized in place (FSDP2 frees and re-allocates gathered weights so,
        out of any dispatch mode's sight: :mod:`~autobalance.runtime._fsdp` reports each)."""
        if tensor.device.type != "cpu":
            return
        storage = tensor.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if key not in self._sizes:
            self._track(tensor)
            return
        self.live_bytes += nbytes - self._sizes[key]
        self._sizes[key] = nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.window_peak = max(self.window_peak, self.live_bytes)

    def _make_release(self, key: int) -> Any:
        def release(_ref: Any) -> None:
            if self._refs.get(key) is _ref:
                del self._refs[key]
                self.live_bytes -= self._sizes.pop(key)

        return release


class NvmlDevice:
    """Device-level memory from NVML for one CUDA device, matched by UUID (never by index)."""

    def __init__(self, torch_device_index: int) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(torch_device_index).uuid)
        uuid = uuid if uuid.startswith("GPU-") else "GPU-" + uuid
        self.uuid = uuid
        self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)

    def used_bytes(self) -> int:
        """Device-wide use: includes every process on this GPU."""
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def process_used_bytes(self, pid: int | None = None) -> int | None:
        """This process's use of the device (CUDA context and NCCL buffers included), or None
        where NVML cannot attribute memory to processes (e.g. some containers)."""
        pid = os.getpid() if pid is None else pid
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:
            return None
        used = [p.usedGpuMemory for p in procs if p.pid == pid and p.usedGpuMemory is not None]
        return int(sum(used)) if used else None

    def total_bytes(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).total)


@dataclass(kw_only=True)
class MemorySnapshot:
    """Peak memory figures of one rank, in bytes."""

    peak_allocated: int
    """Peak bytes of live tensors (CUDA allocator ``max_memory_allocated`` or the CPU tracker)."""
    peak_reserved: int
    """Peak bytes held by the CUDA caching allocator (equals peak_allocated on CPU)."""
    outside_pytorch: int
    """Largest NVML-used minus allocator-reserved seen (CUDA context, NCCL buffers); 0 on CPU."""
    nvml_used_peak: int | None
    """Largest device-level use NVML reported; None on CPU or without NVML."""

    @property
    def peak_device(self) -> int:
        """The figure that causes OOM: reserved by the allocator plus memory outside it."""
        return self.peak_reserved + self.outside_pytorch


@dataclass(kw_only=True)
class DeviceReading:
    """What one process holds on its device at one moment, in bytes."""

    used: int
    """NVML's figure: this process's use (``scope`` ``process``), else the whole device's."""
    reserved: int
    """Held by PyTorch's caching allocator at the same moment."""
    allocated: int
    """Live tensors in the caching allocator at the same moment."""
    scope: str
    """``process``, ``device`` (NVML cannot attribute memory to processes) or ``fake`` (tests)."""

    @property
    def outside(self) -> int:
        """Memory outside the caching allocator: CUDA context, NCCL buffers, loaded kernels."""
        return max(0, self.used - self.reserved)


class DeviceProbe:
    """Reads this process's device memory (see :class:`DeviceReading`); the caller synchronises."""

    def read(self) -> DeviceReading | None:
        raise NotImplementedError


class NvmlProbe(DeviceProbe):
    """NVML's use of one CUDA device next to the caching allocator's figures."""

    def __init__(self, device: torch.device, nvml: NvmlDevice | None = None) -> None:
        self.device = device
        self.nvml = nvml if nvml is not None else NvmlDevice(device.index or 0)

    def read(self) -> DeviceReading | None:
        own = self.nvml.process_used_bytes()
        used = own if own is not None else self.nvml.used_bytes()
        return DeviceReading(used=used, reserved=int(torch.cuda.memory_reserved(self.device)),
                             allocated=int(torch.cuda.memory_allocated(self.device)),
                             scope="process" if own is not None else "device")


_PROBE_FACTORY: Callable[[torch.device], DeviceProbe | None] | None = None


def install_probe_factory(factory: Callable[[torch.device], DeviceProbe | None] | None) -> None:
    """Make every later :func:`device_probe` call ``factory`` (None: back to NVML). The CPU tests
    install a fake NVML this way, in the warm worker's process, before any trial runs."""
    global _PROBE_FACTORY
    _PROBE_FACTORY = factory


def device_probe(device: torch.device) -> DeviceProbe | None:
    """The probe for ``device``: the installed factory's, else NVML on CUDA; None where there is
    nothing to read (CPU) or NVML is unavailable (the caller says so)."""
    if _PROBE_FACTORY is not None:
        return _PROBE_FACTORY(device)
    if device.type != "cuda":
        return None
    return NvmlProbe(device)
