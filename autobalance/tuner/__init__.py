"""The tuner: an Optuna study whose trials are real torchrun jobs.

Running the study: ``_tuner`` (the :class:`Tuner`), ``_loop`` (the trial loop), ``_launching``
(slots, warm pools, heartbeats), ``_recording`` (what is told to the study), ``_baseline``,
``_study`` (opening and counting, several workers on one study), ``_summary``, ``_settings`` (the
settings, and the preflight checks before anything runs), ``_reporter`` (the console, each trial's
outcome in words), ``_verify`` (verify and save).
The search: ``_space``, ``_objective``, ``_memory_model``, ``_solver``, ``_models``, ``_policy``, ``_timing``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autobalance.protocol import best_trial, is_feasible
    from autobalance.tuner._finish import Saving, best_so_far, nothing_feasible, save_best
    from autobalance.tuner._remeasure import spread_text
    from autobalance.tuner._reporter import RichReporter
    from autobalance.tuner._settings import (
        CHOICES,
        SAMPLERS,
        STRATEGIES,
        SettingDoc,
        TuneSettings,
        check_caps,
        check_gpus,
        default_device,
        default_study_name,
        load_toml,
        memory_cap_text,
        parse_memory_cap,
        preflight,
        setting_docs,
        setting_types,
    )
    from autobalance.tuner._study import make_sampler
    from autobalance.tuner._summary import TuneResult
    from autobalance.tuner._tuner import Tuner
    from autobalance.tuner._verify import promote_trial, run_verify_command
    from autobalance.tuner.search import SearchSpace, TrialFigures, figures_from_outcome

_EXPORTS: dict[str, str] = {
    "best_so_far": "autobalance.tuner._finish",
    "best_trial": "autobalance.protocol",
    "CHOICES": "autobalance.tuner._settings",
    "check_caps": "autobalance.tuner._settings",
    "check_gpus": "autobalance.tuner._settings",
    "default_device": "autobalance.tuner._settings",
    "default_study_name": "autobalance.tuner._settings",
    "figures_from_outcome": "autobalance.tuner.search",
    "is_feasible": "autobalance.protocol",
    "load_toml": "autobalance.tuner._settings",
    "memory_cap_text": "autobalance.tuner._settings",
    "parse_memory_cap": "autobalance.tuner._settings",
    "make_sampler": "autobalance.tuner._study",
    "nothing_feasible": "autobalance.tuner._finish",
    "preflight": "autobalance.tuner._settings",
    "promote_trial": "autobalance.tuner._verify",
    "RichReporter": "autobalance.tuner._reporter",
    "run_verify_command": "autobalance.tuner._verify",
    "SAMPLERS": "autobalance.tuner._settings",
    "save_best": "autobalance.tuner._finish",
    "Saving": "autobalance.tuner._finish",
    "SearchSpace": "autobalance.tuner.search",
    "setting_docs": "autobalance.tuner._settings",
    "setting_types": "autobalance.tuner._settings",
    "spread_text": "autobalance.tuner._remeasure",
    "SettingDoc": "autobalance.tuner._settings",
    "STRATEGIES": "autobalance.tuner._settings",
    "TrialFigures": "autobalance.tuner.search",
    "Tuner": "autobalance.tuner._tuner",
    "TuneResult": "autobalance.tuner._summary",
    "TuneSettings": "autobalance.tuner._settings",
}
"""Where each name lives: imported on first use, so ``import autobalance.tuner._settings`` (the CLI's
flags, ``autobalance --help``) does not import optuna, sqlalchemy or torch."""


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autobalance.tuner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["CHOICES", "SAMPLERS", "STRATEGIES", "RichReporter", "Saving", "SearchSpace", "SettingDoc",
           "TrialFigures", "TuneResult", "TuneSettings", "Tuner", "best_so_far", "best_trial", "check_caps",
           "check_gpus", "default_device", "default_study_name", "figures_from_outcome", "is_feasible", "load_toml",
           "make_sampler", "memory_cap_text", "nothing_feasible", "parse_memory_cap", "preflight", "promote_trial",
           "run_verify_command", "save_best", "setting_docs", "setting_types", "spread_text"]
