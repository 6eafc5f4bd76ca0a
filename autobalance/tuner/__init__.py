"""The tuner: an Optuna study whose trials are real torchrun jobs.

Running the study: ``_tuner`` (the :class:`Tuner`), ``_loop`` (the trial loop), ``_launching`` (slots, warm pools,
heartbeats), ``_recording`` (what is told to the study), ``_baseline``, ``_study`` (opening and counting, several
workers on one study), ``_summary``, ``_settings`` (the settings, and the preflight checks before anything runs),
``_reporter`` (the console, each trial's outcome in words), ``_verify`` (verify and save). The search: ``_space``,
``_objective``, ``_memory_model``, ``_solver``, ``_models``, ``_policy``, ``_timing``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autobalance.protocol import best_trial, is_feasible
    from autobalance.tuner._finish import best_so_far, nothing_feasible, save_best
    from autobalance.tuner._remeasure import spread_text
    from autobalance.tuner._reporter import RichReporter
    from autobalance.tuner._settings import (
        CHOICES,
        TuneSettings,
        check_caps,
        check_gpus,
        default_device,
        load_toml,
        memory_cap_text,
        parse_memory_cap,
        preflight,
        setting_docs,
        setting_types,
    )
    from autobalance.tuner._summary import TuneResult
    from autobalance.tuner._tuner import Tuner
    from autobalance.tuner._verify import promote_trial, run_verify_command
    from autobalance.tuner.search import SearchSpace, TrialFigures

_EXPORTS: dict[str, tuple[str, ...]] = {
    "autobalance.protocol": ("best_trial", "is_feasible"),
    "autobalance.tuner._finish": ("best_so_far", "nothing_feasible", "save_best"),
    "autobalance.tuner._remeasure": ("spread_text",),
    "autobalance.tuner._reporter": ("RichReporter",),
    "autobalance.tuner._settings": ("CHOICES", "TuneSettings", "check_caps", "check_gpus", "default_device",
                                    "load_toml", "memory_cap_text", "parse_memory_cap", "preflight",
                                    "setting_docs", "setting_types"),
    "autobalance.tuner._summary": ("TuneResult",),
    "autobalance.tuner._tuner": ("Tuner",),
    "autobalance.tuner._verify": ("promote_trial", "run_verify_command"),
    "autobalance.tuner.search": ("SearchSpace", "TrialFigures"),
}
"""Where each name lives: imported on first use, so ``import autobalance.tuner._settings`` (the CLI's
flags, ``autobalance --help``) does not import optuna, sqlalchemy or torch."""
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'autobalance.tuner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["CHOICES", "RichReporter", "SearchSpace", "TrialFigures", "TuneResult", "TuneSettings", "Tuner",
           "best_so_far", "best_trial", "check_caps", "check_gpus", "default_device", "is_feasible", "load_toml",
           "memory_cap_text", "nothing_feasible", "parse_memory_cap", "preflight", "promote_trial",
           "run_verify_command", "save_best", "setting_docs", "setting_types", "spread_text"]
