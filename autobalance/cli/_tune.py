"""``autobalance tune``: settings, the study, the final comparison and where things live."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

from autobalance._errors import UsageError
from autobalance.cli._common import console, quiet_optuna, sigterm_as_interrupt


def interrupted_message(settings: Any) -> str:
    """After Ctrl-C: what happened, the best trial so far and how to keep it (one line)."""
    from autobalance._config import describe_config
    from autobalance.store import mask_url
    from autobalance.tuner import best_so_far

    text = "interrupted; the running trial was killed and marked failed."
    best = best_so_far(study_name=settings.study_name, storage_url=settings.storage)
    if best is None:
        text += " No feasible trial yet."
    else:
        a = best.user_attrs
        figures = ", ".join(f for f in (
            f"step {a['step_time_ms']:.1f} ms" if a.get("step_time_ms") is not None else "",
            f"spread {a['spread_gib']:.4g} GiB" if a.get("spread_gib") is not None else "") if f)
        text += (f" Best so far: trial {best.number} ({describe_config(a.get('config'))}; {figures}); keep it with "
                 f"`autobalance promote --study-name {settings.study_name} --trial {best.number} --storage "
                 f"{mask_url(settings.storage)}` (verifies, then saves), or")
    return text + " run the same command again to continue the study."


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


def _check_gpus(settings: Any) -> None:
    visible = 0
    if settings.device == "cuda":
        import torch

        visible = torch.cuda.device_count()
    check_gpus(device=settings.device, nproc_per_node=settings.nproc_per_node, visible=visible)
    if settings.caps_bytes():
        check_caps(caps_bytes=settings.caps_bytes(), capacities=local_capacities(settings.device, settings.nproc_per_node),
                   device=settings.device)


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
    for d in reversed(created):
        with contextlib.suppress(OSError):
            os.rmdir(d)


def run_tune(*, flags: dict[str, Any], config_path: str | None) -> None:
    """Settings (flags > study TOML > defaults; the TOML is read once), checks before anything runs,
    the study, then verify-and-save (:func:`autobalance.tuner.save_best`) and the summary."""
    from autobalance._errors import StorageError
    from autobalance.store import check_storage, open_storage
    from autobalance.tuner import RichReporter, Tuner, TuneSettings, save_best

    settings = TuneSettings.merge(flags=flags, toml_path=config_path)
    quiet_optuna()
    _check_gpus(settings)
    created = prepare_runs_dir(settings.runs_dir)
    try:
        settings.storage = check_storage(settings.storage)
        open_storage(settings.storage)
    except StorageError as exc:
        remove_dirs(created)
        message = str(exc) if str(exc).startswith("--storage") else f"--storage: {exc}"
        raise type(exc)(message) from None  # fail before any trial when the storage is unusable
    sigterm_as_interrupt()
    reporter = RichReporter(console=console(stderr=True))
    tuner = Tuner(settings=settings, reporter=reporter)
    try:
        result = tuner.run()
    except KeyboardInterrupt:
        raise KeyboardInterrupt(interrupted_message(settings)) from None
    finally:
        reporter.end()
        remove_dirs(created)  # only those still empty: a study refused before any trial leaves nothing
    saving = save_best(settings=settings, result=result, note=reporter.note)
    from autobalance.cli._views import print_result

    print_result(result, settings=settings, console=console(), nothing_feasible=saving.nothing_feasible)
    if saving.rejected_all:  # nothing saved because every candidate failed: not a success
        from autobalance._errors import VerificationError

        trials = ", ".join(str(n) for n in saving.rejected)
        raise VerificationError(
            f"nothing was saved: every configuration tried failed verification (trial(s) {trials}; the reasons are "
            "above). Fix what they name in the script (most often a loss that is not a per-sample mean), then "
            "tune a new study (--study-name), or re-verify one of these trials with `autobalance verify SCRIPT "
            "--study-name NAME --trial N` and save it with `autobalance promote`; until then keep the script's "
            "own configuration."
        )
