"""The hardware a configuration was tuned on, and how another job's hardware differs from it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from autobalance._errors import ConfigError
from autobalance._files import is_int, is_number
from autobalance.protocol import GENERIC_CPU_NAME, GIB, cpu_model_name, memory_text

__all__ = [
    "CAPACITY_TOLERANCE",
    "DEVICE_TYPES",
    "HardwareFingerprint",
    "cap_lifted_note",
    "cap_lifted_ranks",
    "current_fingerprint",
    "differences",
    "minor_differences",
    "rank_order",
    "rank_order_line",
]

DEVICE_TYPES = ("cuda", "cpu")

CAPACITY_TOLERANCE = 0.02
"""Relative difference of a rank's usable memory above which two fingerprints differ."""


@dataclass(kw_only=True)
class HardwareFingerprint:
    """What a configuration depends on: devices, their memory, ranks, nodes and versions."""

    device_type: str
    """``cuda`` or ``cpu`` (CPU runs emulate memory limits with ``cap_bytes``)."""
    device_name: str
    """Device model, e.g. ``NVIDIA H200`` (distinct models of one job joined with ``" + "``)."""
    capacity_bytes: list[int]
    """Physical memory of each rank's device, index = global rank."""
    cap_bytes: list[int | None] = field(default_factory=list)
    """Emulated memory cap of each rank (None = no cap); [] means no cap on any rank."""
    world_size: int
    """Number of ranks."""
    nnodes: int = 1
    """Number of nodes."""
    torch_version: str = ""
    """``torch.__version__`` of the job."""
    cuda_version: str | None = None
    """``torch.version.cuda`` (None on CPU-only builds)."""
    device_names: list[str] = field(default_factory=list)
    """Each rank's device identity, index = global rank (the GPU model; on CPU the processor model,
    with an emulated slowdown appended: ``runtime.device_identity``); [] when not recorded
    (fingerprints saved before it was). What a production job maps the configuration by
    (:func:`rank_order`)."""
    ms_per_sample: list[float | None] = field(default_factory=list)
    """Each rank's measured speed in the saved trial: its busy milliseconds per sample (its own work
    per step, without the wait at the all-reduce, over its samples per step); [] or None entries
    where not measured. Recorded for people and for telling devices apart; never compared."""

    def __post_init__(self) -> None:
        def bad(name: str, value: Any, expected: str) -> ConfigError:
            return ConfigError(
                f"fingerprint {name}={value!r} is not {expected}; fix the fingerprint's {name}."
            )

        if self.device_type not in DEVICE_TYPES:
            raise bad("device_type", self.device_type, f"one of {', '.join(DEVICE_TYPES)}")
        if not isinstance(self.device_name, str):
            raise bad("device_name", self.device_name, "a string")
        if not is_int(self.world_size) or self.world_size < 1:
            raise bad("world_size", self.world_size, "a positive integer")
        if not is_int(self.nnodes) or self.nnodes < 1:
            raise bad("nnodes", self.nnodes, "a positive integer")
        if not isinstance(self.capacity_bytes, list) or not all(
            is_int(c) and c >= 0 for c in self.capacity_bytes
        ):
            raise bad("capacity_bytes", self.capacity_bytes, "a list of byte counts")
        if len(self.capacity_bytes) != self.world_size:
            raise bad(
                "capacity_bytes", self.capacity_bytes, f"one entry per rank ({self.world_size})"
            )
        if not isinstance(self.cap_bytes, list) or not all(
            c is None or (is_int(c) and c > 0) for c in self.cap_bytes
        ):
            raise bad("cap_bytes", self.cap_bytes, "a list of byte counts or nulls")
        if not self.cap_bytes:
            self.cap_bytes = [None] * self.world_size
        if len(self.cap_bytes) != self.world_size:
            raise bad("cap_bytes", self.cap_bytes, f"one entry per rank ({self.world_size})")
        if not isinstance(self.torch_version, str):
            raise bad("torch_version", self.torch_version, "a string")
        if self.cuda_version is not None and not isinstance(self.cuda_version, str):
            raise bad("cuda_version", self.cuda_version, "a string or null")
        if not isinstance(self.device_names, list) or not all(isinstance(n, str) for n in self.device_names) or \
                len(self.device_names) not in (0, self.world_size):
            raise bad("device_names", self.device_names, f"[] or one name per rank ({self.world_size})")
        if not isinstance(self.ms_per_sample, list) or len(self.ms_per_sample) not in (0, self.world_size) or \
                not all(v is None or (is_number(v) and v >= 0) for v in self.ms_per_sample):
            raise bad("ms_per_sample", self.ms_per_sample, f"[] or one number or null per rank ({self.world_size})")

    def permuted(self, order: list[int]) -> HardwareFingerprint:
        """The fingerprint with its ranks reordered as :meth:`BalanceConfig.permuted` reorders a
        configuration: rank ``r`` of the result is rank ``order[r]`` here (capacity, cap, device, speed)."""
        def pick(values: list[Any]) -> list[Any]:
            return [values[i] for i in order] if values else []

        data = self.to_dict()
        for name in ("capacity_bytes", "cap_bytes", "device_names", "ms_per_sample"):
            data[name] = pick(data[name])
        return HardwareFingerprint.from_dict(data)

    def usable_bytes(self, rank: int) -> int | None:
        """Memory rank ``rank`` may use: the smaller of capacity and cap (CPU: the cap, or None)."""
        cap = self.cap_bytes[rank]
        if self.device_type == "cpu":
            return cap
        capacity = self.capacity_bytes[rank]
        return capacity if cap is None else min(cap, capacity)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _copy(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Any) -> HardwareFingerprint:
        if not isinstance(data, dict):
            raise ConfigError(
                f"fingerprint={data!r} is not a JSON object; pass a mapping of fields."
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"fingerprint has unknown field(s) {unknown}; the known fields are {sorted(known)}."
            )
        missing = sorted(
            f
            for f in ("device_type", "device_name", "capacity_bytes", "world_size")
            if f not in data
        )
        if missing:
            raise ConfigError(
                f"fingerprint lacks field(s) {missing}; give every field of HardwareFingerprint."
            )
        return cls(**{k: _copy(v) for k, v in data.items()})


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def _gib(n: int | None, extra: int = 0) -> str:
    """Bytes in the unit their size calls for, three significant digits (14.8 MiB, 40.0 GiB:
    :func:`~autobalance.protocol.memory_text`); ``extra`` more digits on request."""
    if n is None:
        return "no cap"
    return memory_text(n / GIB, digits=3 + extra)


def _gib_pair(a: int | None, b: int | None) -> tuple[str, str]:
    """``a`` and ``b`` as GiB with as many digits as it takes for two different sizes never to read
    the same (1.50 vs 1.54 GiB, not 1.5 GiB vs 1.5 GiB); bytes when GiB digits cannot tell them apart."""
    for extra in range(10):
        pair = _gib(a, extra), _gib(b, extra)
        if pair[0] != pair[1] or a == b:
            return pair
    return f"{a} bytes", f"{b} bytes"


def differences(stored: HardwareFingerprint, current: HardwareFingerprint) -> list[str]:
    """What makes ``stored`` (tuned) and ``current`` (this job) different hardware, in words.

    Empty when a configuration tuned on ``stored`` fits ``current``. Per-rank memory is compared
    (capacity, or the emulated cap when smaller) with a tolerance of 2%.
    """
    out: list[str] = []
    if stored.device_type != current.device_type:
        out.append(f"device {stored.device_type} (tuned) vs {current.device_type} (this job)")
    if stored.world_size != current.world_size:
        out.append(f"world size {stored.world_size} (tuned) vs {current.world_size} (this job)")
    if stored.nnodes != current.nnodes:
        out.append(f"nodes {stored.nnodes} (tuned) vs {current.nnodes} (this job)")
    if out:
        return out
    if stored.device_type == "cuda" and stored.device_names and current.device_names:
        out.extend(f"rank {r} GPU {a!r} (tuned) vs {b!r} (this job)"
                   for r, (a, b) in enumerate(zip(stored.device_names, current.device_names, strict=True)) if a != b)
    elif stored.device_type == "cuda" and stored.device_name != current.device_name:
        out.append(f"GPU {stored.device_name!r} (tuned) vs {current.device_name!r} (this job)")
    lifted = set(cap_lifted_ranks(stored, current))
    for rank in range(stored.world_size):
        tuned, now = stored.usable_bytes(rank), current.usable_bytes(rank)
        if tuned == now or rank in lifted:
            continue
        if tuned is None or now is None or abs(tuned - now) > CAPACITY_TOLERANCE * max(tuned, now):
            what = "memory cap" if stored.device_type == "cpu" else "memory"
            tuned_text, now_text = _gib_pair(tuned, now)
            out.append(f"rank {rank} {what} {tuned_text} (tuned) vs {now_text} (this job)")
    return out


def cap_lifted_ranks(stored: HardwareFingerprint, current: HardwareFingerprint) -> list[int]:
    """Ranks tuned under an emulated cap that this job runs without, with at least the memory the
    cap allowed (no cap on CPU, or a device as large): the configuration fits with room to spare,
    which is no hardware difference (:func:`cap_lifted_note` says it in one line)."""
    if stored.device_type != current.device_type or stored.world_size != current.world_size:
        return []
    out = []
    for rank in range(stored.world_size):
        tuned, now = stored.usable_bytes(rank), current.usable_bytes(rank)
        if stored.cap_bytes[rank] is None or current.cap_bytes[rank] is not None or tuned is None:
            continue
        emulated = stored.device_type == "cpu" or tuned < stored.capacity_bytes[rank]  # the cap limited it
        if emulated and (now is None or now >= tuned * (1 - CAPACITY_TOLERANCE)):
            out.append(rank)
    return out


def cap_lifted_note(stored: HardwareFingerprint, current: HardwareFingerprint) -> str | None:
    """One line for :func:`cap_lifted_ranks` (None when there are none): ``tuned under an emulated
    cap of 0.0145 GiB per rank; this job runs without it``."""
    ranks = cap_lifted_ranks(stored, current)
    if not ranks:
        return None
    caps = [stored.usable_bytes(r) for r in ranks]
    if len(set(caps)) == 1:
        where = "per rank" if len(ranks) == stored.world_size else f"on rank{'s' if len(ranks) > 1 else ''} " + \
            ", ".join(map(str, ranks))
        what = f"an emulated cap of {_gib(caps[0])} {where}"
    else:
        what = "emulated caps of " + ", ".join(f"{_gib(c)} (rank {r})" for r, c in zip(ranks, caps, strict=True))
    return f"tuned under {what}; this job runs without it (the configuration fits with room to spare)"


def minor_differences(stored: HardwareFingerprint, current: HardwareFingerprint) -> list[str]:
    """Differences that only deserve a warning: torch and CUDA versions, the CPU model."""
    out: list[str] = []
    if stored.torch_version != current.torch_version:
        out.append(
            f"torch {stored.torch_version or '?'} (tuned) vs {current.torch_version or '?'} (this job)"
        )
    if stored.cuda_version != current.cuda_version:
        out.append(
            f"CUDA {stored.cuda_version or 'none'} (tuned) vs {current.cuda_version or 'none'} (this job)"
        )
    if (
        stored.device_type == current.device_type == "cpu"
        and stored.device_name != current.device_name
        and GENERIC_CPU_NAME not in (stored.device_name, current.device_name)  # model unknown: nothing to compare
    ):
        out.append(f"CPU {stored.device_name!r} (tuned) vs {current.device_name!r} (this job)")
    elif (stored.device_type == current.device_type == "cpu" and stored.device_names and current.device_names
          and len(stored.device_names) == len(current.device_names)):  # same CPU: an emulated slowdown differs
        out.extend(f"rank {r} device {a!r} (tuned) vs {b!r} (this job)"
                   for r, (a, b) in enumerate(zip(stored.device_names, current.device_names, strict=True)) if a != b)
    return out


def rank_order(stored: HardwareFingerprint, current: HardwareFingerprint) -> list[int] | None:
    """How this job's ranks take the tuned configuration when the same devices came up in another
    rank order: ``order[r]`` is the tuning job's rank whose configuration this job's rank ``r`` runs
    (``BalanceConfig.permuted(order)``, ``HardwareFingerprint.permuted(order)``).

    None when nothing moves: the same order, a fingerprint without per-rank names (saved before they
    were recorded), or a different set of devices (:func:`differences` and
    :func:`minor_differences` say how, as for any other hardware). A pure function of the two lists
    of names, so every rank that computes it gets the same answer; ranks with the same device keep
    their relative order, so identical devices never swap configurations.
    """
    tuned, now = stored.device_names, current.device_names
    if not tuned or not now or tuned == now or sorted(tuned) != sorted(now):
        return None
    free: dict[str, list[int]] = {}
    for rank, name in enumerate(tuned):
        free.setdefault(name, []).append(rank)
    return [free[name].pop(0) for name in now]


def rank_order_line(order: list[int], current: HardwareFingerprint) -> str:
    """One line for a :func:`rank_order` that moves ranks: which tuned rank each moved rank follows."""
    moved = ", ".join(f"rank {r} ({current.device_names[r]}) takes tuned rank {t}'s configuration"
                      for r, t in enumerate(order) if r != t)
    return (f"the tuned devices came up in another rank order; the configuration follows them: {moved} "
            "(same global batch, same update)")


def current_fingerprint(
    *,
    device_type: str,
    world_size: int,
    nnodes: int = 1,
    cap_bytes: list[int | None] | int | None = None,
    capacity_bytes: list[int] | None = None,
    local_world_size: int | None = None,
    device_names: list[str] | None = None,
) -> HardwareFingerprint:
    """The fingerprint of a job about to run on this machine (imports torch lazily).

    Rank ``r`` is assumed to use local device ``r % local_world_size`` (default
    ``world_size // nnodes``) on identical nodes. GPU names and capacities come from NVML, which
    does not create a CUDA context (torch is the fallback); pass ``capacity_bytes`` to override.
    ``cap_bytes`` is one cap for every rank or one per rank. ``device_names``: each rank's device
    identity as the ranks themselves report it (gathered over the process group by the runtime);
    without it the per-rank names are left unrecorded.
    """
    if device_type not in DEVICE_TYPES:
        raise ConfigError(
            f"device_type={device_type!r} is unknown; use one of {', '.join(DEVICE_TYPES)}."
        )
    if world_size < 1 or nnodes < 1:
        raise ConfigError(f"world_size={world_size}, nnodes={nnodes}: both must be at least 1.")
    local = local_world_size or max(1, world_size // nnodes)
    caps: list[int | None]
    if cap_bytes is None:
        caps = [None] * world_size
    elif isinstance(cap_bytes, int):
        caps = [cap_bytes] * world_size
    else:
        caps = list(cap_bytes)
    import torch

    cuda_version = torch.version.cuda
    if capacity_bytes is not None:
        capacities = list(capacity_bytes)
        names = _device_names(device_type, local)
    elif device_type == "cuda":
        names, local_caps = _cuda_devices(local)
        capacities = [local_caps[r % local] for r in range(world_size)]
    else:
        names = _device_names("cpu", local)
        capacities = [_physical_memory()] * world_size
    if device_names is not None and len(device_names) != world_size:
        raise ConfigError(f"device_names={device_names} has {len(device_names)} entries for {world_size} ranks; "
                          "give one per rank.")
    return HardwareFingerprint(
        device_type=device_type,
        device_name=" + ".join(dict.fromkeys(names)),
        device_names=list(device_names or []),
        capacity_bytes=capacities,
        cap_bytes=caps,
        world_size=world_size,
        nnodes=nnodes,
        torch_version=str(torch.__version__),
        cuda_version=str(cuda_version) if cuda_version else None,
    )


def _device_names(device_type: str, local: int) -> list[str]:
    if device_type == "cuda":
        return _cuda_devices(local)[0]
    return [cpu_model_name()]


def _cuda_devices(local: int) -> tuple[list[str], list[int]]:
    try:
        return _nvml_devices(local)
    except Exception:
        pass
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise ConfigError(
            "device_type='cuda' but no CUDA device is visible; use device_type='cpu'."
        )
    props = [torch.cuda.get_device_properties(i % count) for i in range(local)]
    return [p.name for p in props], [int(p.total_memory) for p in props]


def _nvml_devices(local: int) -> tuple[list[str], list[int]]:
    import pynvml

    pynvml.nvmlInit()
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        handles: list[Any] = []
        if visible is None:
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        else:
            for item in (v.strip() for v in visible.split(",") if v.strip()):
                if item.isdigit():
                    handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(item)))
                else:
                    handles.append(pynvml.nvmlDeviceGetHandleByUUID(item))
        if not handles:
            raise RuntimeError("no visible GPU")
        names: list[str] = []
        capacities: list[int] = []
        for i in range(local):
            handle = handles[i % len(handles)]
            name = pynvml.nvmlDeviceGetName(handle)
            names.append(name.decode() if isinstance(name, bytes) else str(name))
            capacities.append(int(pynvml.nvmlDeviceGetMemoryInfo(handle).total))
        return names, capacities
    finally:
        pynvml.nvmlShutdown()




def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0
