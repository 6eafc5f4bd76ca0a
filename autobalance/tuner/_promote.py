"""Saving a trial's configuration to the store (end of ``tune`` and ``autobalance promote``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from autobalance._config import BalanceConfig
from autobalance._errors import UsageError, VerificationError
from autobalance._files import script_sha256
from autobalance.protocol import Status, StudyAttr, TrialAttr
from autobalance.tuner._notes import write_notes
from autobalance.tuner._remeasure import saved_spread

__all__ = ["figures_of_trial", "fingerprint_of_study", "promote_trial", "save_trial"]

_FIGURE_KEYS = ("peak_device_gib", "peak_reserved_gib", "peak_allocated_gib", "outside_pytorch_gib",
                "capacity_gib", "spread_gib", "spread_pct_of_capacity", "step_time_ms", "step_time_iqr_pct",
                "samples_per_s", "status")


def figures_of_trial(study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
    figures: dict[str, Any] = {k: trial.user_attrs.get(k) for k in _FIGURE_KEYS}
    figures["values"] = trial.values
    spread = saved_spread(study, trial)  # the step time with its spread (pooled when the leaders were re-measured)
    if spread is not None:
        figures["step_time_spread"] = spread
    verdict = study.user_attrs.get(f"{StudyAttr.VERIFY_PREFIX}{trial.number}")
    figures["verification"] = None if verdict is None else {
        k: verdict.get(k) for k in ("passed", "reason", "skipped")}
    base_no = study.user_attrs.get(StudyAttr.BASELINE)
    if base_no is not None:
        base = study.trials[base_no]
        figures["baseline"] = {k: base.user_attrs.get(k) for k in _FIGURE_KEYS}
        figures["baseline"]["trial"] = base_no
        if base.user_attrs.get(TrialAttr.STEP_TIME_MS) and trial.user_attrs.get(TrialAttr.STEP_TIME_MS):
            figures["speedup_vs_baseline"] = round(base.user_attrs[TrialAttr.STEP_TIME_MS] / trial.user_attrs[TrialAttr.STEP_TIME_MS], 4)
    return figures


def fingerprint_of_study(study: optuna.Study, trial: FrozenTrial | None = None) -> Any:
    """The tuning job's hardware: devices (each rank's identity, which production maps the
    configuration by), memory, versions; with ``trial``, each rank's busy ms per sample in it."""
    from autobalance.store import HardwareFingerprint

    objective = study.user_attrs.get(StudyAttr.OBJECTIVE, {})
    device = study.user_attrs.get(StudyAttr.DEVICE, {})
    world = int(objective.get("world_size", 1))
    caps = objective.get("caps_bytes") or [None] * world
    capacity = [int(c) for c in study.user_attrs.get(StudyAttr.CAPACITY, [])] or [0] * world
    names = study.user_attrs.get(StudyAttr.DEVICE_NAMES) or []
    speeds: list[float | None] = []
    busy = trial.user_attrs.get(TrialAttr.BUSY_MS) if trial is not None else None
    if trial is not None and isinstance(busy, list) and len(busy) == world and TrialAttr.CONFIG in trial.user_attrs:
        samples = BalanceConfig.from_dict(trial.user_attrs[TrialAttr.CONFIG]).samples_per_rank
        speeds = [None if b is None else round(b / n, 4) for b, n in zip(busy, samples, strict=True)]
    return HardwareFingerprint(
        device_names=[str(n) for n in names] if len(names) == world and all(names) else [],
        ms_per_sample=speeds,
        device_type=device.get("type", objective.get("device", "cpu")),
        device_name=device.get("name", "unknown"),
        capacity_bytes=capacity,
        cap_bytes=list(caps),
        world_size=world,
        nnodes=int(objective.get("nnodes", 1)),
        torch_version=str(study.user_attrs.get(StudyAttr.TORCH_VERSION) or ""),
        cuda_version=study.user_attrs.get(StudyAttr.CUDA_VERSION),
    )


def save_trial(*, storage_url: str, study: optuna.Study, trial_number: int, action: str) -> Any:
    """Save the trial's configuration as the study's current best; returns the SavedConfig."""
    from autobalance.store import ConfigStore, make_saved_by

    trial = _measured_trial(study, trial_number)
    with ConfigStore(url=storage_url) as store:
        return store.save(
            study_name=study.study_name,
            trial_number=trial_number,
            config=BalanceConfig.from_dict(trial.user_attrs[TrialAttr.CONFIG]),
            figures=figures_of_trial(study, trial),
            fingerprint=fingerprint_of_study(study, trial),
            script_sha256=str(study.user_attrs.get(StudyAttr.SCRIPT_SHA, "")),
            saved_by=make_saved_by(action),
        )


def promote_trial(*, storage_url: str, study: optuna.Study, trial_number: int, verify: bool = True,
                  script: str | None = None, script_args: list[str] | None = None,
                  note: Callable[[str], None] | None = None) -> tuple[Any, str]:
    """``autobalance promote``: save a chosen trial as the study's best, verified first like the end
    of ``tune`` (a trial that failed verification is never saved; ``verify=False`` skips a trial
    not verified yet). ``script``/``script_args`` default to how the study's latest ``tune`` ran it.
    Returns the SavedConfig and one line on the verification."""
    trial = _measured_trial(study, trial_number)
    previous = study.user_attrs.get(f"{StudyAttr.VERIFY_PREFIX}{trial_number}")
    if previous is not None and not previous.get("passed"):
        raise VerificationError(
            f"trial {trial_number} of {study.study_name!r} failed verification ({previous.get('reason')}); a configuration "
            "that fails is never saved. Promote another trial (`autobalance trials --study-name "
            f"{study.study_name}`), or, if the script was fixed since, verify it again with `autobalance verify SCRIPT "
            f"--study-name {study.study_name} --trial {trial_number}`.")
    if previous is not None:
        line = f"verified earlier: {previous.get('reason')}"
    elif not verify:
        line = "not verified (--no-verify)"
    else:
        verdict = _verify_trial(study, trial, script=script, script_args=script_args, note=note)
        study.set_user_attr(f"{StudyAttr.VERIFY_PREFIX}{trial_number}", verdict.to_dict())
        write_notes(study)
        if not verdict.passed:
            raise VerificationError(f"trial {trial_number} of {study.study_name!r} failed verification: {verdict.reason}; "
                                    "it is not saved. Promote another trial.")
        line = f"verified: {verdict.reason} ({verdict.wall_s:.0f} s)"
    saved = save_trial(storage_url=storage_url, study=study, trial_number=trial_number, action="promote")
    return saved, line


def _verify_trial(study: optuna.Study, trial: FrozenTrial, *, script: str | None, script_args: list[str] | None,
                  note: Callable[[str], None] | None) -> Any:
    from autobalance.tuner._verify import allows_batch_dependent
    from autobalance.verify import Verifier, VerifyTarget

    launch = dict(study.user_attrs.get(StudyAttr.LAUNCH) or {})
    script = script or launch.get("script")
    if not script:
        raise UsageError(f"study {study.study_name!r} does not record its training script (tuned before autobalance "
                         "kept it); pass --script PATH, or --no-verify to save without verification.")
    if not os.path.isfile(script):
        raise UsageError(f"--script={script!r} is not a file; pass the training script the study tuned, or --no-verify.")
    tuned_sha = study.user_attrs.get(StudyAttr.SCRIPT_SHA)
    if tuned_sha and script_sha256(script) != tuned_sha:
        raise UsageError(f"--script={script!r} differs from the script the study tuned (sha256); pass that script, "
                         "or --no-verify to save without verification.")
    base_no = study.user_attrs.get(StudyAttr.BASELINE)
    baseline = None
    if base_no is not None and study.trials[base_no].user_attrs.get(TrialAttr.CONFIG):
        baseline = BalanceConfig.from_dict(study.trials[base_no].user_attrs[TrialAttr.CONFIG])
    config = BalanceConfig.from_dict(trial.user_attrs[TrialAttr.CONFIG])
    runs_dir = str(launch.get("runs_dir") or "autobalance_runs")
    device = launch.get("device") or (study.user_attrs.get(StudyAttr.DEVICE) or {}).get("type") or "cpu"
    target = VerifyTarget(
        script=script, script_args=list(script_args if script_args is not None else launch.get("script_args") or []),
        nproc_per_node=int(launch.get("nproc_per_node") or config.world_size), device=str(device),
        torchrun_args=list(launch.get("torchrun_args") or []), timeout_s=float(launch.get("trial_timeout") or 300),
        work_dir=os.path.join(runs_dir, study.study_name, f"verify-trial{trial.number}-{int(time.time())}"),
        cold=bool(launch.get("cold", False)), env=dict(launch.get("compile_env") or {}))
    return Verifier(target, note=note, allow_batch_dependent=allows_batch_dependent(study)).verify(config, baseline=baseline)


def _measured_trial(study: optuna.Study, trial_number: int) -> FrozenTrial:
    trials = study.get_trials(deepcopy=False)
    if not 0 <= trial_number < len(trials):
        raise UsageError(
            f"--trial={trial_number} is not a trial of study {study.study_name!r} (it has trials 0..{len(trials) - 1}); "
            f"list them with `autobalance trials --study-name {study.study_name}`."
        )
    trial = trials[trial_number]
    if TrialAttr.CONFIG not in trial.user_attrs or trial.user_attrs.get(TrialAttr.STATUS) != Status.OK:
        raise UsageError(
            f"--trial={trial_number} has no measured configuration (status {trial.user_attrs.get('status')!r}); "
            "promote a trial whose status is ok."
        )
    return trial
