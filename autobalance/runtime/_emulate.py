"""Emulated slow ranks on CPU: ``AUTOBALANCE_EMULATE_MS_PER_SAMPLE`` (one number, or one per rank,
comma-separated) makes each micro-step of rank ``r`` sleep that many milliseconds per sample it
holds, before its forward.

What it emulates: a device whose per-sample cost is higher by a fixed amount (a slower GPU of a
mixed machine, seen from the step's timing), deterministically, so a test of the speed balance does
not depend on a busy machine's timing noise. A sleep takes no CPU: the ranks' real work is
unchanged and no tensor is touched, so the update is the same as without it (the equivalence tests
run with it). What it does not emulate: a slower device's fixed per-step costs (kernel launches,
optimizer), its memory bandwidth, or contention for cores. On a GPU use a green context instead
(``benchmarks/green_context.py``: a rank restricted to part of its SMs).
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

__all__ = ["SlowRank", "device_identity", "emulated_ms_per_sample"]


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
    if len(values) == 1:
        return values[0]
    if rank >= len(values):
        raise UsageError(f"{_env.EMULATE_MS_PER_SAMPLE}={raw!r} has no entry for rank {rank}; "
                         "give one per rank or a single value.")
    return values[rank]


def device_identity(device: Any, rank: int) -> str:
    """What rank ``rank``'s device is called for a saved configuration to follow it (the hardware
    fingerprint's ``device_names``, compared by ``store.rank_order`` in production): the GPU model,
    or on CPU the processor model; with an emulated slowdown ``" (emulated +N ms/sample)"`` appended.

    So on CPU the emulation is the device's identity: a job run with ``AUTOBALANCE_EMULATE_MS_PER_SAMPLE``
    ``0,10`` after a study tuned with ``10,0`` is the same machine with its GPUs in another rank order
    (the tests' stand-in for a mixed machine whose cards come up in another order). Two devices of one
    model have one name: they are interchangeable, and their configurations never swap."""
    import torch

    from autobalance.protocol import cpu_model_name

    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model_name()
    ms = emulated_ms_per_sample(os.environ.get(_env.EMULATE_MS_PER_SAMPLE), rank)
    return f"{name} (emulated +{ms:g} ms/sample)" if ms > 0 else name


class SlowRank(Part):
    """Sleeps ``ms_per_sample`` per sample of each micro-step (see the module docstring)."""

    def __init__(self, *, ms_per_sample: float) -> None:
        self.ms_per_sample = ms_per_sample

    @classmethod
    def from_env(cls, rank: int) -> SlowRank | None:
        ms = emulated_ms_per_sample(os.environ.get(_env.EMULATE_MS_PER_SAMPLE), rank)
        return cls(ms_per_sample=ms) if ms > 0 else None

    def on_micro_step(self, plan: Plan) -> Any:
        samples = len(plan.layout.micro_batches[plan.rank][plan._micro_index])
        time.sleep(self.ms_per_sample * samples / 1000.0)
        return None
