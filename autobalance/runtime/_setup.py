"""A rank's process set-up: its settings from the environment, its device, its process group.

The launcher passes a trial's settings as ``AUTOBALANCE_*`` variables, which ``plan()`` reads once
with :meth:`autobalance._env.TrialEnv.read` (the device, before the process group exists, from
:meth:`~autobalance._env.TrialEnv.read_job`); a malformed one (here: the process-group timeout) is a
:class:`~autobalance._errors.UsageError` naming the variable. The process
group is created here when torchrun started the rank and nobody created it yet, with a short
timeout in a trial so that a lost peer cannot hang a rank, and torn down at exit.
"""

from __future__ import annotations

import atexit
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from autobalance import _env
from autobalance._errors import UsageError

__all__ = ["EXIT_BARRIER_S", "init_distributed", "int_env", "resolve_device", "tear_down_group"]

EXIT_BARRIER_S = 30
"""How long a gloo rank waits at exit for the others before tearing its group down anyway."""


def int_env(name: str, default: int) -> int:
    return _env.parse_int(os.environ.get(name), name, default)


def init_distributed(device_type: str, timeout_s: int) -> tuple[int, int, int]:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
        if device_type == "cuda":
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(**kwargs)
        # the group autobalance created is torn down at exit: a live gloo/NCCL group at
        # interpreter shutdown can abort the process ("terminate called without an active exception")
        atexit.register(tear_down_group)
    if dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
    return rank, world_size, local_rank


def tear_down_group() -> None:
    """Destroy the default process group, on gloo after every rank got here (a barrier of at most
    :data:`EXIT_BARRIER_S`): a rank that tore its gloo connections down while a peer still used them
    aborted that peer at exit ("terminate called without an active exception", SIGABRT) in 7 of 60
    two-rank CPU production runs on a busy 2-core machine, 1 of 130 with the barrier (2026-12-05,
    ``tests/test_partial_steps.py``'s job, two loops side by side): narrower, not closed - the ranks
    still leave the barrier at different moments. Errors are swallowed: the job's work is done."""
    if dist.is_initialized():
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=EXIT_BARRIER_S))
            dist.destroy_process_group()
        except Exception:
            pass


def resolve_device(device: str | None, job: _env.TrialEnv) -> torch.device:
    """``device`` (the script's argument), else ``AUTOBALANCE_DEVICE`` (``job.device``), else cuda when available."""
    choice = device or job.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if choice not in ("cpu", "cuda"):
        raise UsageError(f"device={choice!r} is not supported; use 'cpu' or 'cuda'.")
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("device='cuda' but no CUDA device is visible; use device='cpu'.")
    return torch.device(choice)
