"""Several trials at once on one host: disjoint GPU sets (``--gpus-per-trial``) or CPU core sets
(``--cpus-per-trial``), one *slot* per concurrent trial.

Each slot is a tuner thread that asks Optuna for a trial, launches it on the slot's devices and
tells the result (Optuna's storage serialises the asks and tells; the TPE sampler's constant liar
treats the other slots' running trials as bad results so that concurrent asks spread out).

* GPUs: slot ``i`` gets ``CUDA_VISIBLE_DEVICES`` = the ``i``-th group of K visible GPUs (the
  entries of the tuner's own ``CUDA_VISIBLE_DEVICES`` when set, indices, UUIDs or MIG ids alike);
  inside the trial local rank r uses the r-th of them.
* CPU cores: slot ``i`` gets the ``i``-th group of K cores of the tuner's affinity mask; the
  trial's torchrun is pinned to them with ``sched_setaffinity`` between fork and exec (every rank
  inherits the mask), so nothing in the training script or the environment has to cooperate.
* Rendezvous: one-node trials use ``torchrun --standalone``, which picks a free port per job, so
  concurrent trials never share a rendezvous.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from autobalance._errors import UsageError

__all__ = ["Slot", "plan_slots", "usable_cpus", "visible_gpus"]


@dataclass(frozen=True)
class Slot:
    """Where one concurrent trial runs."""

    index: int
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the slot's trials (``CUDA_VISIBLE_DEVICES``)."""
    cpus: tuple[int, ...] | None = None
    """Cores the slot's trials are pinned to (None: not pinned)."""

    def describe(self) -> str:
        parts = []
        if "CUDA_VISIBLE_DEVICES" in self.env:
            parts.append(f"GPUs {self.env['CUDA_VISIBLE_DEVICES']}")
        if self.cpus is not None:
            parts.append(f"cores {_ranges(self.cpus)}")
        return f"slot {self.index}: " + (", ".join(parts) or "all devices")


def _ranges(cpus: tuple[int, ...]) -> str:
    groups: list[list[int]] = []
    for c in sorted(cpus):
        if groups and groups[-1][1] == c - 1:
            groups[-1][1] = c
        else:
            groups.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in groups)


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: its ``CUDA_VISIBLE_DEVICES`` entries, or all indices."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is not None:
        return [x.strip() for x in raw.split(",") if x.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def plan_slots(*, device: str, nproc_per_node: int, nnodes: int, gpus_per_trial: int | None,
               cpus_per_trial: int | None, gpus: list[str] | None = None,
               cpus: list[int] | None = None) -> list[Slot]:
    """The slots for the flags (one slot, unpinned, when neither flag is given)."""
    if gpus_per_trial is None and cpus_per_trial is None:
        return [Slot(0)]
    if nnodes > 1:
        raise UsageError("--gpus-per-trial/--cpus-per-trial run several one-node trials at once; they do not combine "
                         "with --nnodes > 1 (a multi-node trial uses whole nodes).")
    counts = []
    if gpus_per_trial is not None:
        if device != "cuda":
            raise UsageError("--gpus-per-trial needs --device cuda; on CPU use --cpus-per-trial.")
        if gpus_per_trial < nproc_per_node:
            raise UsageError(f"--gpus-per-trial={gpus_per_trial} is smaller than --nproc-per-node={nproc_per_node}; "
                             "each rank needs its own GPU.")
        gpus = visible_gpus() if gpus is None else gpus
        if len(gpus) < gpus_per_trial:
            raise UsageError(f"--gpus-per-trial={gpus_per_trial} but only {len(gpus)} GPU(s) are visible; "
                             "use fewer or check CUDA_VISIBLE_DEVICES.")
        counts.append(len(gpus) // gpus_per_trial)
    if cpus_per_trial is not None:
        cpus = usable_cpus() if cpus is None else cpus
        if len(cpus) < cpus_per_trial:
            raise UsageError(f"--cpus-per-trial={cpus_per_trial} but this process may use only {len(cpus)} core(s); "
                             "use fewer.")
        counts.append(len(cpus) // cpus_per_trial)
    slots = []
    for i in range(min(counts)):
        env = {}
        if gpus_per_trial is not None and gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * gpus_per_trial:(i + 1) * gpus_per_trial])
        pinned = None
        if cpus_per_trial is not None and cpus is not None:
            pinned = tuple(cpus[i * cpus_per_trial:(i + 1) * cpus_per_trial])
        slots.append(Slot(i, env, pinned))
    return slots
