"""The tuner: an Optuna study whose trials are real torchrun jobs.

Running the study: ``_tuner`` (the :class:`Tuner`), ``_loop`` (the trial loop), ``_launching``
(slots, warm pools, heartbeats), ``_recording`` (what is told to the study), ``_baseline``,
``_study`` (opening and counting), ``_summary``, ``_workers`` (several workers on one study).
The search: ``_space``, ``_objective``, ``_memory_model``, ``_solver``, ``_advisor``, ``_compile``.
"""

from __future__ import annotations

from autobalance.protocol import best_trial, is_feasible
from autobalance.tuner._finish import Saving, best_so_far, nothing_feasible, save_best
from autobalance.tuner._promote import promote_trial
from autobalance.tuner._reporter import RichReporter
from autobalance.tuner._settings import (
    SAMPLERS,
    STRATEGIES,
    SettingDoc,
    TuneSettings,
    default_device,
    default_study_name,
    load_toml,
    setting_docs,
)
from autobalance.tuner._study import make_sampler
from autobalance.tuner._summary import TuneResult
from autobalance.tuner._tuner import Tuner
from autobalance.tuner._verify import run_verify_command
from autobalance.tuner.search import SearchSpace, TrialFigures, figures_from_outcome

__all__ = [
    "SAMPLERS",
    "STRATEGIES",
    "RichReporter",
    "Saving",
    "SearchSpace",
    "SettingDoc",
    "TrialFigures",
    "TuneResult",
    "TuneSettings",
    "Tuner",
    "best_so_far",
    "best_trial",
    "default_device",
    "default_study_name",
    "figures_from_outcome",
    "is_feasible",
    "load_toml",
    "make_sampler",
    "nothing_feasible",
    "promote_trial",
    "run_verify_command",
    "save_best",
    "setting_docs",
]
