"""The Optuna study: search space, objective, constraints, and the tuning loop."""

from __future__ import annotations

from autobalance.tuner._finish import Saving, best_so_far, nothing_feasible, save_best
from autobalance.tuner._objective import TrialFigures, figures_from_outcome
from autobalance.tuner._promote import promote_trial
from autobalance.tuner._reporter import RichReporter, describe_config
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
from autobalance.tuner._space import SearchSpace
from autobalance.tuner._storage import list_studies, load_study, open_storage
from autobalance.tuner._study import (
    ATTR_BASELINE,
    ATTR_OBJECTIVE,
    ATTR_REFERENCE,
    ATTR_SPACE,
    Tuner,
    TuneResult,
    best_trial,
    is_feasible,
    make_sampler,
)
from autobalance.tuner._verify import run_verify_command

__all__ = [
    "ATTR_BASELINE",
    "ATTR_OBJECTIVE",
    "ATTR_REFERENCE",
    "ATTR_SPACE",
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
    "describe_config",
    "figures_from_outcome",
    "is_feasible",
    "list_studies",
    "load_study",
    "load_toml",
    "make_sampler",
    "nothing_feasible",
    "open_storage",
    "promote_trial",
    "run_verify_command",
    "save_best",
    "setting_docs",
]
