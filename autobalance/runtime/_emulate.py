"""Emulated slow ranks on CPU: ``AUTOBALANCE_EMULATE_MS_PER_SAMPLE`` (one number, or one per rank,
comma-separated) makes each micro-step of rank ``r`` sleep that many milliseconds per sample it
holds, before its forward.

What it emulates: a device whose per-sample cost is higher by a fixed amount (a slower GPU of a
mixed machine, seen from the step's timing), deterministically, so a test of the speed balance does
not depend on a busy machine's timing noise. A sleep takes no CPU: the ranks' real work is
unchanged and no tensor is touched, so the update is the same as without it (the equivalence tests
run with it). What it does not emulate: a slower device's fixed per-step costs (kernel launches,
optimizer), its memory bandwidth, or contention for cores.

On a GPU, ``AUTOBALANCE_EMULATE_SMS`` (one number, or one per rank; 0: all) runs rank ``r``'s work on
a CUDA green context of that many streaming multiprocessors (rounded down to a multiple of 8, what
the hardware partitions by): :class:`FewerSMs`, entered when the plan is made, its stream made the
thread's current one. What it emulates: a smaller part of the same GPU generation (fewer SMs; the
same memory capacity, bandwidth, clocks and interconnect; use ``--memory-cap-gib`` for a smaller
memory). Measured on one H200 (``benchmarks/2026-12-03-h200b``): the ~270M GPT's bf16 step on 64 of
132 SMs took 2.01x as long, with a much wider spread. What it does not emulate: another
architecture's kernels, a slower memory system, or NCCL's kernels (they run on their own streams).
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Any

from autobalance import _env
from autobalance._errors import UsageError
from autobalance.runtime._parts import Part

if TYPE_CHECKING:
    from autobalance.runtime._plan import Plan

__all__ = ["FewerSMs", "SlowRank", "device_identity", "emulated_ms_per_sample", "emulated_sms"]


def _job(trial: _env.TrialEnv | None) -> _env.TrialEnv:
    """``trial``, or where none is given (a caller outside a plan) this process's job variables."""
    return trial if trial is not None else _env.TrialEnv.read_job(os.environ)


def _this_rank(name: str, raw: str, values: list[float], rank: int) -> float:
    """One value for every rank, or rank ``rank``'s of one per rank."""
    if len(values) == 1:
        return values[0]
    if rank >= len(values):
        raise UsageError(f"{name}={raw!r} has no entry for rank {rank}; give one per rank or a single value.")
    return values[rank]


def emulated_ms_per_sample(raw: str | None, rank: int) -> float:
    """This rank's emulated extra milliseconds per sample from the variable's value (0: none)."""
    if not raw:
        return 0.0
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise UsageError(f"{_env.EMULATE_MS_PER_SAMPLE}={raw!r} is not a number or a comma-separated list of "
                         "them; set milliseconds per sample, e.g. 0,2.") from None
    if not values or any(not math.isfinite(v) or v < 0 for v in values):
        raise UsageError(f"{_env.EMULATE_MS_PER_SAMPLE}={raw!r} has a negative or non-finite entry; "
                         "set milliseconds per sample >= 0, e.g. 0,2.")
    return _this_rank(_env.EMULATE_MS_PER_SAMPLE, raw, values, rank)


def emulated_sms(raw: str | None, rank: int) -> int:
    """This rank's emulated SM count from the variable's value (0: all the device's SMs)."""
    if not raw:
        return 0
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise UsageError(f"{_env.EMULATE_SMS}={raw!r} is not a whole number or a comma-separated list of them; "
                         "set the SMs each rank may use (0: all), e.g. 0,64.")
    return int(_this_rank(_env.EMULATE_SMS, raw, [float(p) for p in parts], rank))


class FewerSMs:
    """Rank's work on a green context of ``sms`` SMs (see the module docstring); entered at once."""

    def __init__(self, *, sms: int, device: Any) -> None:
        import torch
        from torch.cuda import green_contexts as gc

        device = torch.device(device)
        total = torch.cuda.get_device_properties(device).multi_processor_count
        self.sms = max(8, min(sms, total) // 8 * 8)
        self.total = total
        index = device.index if device.index is not None else torch.cuda.current_device()
        # torch 2.11 to 2.13: create(num_sms=, device_id=), set_context(), Stream() (what the H200 ran)
        ctx: Any = gc.GreenContext.create(num_sms=self.sms, device_id=index)
        ctx.set_context()
        torch.cuda.set_stream(ctx.Stream())
        self.ctx = ctx

    @classmethod
    def from_env(cls, rank: int, device: Any, trial: _env.TrialEnv | None = None) -> FewerSMs | None:
        """Rank ``rank``'s emulated SMs from ``trial.emulate_sms`` (None: this process's variables,
        ``TrialEnv.read_job``), or None when it has all of them."""
        import torch

        raw = _job(trial).emulate_sms
        sms = emulated_sms(raw, rank)
        if sms <= 0:
            return None
        if torch.device(device).type != "cuda":
            raise UsageError(f"{_env.EMULATE_SMS}={raw!r} needs a CUDA device (this "
                             f"rank runs on {torch.device(device).type}); on CPU emulate a slow rank with "
                             f"{_env.EMULATE_MS_PER_SAMPLE}.")
        if not hasattr(torch.cuda, "green_contexts"):
            raise UsageError(f"{_env.EMULATE_SMS} needs torch.cuda.green_contexts (torch {torch.__version__} has "
                             "none); use a newer torch, or unset it.")
        return cls(sms=sms, device=device)


def device_identity(device: Any, rank: int, trial: _env.TrialEnv | None = None) -> str:
    """What rank ``rank``'s device is called for a saved configuration to follow it (the hardware
    fingerprint's ``device_names``, compared by ``store.rank_order`` in production): the GPU model,
    or on CPU the processor model; with an emulated slowdown ``" (emulated +N ms/sample)"`` appended.

    So on CPU the emulation is the device's identity: a job run with ``AUTOBALANCE_EMULATE_MS_PER_SAMPLE``
    ``0,10`` after a study tuned with ``10,0`` is the same machine with its GPUs in another rank order
    (the tests' stand-in for a mixed machine whose cards come up in another order). Two devices of one
    model have one name: they are interchangeable, and their configurations never swap. ``trial``: the
    plan's variables (None: this process's, ``TrialEnv.read_job``)."""
    import torch

    from autobalance.protocol import cpu_model_name

    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model_name()
    trial = _job(trial)
    ms = emulated_ms_per_sample(trial.emulate_ms_per_sample, rank)
    sms = emulated_sms(trial.emulate_sms, rank) if device.type == "cuda" else 0
    if sms > 0:
        name = f"{name} (emulated {max(8, sms // 8 * 8)} SMs)"
    return f"{name} (emulated +{ms:g} ms/sample)" if ms > 0 else name


class SlowRank(Part):
    """Sleeps ``ms_per_sample`` per sample of each micro-step (see the module docstring)."""

    def __init__(self, *, ms_per_sample: float) -> None:
        self.ms_per_sample = ms_per_sample

    @classmethod
    def from_env(cls, rank: int, trial: _env.TrialEnv | None = None) -> SlowRank | None:
        """Rank ``rank``'s emulated slowdown from ``trial.emulate_ms_per_sample`` (None: this process's
        variables, ``TrialEnv.read_job``), or None when it has none."""
        ms = emulated_ms_per_sample(_job(trial).emulate_ms_per_sample, rank)
        return cls(ms_per_sample=ms) if ms > 0 else None

    def on_micro_step(self, plan: Plan) -> Any:
        samples = len(plan.layout.micro_batches[plan.rank][plan._micro_index])
        time.sleep(self.ms_per_sample * samples / 1000.0)
        return None
