"""Production loading: find the saved configuration and check it fits this job."""

from __future__ import annotations

import os
import warnings

from autobalance._errors import HardwareMismatchError, UsageError
from autobalance._files import script_sha256
from autobalance.store._file import read_export_file
from autobalance.store._fingerprint import HardwareFingerprint, differences, minor_differences
from autobalance.store._saved import SavedConfig
from autobalance.store._url import DEFAULT_STORAGE

__all__ = [
    "MISMATCH_POLICIES",
    "HardwareMismatchWarning",
    "check_compatibility",
    "load_saved_config",
    "ranks_differ",
    "script_sha256",
]

MISMATCH_POLICIES = ("error", "warn")
"""What :func:`check_compatibility` does when the hardware differs from the tuning job's."""


class HardwareMismatchWarning(UserWarning):
    """A saved configuration is used on hardware or software that differs from the tuning job's."""


def load_saved_config(
    *, study: str | None = None, storage: str | None = None, config_file: str | None = None
) -> SavedConfig:
    """The configuration a production job should use.

    ``config_file`` (an export file) wins and needs no database; otherwise the current saved
    configuration of ``study`` in ``storage`` (default ``sqlite:///autobalance.db``).
    """
    if config_file:
        return read_export_file(config_file)
    if not study:
        raise UsageError(
            "No study to load a configuration from; set AUTOBALANCE_STUDY (and AUTOBALANCE_STORAGE) "
            "or AUTOBALANCE_CONFIG_FILE, or pass study=... to plan()."
        )
    from autobalance.store._store import ConfigStore

    with ConfigStore(url=storage or DEFAULT_STORAGE) as store:
        return store.load(study)


def ranks_differ(saved: SavedConfig, *, world_size: int) -> str | None:
    """Why ``saved`` cannot run in a job of ``world_size`` ranks (its configuration gives each rank
    its own micro-batches and blocks), in words; None when the rank counts agree."""
    if saved.config.world_size == world_size:
        return None
    return (f"study {saved.study_name!r} (trial {saved.trial_number}) was tuned for {saved.config.world_size} "
            f"rank(s), this job has {world_size}")


def check_compatibility(
    saved: SavedConfig,
    *,
    current: HardwareFingerprint,
    script_path: str | os.PathLike[str] | None = None,
    policy: str = "error",
) -> list[str]:
    """Compare the tuning job's hardware with this job's; returns every difference found.

    Hardware differences (ranks, nodes, GPU model, per-rank memory) raise
    :class:`HardwareMismatchError` naming all of them under ``policy="error"`` and are warned
    about under ``policy="warn"``. torch/CUDA versions and a changed training script are only
    ever warnings (:class:`HardwareMismatchWarning`, one per difference). An emulated cap this job
    runs without, on as much memory, is no difference (``cap_lifted_note`` says it in one line); a
    different number of ranks is one, and under ``policy="error"`` its error names that fix.
    """
    if policy not in MISMATCH_POLICIES:
        raise UsageError(
            f"mismatch policy={policy!r} is unknown; use one of {', '.join(MISMATCH_POLICIES)}."
        )
    what = f"study {saved.study_name!r} (trial {saved.trial_number})"
    major = differences(saved.fingerprint, current)
    if major and policy == "error":
        ranks = ranks_differ(saved, world_size=current.world_size)
        fix = (f"run the job with {saved.config.world_size} ranks, or tune a study with this job's "
               f"{current.world_size} (`autobalance tune ... --nproc-per-node`)" if ranks else
               "tune again on this hardware (`autobalance tune`), or use the 'warn' mismatch policy to run it anyway")
        raise HardwareMismatchError(
            f"The saved configuration of {what} was tuned on different hardware: {'; '.join(major)}; {fix}."
        )
    minor = minor_differences(saved.fingerprint, current)
    script: list[str] = []
    if script_path is not None and saved.script_sha256 and os.path.isfile(script_path):
        now = script_sha256(script_path)
        if now != saved.script_sha256:
            script.append(
                f"training script changed since tuning (sha {saved.script_sha256[:12]} vs {now[:12]})"
            )
    for line in major:
        warnings.warn(
            f"autobalance: {what} was tuned on different hardware: {line}; using it anyway (policy 'warn').",
            HardwareMismatchWarning,
            stacklevel=2,
        )
    for line in minor + script:
        warnings.warn(f"autobalance: {what}: {line}.", HardwareMismatchWarning, stacklevel=2)
    return major + minor + script
