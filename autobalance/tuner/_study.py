"""The study: the sampler, opening (or continuing) a study with the same objective and search
space, and which trials count towards ``--trials``."""

from __future__ import annotations

import json
import warnings
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._errors import UsageError
from autobalance.protocol import MEASURED_STATUSES, Status, StudyAttr, TrialAttr
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner._workers import NOT_COUNTED, fail_stale_trials
from autobalance.tuner.search import SearchSpace, space_problem

__all__ = ["check_space", "counted_trials", "counts", "make_sampler", "measured_configs", "open_study"]


def make_sampler(settings: TuneSettings, *, n_trials: int) -> optuna.samplers.BaseSampler:
    seed = settings.seed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if settings.sampler == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if settings.sampler == "gp":
            return optuna.samplers.GPSampler(seed=seed, n_startup_trials=min(10, max(2, n_trials // 4)))
        if settings.sampler == "nsga2":
            return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, min(20, n_trials // 3)))
        return optuna.samplers.TPESampler(
            seed=seed, multivariate=True, constant_liar=True, n_startup_trials=min(10, max(3, n_trials // 4))
        )


def objective_settings(s: TuneSettings) -> dict[str, Any]:
    """What a continued study must keep (stored once as :attr:`StudyAttr.OBJECTIVE`)."""
    return {"weight_spread": s.weight_spread, "weight_time": s.weight_time, "headroom": s.headroom,
            "multi_objective": s.multi_objective, "caps_bytes": s.caps_bytes(), "device": s.device,
            "world_size": s.world_size, "nnodes": s.nnodes, "cap_mode": s.cap_mode,
            "max_spread_gib": s.max_spread_gib}


def open_study(s: TuneSettings, storage: optuna.storages.RDBStorage) -> optuna.Study:
    """Create the study, or load it when its objective matches; stale trials of dead workers are failed."""
    directions: list[Any] = ["minimize", "minimize"] if s.multi_objective else ["minimize"]
    study = optuna.create_study(
        study_name=s.study_name, storage=storage, directions=directions,
        sampler=make_sampler(s, n_trials=s.trials), load_if_exists=True,
    )
    if [d.name.lower() for d in study.directions] != directions:
        raise UsageError(
            f"--study-name={s.study_name!r} exists with {len(study.directions)} objective(s) but this run asks for "
            f"{len(directions)} ({'--multi-objective' if s.multi_objective else 'single objective'}); "
            "use the same setting or a new --study-name."
        )
    objective = objective_settings(s)
    stored = study.user_attrs.get(StudyAttr.OBJECTIVE)
    if stored is None:
        study.set_user_attr(StudyAttr.OBJECTIVE, objective)
        names = ["spread_frac", "step_time_norm"] if s.multi_objective else ["spread_plus_time"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            study.set_metric_names(names)
    elif stored != objective:
        diff = sorted(k for k in objective if stored.get(k) != objective[k])
        raise UsageError(
            f"--study-name={s.study_name!r} exists with another search space/objective (differs in: {', '.join(diff)}); "
            "run with the original settings to continue it, or pass a new --study-name."
        )
    fail_stale_trials(study, storage)
    return study


def measured_configs(study: optuna.Study) -> dict[str, FrozenTrial]:
    """Complete trials that ran their configuration to a verdict, by configuration (JSON): a
    repeated configuration reuses their result."""
    return {
        json.dumps(t.user_attrs[TrialAttr.CONFIG], sort_keys=True): t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if TrialAttr.CONFIG in t.user_attrs and t.user_attrs.get(TrialAttr.STATUS) in MEASURED_STATUSES
    }


def check_space(s: TuneSettings, space: SearchSpace) -> None:
    """A continued study keeps its search space: flags that would change it are an error."""
    problems = []
    if s.global_batch is not None and s.global_batch != space.global_batch:
        problems.append(f"--global-batch={s.global_batch} (the study searches global batch {space.global_batch})")
    if s.dtypes is not None and set(s.dtypes) - set(space.dtypes):
        problems.append(f"--dtypes={','.join(s.dtypes)} (the study searches {','.join(space.dtypes)})")
    compile_problem = space_problem(s, space)
    if compile_problem:
        problems.append(compile_problem)
    if problems:
        raise UsageError(
            f"--study-name={s.study_name!r} exists with another search space: {'; '.join(problems)}; "
            "run with the original settings to continue it, or pass a new --study-name."
        )


def counts(t: FrozenTrial) -> bool:
    """Whether a trial counts towards ``--trials`` (interrupted, stale, surplus and predicted ones
    do not: they are run again, or cost nothing)."""
    status = t.user_attrs.get(TrialAttr.STATUS)
    if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return status != Status.PREDICTED_OOM
    if t.state == TrialState.FAIL:
        return status not in NOT_COUNTED
    return t.state == TrialState.RUNNING


def counted_trials(study: optuna.Study) -> int:
    """Finished trials (interrupted, stale or surplus ones excluded: they are retried) plus running ones."""
    return sum(1 for t in study.get_trials(deepcopy=False) if counts(t))
