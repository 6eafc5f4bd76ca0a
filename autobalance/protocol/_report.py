"""A rank's report: what each rank of a trial writes to ``rank<R>.json`` (built by the runtime,
validated by the launcher, read by the tuner). Plain JSON from another process: nothing in it is
trusted until :func:`report_problem` says it is usable."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from autobalance.protocol._status import REPORT_STATUSES, Status

__all__ = [
    "REPORT_SCHEMA",
    "InvalidReport",
    "RankDevice",
    "RankMemory",
    "RankReport",
    "RankTiming",
    "report_path",
    "report_problem",
    "timed_steps",
]

REPORT_SCHEMA = 1


def report_path(trial_dir: str, rank: int) -> str:
    """Where rank ``rank`` of the trial in ``trial_dir`` writes its report."""
    return os.path.join(trial_dir, f"rank{rank}.json")


def timed_steps(times: Sequence[float], samples: Sequence[int | None] | None,
                global_batch: int | None) -> tuple[list[float], float | None]:
    """The measured steps a step time stands for, and their samples per step: the full steps when
    any was measured (a partial step at the end of an epoch does less work), else every step (a
    dataset smaller than one global batch) with their mean sample count. A step whose count is
    unknown (``samples`` missing or shorter, ``None``) counts as a full one."""
    if global_batch is None:
        return list(times), None
    known = list(samples or [])
    counts: list[int] = []
    for i in range(len(times)):
        n = known[i] if i < len(known) else None
        counts.append(global_batch if n is None else int(n))
    full = [t for t, n in zip(times, counts, strict=True) if n >= global_batch]
    if full:
        return full, float(global_batch)
    if times:
        return list(times), sum(counts) / len(counts)
    return [], None


class InvalidReport(ValueError):
    """A report that :func:`report_problem` rejects (its message says why)."""


def _measure(value: Any) -> bool:
    """A finite, non-negative JSON number (not a bool): a size, a time, a count."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


class _Section:
    """A JSON object of known keys; unknown keys are kept (``extra``) so a report round-trips."""

    extra: dict[str, Any]
    _read: tuple[str, ...] | None = None
    """The keys of the JSON object it was read from (``from_dict``), in their order; None: built here."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        names = {f.name for f in dataclasses.fields(cls) if f.name != "extra"}  # type: ignore[arg-type]
        make: Any = cls
        section = make(**{k: v for k, v in data.items() if k in names},
                       extra={k: v for k, v in data.items() if k not in names})
        section._read = tuple(data)
        return section

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}  # type: ignore[arg-type]
        return {**out, **self.extra}

    def as_read(self) -> dict[str, Any]:
        """The JSON object it was read from, key for key (``to_dict`` would add the keys it lacked, as
        None); ``to_dict`` for a section built here."""
        out = self.to_dict()
        return out if self._read is None else {k: out[k] for k in self._read}


GENERIC_CPU_NAME = "cpu"
"""The name of a CPU whose model is unknown (and what studies recorded before ranks reported it)."""


def cpu_model_name() -> str:
    """This host's processor model (``/proc/cpuinfo``): what a CPU rank reports as its device name and a
    production job's hardware fingerprint compares with."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or GENERIC_CPU_NAME


@dataclass(kw_only=True)
class RankDevice(_Section):
    """The rank's device."""

    type: str = "cpu"
    """``cuda`` or ``cpu``."""
    name: str = ""
    """The GPU model, or on CPU the processor model (:func:`cpu_model_name`)."""
    capacity_bytes: float | None = None
    """The device's memory (CPU: the machine's)."""
    cap_bytes: float | None = None
    """The emulated per-rank cap, when the trial enforced one."""
    uuid: str | None = None
    identity: str | None = None
    """What a saved configuration follows in production (``runtime._emulate.device_identity``): the
    name, with an emulated slowdown appended; absent in reports from before it was recorded."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class RankMemory(_Section):
    """Peaks over the trial, bytes."""

    peak_allocated: float | None = None
    peak_reserved: float | None = None
    outside_pytorch: float | None = None
    """Device memory NVML attributes to the process beyond what the allocator reserved."""
    nvml_used_peak: float | None = None
    nvml_scope: str | None = None
    """``process``, ``device`` or ``none``: what ``nvml_used_peak`` counts."""
    peak_device: float | None = None
    """Peak reserved + outside PyTorch: what the rank needs of its device."""
    before_training: float | None = None
    """Live bytes before the first step (model, optimizer state)."""
    compile_step: dict[str, Any] | None = None
    """A compiled trial: the peaks (same keys as above) up to the end of its compiling step."""
    steady: dict[str, Any] | None = None
    """A compiled trial: the peaks of the steps after its compiling step (the peaks above are the
    larger of the two)."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class RankTiming(_Section):
    """Seconds."""

    startup_s: float | None = None
    """Start of the rank to its first step."""
    compile_s: float | None = None
    steps_s: float | None = None
    """Warm-up and measured steps (compilation excluded)."""
    measure_s: float | None = None
    wall_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class RankReport:
    """One rank's figures of one trial. ``to_dict`` gives the JSON written to ``rank<R>.json``;
    ``from_dict`` reads one back after :func:`report_problem` accepted it."""

    schema: int = REPORT_SCHEMA
    status: Status
    """One of :data:`REPORT_STATUSES`."""
    error: str | None = None
    """``Type: message`` of the exception that ended the trial on this rank."""
    traceback: str | None = None
    rank: int
    local_rank: int | None = None
    world_size: int
    hostname: str = ""
    pid: int | None = None
    trial_id: str | None = None
    device: RankDevice | None = None
    config: dict[str, Any] | None = None
    """The applied :class:`~autobalance.BalanceConfig` (``to_dict``)."""
    source: str | None = None
    """Where the configuration came from (trial, file, store, defaults)."""
    defaults: dict[str, Any] | None = None
    """The script's own configuration (``to_dict``)."""
    model: dict[str, Any] | None = None
    """What the runtime saw of the model (``num_blocks``, ...)."""
    steps_done: int | None = None
    warmup_steps: int | None = None
    step_times_s: list[float] | None = None
    """Measured steps' times (warm-up excluded)."""
    step_time_s: float | None = None
    """Median of the steps it stands for (:func:`timed_steps`: the full ones when any was measured)."""
    step_time_iqr_s: float | None = None
    """Interquartile range of the same steps (their spread); None below 2 of them."""
    measured_steps: int | None = None
    step_samples: list[int] | None = None
    """Samples of each measured step (all ranks): the global batch, or fewer in a partial step."""
    partial_steps: int | None = None
    """Measured steps with fewer samples than the global batch (the end of an epoch, or a dataset
    smaller than one global batch); ``step_time_s`` leaves them out when full steps were measured."""
    samples_per_step: float | None = None
    """Samples of the steps ``step_time_s`` stands for: the global batch, or the partial steps' mean."""
    samples_per_s: float | None = None
    """``samples_per_step / step_time_s``: the samples really used per second."""
    busy_time_s: float | None = None
    """This rank's own work per measured step (median): the step less its wait at the gradient
    all-reduce (``runtime/_busy.py``); absent in reports from before it was measured."""
    allreduce_wait_s: float | None = None
    """This rank's wait at the step's gradient all-reduce (median): for the slowest rank about the
    all-reduce's transfer, for a faster one its idle time too."""
    data: dict[str, Any] | None = None
    """The dataset as the plan's loader sees it: ``samples``, ``global_batch``, ``steps_per_epoch``,
    ``dropped`` (a tail smaller than the number of ranks)."""
    memory: RankMemory | None = None
    timing: RankTiming | None = None
    compile: dict[str, Any] | None = None
    activation_budget: float | None = None
    verify: dict[str, Any] | None = None
    breakdown: dict[str, Any] | None = None
    """``autobalance diagnose``: MemTracker's per-module breakdown."""
    optimizer: dict[str, Any] | None = None
    """The optimizer as the plan saw it: ``sharding`` (``off``/``zero1``), ``wrapped`` (the script calls
    ``plan.optimizer``), ``state_bytes`` (this rank's optimizer state, measured), ``param_bytes`` (of
    the parameters whose state it keeps), ``total_param_bytes``, ``shares``, ``params_owned``; absent
    in reports from before it was measured."""
    warm: dict[str, Any] | None = None
    """A warm trial: what it inherited from its worker and whether the worker was recycled after it
    (see :mod:`autobalance.runtime._carryover`)."""
    torch_version: str | None = None
    cuda_version: str | None = None
    written_at: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, _Section) else value
        out["status"] = str(self.status)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> RankReport:
        """The typed report; :class:`InvalidReport` when :func:`report_problem` rejects ``data``."""
        problem = report_problem(data)
        if problem is not None:
            raise InvalidReport(problem)
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["status"] = Status(data["status"])
        values.setdefault("rank", -1)
        values.setdefault("world_size", 0)
        for key, section in (("device", RankDevice), ("memory", RankMemory), ("timing", RankTiming)):
            if isinstance(data.get(key), dict):
                values[key] = section.from_dict(data[key])
        return cls(**values)


def report_problem(data: Any) -> str | None:
    """Why ``data`` cannot be used as a rank's report (types and ranges of every field the tuner
    reads), or None."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    if data.get("status") not in REPORT_STATUSES:
        return f"status {str(data.get('status'))[:40]!r} is not one of {', '.join(REPORT_STATUSES)}"
    for key in ("error", "traceback", "torch_version", "cuda_version"):
        if data.get(key) is not None and not isinstance(data[key], str):
            return f"{key} is not a string"
    for key in ("memory", "device", "timing", "config", "defaults", "model", "breakdown", "data", "warm", "optimizer"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            return f"{key} is not an object"
    if data["status"] == Status.OK:
        for key in ("memory", "device"):
            if not isinstance(data.get(key), dict):
                return f"an ok report without {key}"
        if not _measure(data.get("step_time_s")):
            return "an ok report without a step time"
    checks = (
        ("memory", ("peak_device", "peak_allocated", "peak_reserved", "outside_pytorch", "nvml_used_peak")),
        ("device", ("capacity_bytes", "cap_bytes")),
        ("timing", ("startup_s", "compile_s", "steps_s", "wall_s")),
        ("config", ("global_batch",)),
        ("model", ("num_blocks",)),
        ("optimizer", ("state_bytes", "param_bytes", "total_param_bytes")),
    )
    for section, keys in checks:
        values = data.get(section) or {}
        for key in keys:
            if values.get(key) is not None and not _measure(values[key]):
                return f"{section}.{key} is not a non-negative number"
    for key in ("step_time_s", "step_time_iqr_s", "samples_per_s", "measured_steps", "partial_steps", "samples_per_step",
                "busy_time_s", "allreduce_wait_s"):
        if data.get(key) is not None and not _measure(data[key]):
            return f"{key} is not a non-negative number"
    times = data.get("step_times_s")
    if times is not None and not (isinstance(times, list) and all(_measure(t) for t in times)):
        return "step_times_s is not a list of non-negative numbers"
    return None
