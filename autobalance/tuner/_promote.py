"""Saving a trial's configuration to the store (end of ``tune`` and ``autobalance promote``)."""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import FrozenTrial

from autobalance._config import BalanceConfig
from autobalance._errors import UsageError
from autobalance.tuner._study import (
    ATTR_BASELINE,
    ATTR_CAPACITY,
    ATTR_DEVICE,
    ATTR_OBJECTIVE,
    ATTR_SCRIPT_SHA,
)

__all__ = ["figures_of_trial", "fingerprint_of_study", "save_trial"]

_FIGURE_KEYS = ("peak_device_gib", "peak_reserved_gib", "peak_allocated_gib", "outside_pytorch_gib",
                "capacity_gib", "spread_gib", "spread_pct_of_capacity", "step_time_ms", "samples_per_s", "status")


def figures_of_trial(study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
    figures: dict[str, Any] = {k: trial.user_attrs.get(k) for k in _FIGURE_KEYS}
    figures["values"] = trial.values
    base_no = study.user_attrs.get(ATTR_BASELINE)
    if base_no is not None:
        base = study.trials[base_no]
        figures["baseline"] = {k: base.user_attrs.get(k) for k in _FIGURE_KEYS}
        figures["baseline"]["trial"] = base_no
        if base.user_attrs.get("step_time_ms") and trial.user_attrs.get("step_time_ms"):
            figures["speedup_vs_baseline"] = round(base.user_attrs["step_time_ms"] / trial.user_attrs["step_time_ms"], 4)
    return figures


def fingerprint_of_study(study: optuna.Study) -> Any:
    from autobalance.store import HardwareFingerprint

    objective = study.user_attrs.get(ATTR_OBJECTIVE, {})
    device = study.user_attrs.get(ATTR_DEVICE, {})
    world = int(objective.get("world_size", 1))
    caps = objective.get("caps_bytes") or [None] * world
    capacity = [int(c) for c in study.user_attrs.get(ATTR_CAPACITY, [])] or [0] * world
    return HardwareFingerprint(
        device_type=device.get("type", objective.get("device", "cpu")),
        device_name=device.get("name", "unknown"),
        capacity_bytes=capacity,
        cap_bytes=list(caps),
        world_size=world,
        nnodes=int(objective.get("nnodes", 1)),
        torch_version=str(study.user_attrs.get("autobalance:torch_version") or ""),
        cuda_version=study.user_attrs.get("autobalance:cuda_version"),
    )


def save_trial(*, storage_url: str, study: optuna.Study, trial_number: int, action: str) -> Any:
    """Save the trial's configuration as the study's current best; returns the SavedConfig."""
    from autobalance.store import ConfigStore, make_saved_by

    trials = study.get_trials(deepcopy=False)
    if not 0 <= trial_number < len(trials):
        raise UsageError(
            f"--trial={trial_number} is not a trial of study {study.study_name!r} (it has trials 0..{len(trials) - 1}); "
            f"list them with `autobalance trials --study-name {study.study_name}`."
        )
    trial = trials[trial_number]
    if "config" not in trial.user_attrs or trial.user_attrs.get("status") != "ok":
        raise UsageError(
            f"--trial={trial_number} has no measured configuration (status {trial.user_attrs.get('status')!r}); "
            "promote a trial whose status is ok."
        )
    with ConfigStore(url=storage_url) as store:
        return store.save(
            study_name=study.study_name,
            trial_number=trial_number,
            config=BalanceConfig.from_dict(trial.user_attrs["config"]),
            figures=figures_of_trial(study, trial),
            fingerprint=fingerprint_of_study(study),
            script_sha256=str(study.user_attrs.get(ATTR_SCRIPT_SHA, "")),
            saved_by=make_saved_by(action),
        )
