"""Before ``tune`` starts anything: the GPUs and memory caps against this host, the runs directory,
the storage. Each failure is a :class:`~autobalance._errors.UsageError` or
:class:`~autobalance._errors.StorageError` naming the flag to change, raised before any trial."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

from autobalance._errors import StorageError, UsageError
from autobalance.tuner._settings import TuneSettings

__all__ = ["check_caps", "check_gpus", "local_capacities", "preflight", "prepare_runs_dir", "remove_dirs"]


@contextlib.contextmanager
def preflight(settings: TuneSettings) -> Iterator[None]:
    """Check the host and the storage (``settings.storage`` becomes the checked URL), create
    ``--runs-dir``; on leaving, remove the directories created that are still empty (a study refused
    before any trial leaves nothing behind)."""
    check_host(settings)
    created = prepare_runs_dir(settings.runs_dir)
    try:
        check_study_storage(settings)
        yield
    finally:
        remove_dirs(created)


def check_host(settings: TuneSettings) -> None:
    """``--nproc-per-node`` and ``--memory-cap-gib`` against this host's GPUs (or memory)."""
    visible = 0
    if settings.device == "cuda":
        import torch

        visible = torch.cuda.device_count()
    check_gpus(device=settings.device, nproc_per_node=settings.nproc_per_node, visible=visible)
    if settings.caps_bytes():
        check_caps(caps_bytes=settings.caps_bytes(), capacities=local_capacities(settings.device, settings.nproc_per_node),
                   device=settings.device)


def check_gpus(*, device: str, nproc_per_node: int, visible: int) -> None:
    """``--nproc-per-node`` against the GPUs this host sees (one GPU per rank; CUDA only)."""
    if device != "cuda":
        return
    if visible == 0:
        raise UsageError("--device=cuda but no CUDA device is visible; use --device cpu.")
    if nproc_per_node > visible:
        raise UsageError(
            f"--nproc-per-node={nproc_per_node} is larger than the {visible} visible GPU(s); "
            f"use at most {visible} or check CUDA_VISIBLE_DEVICES."
        )


def check_caps(*, caps_bytes: list[int] | None, capacities: list[int], device: str) -> None:
    """``--memory-cap-gib`` against each local rank's card (on CPU: the host's memory)."""
    for rank, (cap, capacity) in enumerate(zip(caps_bytes or [], capacities, strict=False)):
        if cap > capacity:
            card = "its card" if device == "cuda" else "this host's memory"
            raise UsageError(
                f"--memory-cap-gib={cap / 2**30:g} for rank {rank} is larger than {card} "
                f"({capacity / 2**30:.1f} GiB); use at most {capacity / 2**30:.1f}."
            )


def local_capacities(device: str, nproc_per_node: int) -> list[int]:
    """Capacity in bytes of the device of each local rank (CPU: physical memory)."""
    if device == "cuda":
        import torch

        count = torch.cuda.device_count()
        return [int(torch.cuda.get_device_properties(i).total_memory) for i in range(min(nproc_per_node, count))]
    return [int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))] * nproc_per_node


def prepare_runs_dir(path: str) -> list[str]:
    """Create ``--runs-dir`` and prove it is writable; returns the directories created (for cleanup)."""
    created: list[str] = []
    target = os.path.abspath(path)
    missing: list[str] = []
    probe_dir = target
    while not os.path.isdir(probe_dir) and os.path.dirname(probe_dir) != probe_dir:
        missing.append(probe_dir)
        probe_dir = os.path.dirname(probe_dir)
    try:
        for d in reversed(missing):
            os.mkdir(d)
            created.append(d)
        fd, probe = tempfile.mkstemp(prefix=".autobalance-probe-", dir=target)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        remove_dirs(created)
        raise UsageError(
            f"--runs-dir={path!r} is not writable ({exc.strerror or exc}); pass a writable directory for the "
            "trials' reports and logs."
        ) from None
    return created


def remove_dirs(created: list[str]) -> None:
    """Remove the directories :func:`prepare_runs_dir` created, deepest first, those still empty only."""
    for d in reversed(created):
        with contextlib.suppress(OSError):
            os.rmdir(d)


def check_study_storage(settings: TuneSettings) -> None:
    """Fail before any trial when the storage is unusable; ``settings.storage`` becomes the checked URL."""
    from autobalance.store import check_storage, open_storage

    try:
        settings.storage = check_storage(settings.storage)
        open_storage(settings.storage)
    except StorageError as exc:
        message = str(exc) if str(exc).startswith("--storage") else f"--storage: {exc}"
        raise type(exc)(message) from None
