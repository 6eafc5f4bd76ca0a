"""Recording a trial in the study: its attributes, its memory chart (an Optuna artifact), its
constraint values and the tell - for a measured trial, a reused result, a prediction, and the
trials that end without a measurement (surplus, interrupted, tuner failure)."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance.launcher import TrialOutcome
from autobalance.protocol import (
    CONSTRAINTS_KEY,
    MEASURED_STATUSES,
    TOLD_STATUSES,
    Status,
    StudyAttr,
    TrialAttr,
)
from autobalance.store import mask_url, storage_of, trial_id
from autobalance.tuner._reporter import trial_outcome, write_notes
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner._study import counts, measured_configs
from autobalance.tuner._summary import measurement_attrs
from autobalance.tuner._time_spent import trial_time_split
from autobalance.tuner.search import (
    TrialFigures,
    compile_env,
    figures_from_outcome,
    fix_exchange_rate,
    penalised,
    rate_source,
)

__all__ = ["INTERRUPTED_REASON", "Recorder", "constraints", "feasible"]

INTERRUPTED_REASON = "the tuner was interrupted (Ctrl-C or SIGTERM); the trial's processes were killed"


def constraints(figures: TrialFigures, settings: TuneSettings) -> list[float]:
    """A told trial's constraints (each <= 0 when met): its memory against the usable memory, and
    with ``--max-spread-gib`` its spread against that limit (an unmeasured trial violates it: every
    trial has the same keys, as ``GPSampler`` requires)."""
    out = [figures.memory_constraint(settings.headroom)]
    if settings.max_spread_gib is not None:
        spread = figures.spread_bytes() if figures.measured else None
        out.append(1.0 if spread is None else spread / 2**30 - settings.max_spread_gib)
    return out


def feasible(figures: TrialFigures, settings: TuneSettings, status: str) -> bool:
    """Whether a trial with these figures is feasible (``protocol.is_feasible`` of a recorded
    trial): measured to the end and within every :func:`constraints`."""
    return status == Status.OK and figures.measured and all(c <= 0 for c in constraints(figures, settings))


def _fail(study: optuna.Study, trial: optuna.Trial, status: Status, reason: str,
          attrs: dict[str, Any] | None = None) -> None:
    for key, value in {TrialAttr.STATUS: status, TrialAttr.REASON: reason, **(attrs or {})}.items():
        trial.set_user_attr(key, value)
    study.tell(trial, state=TrialState.FAIL)


class Recorder:
    """Tells the study what became of each trial; keeps the measured configurations for reuse."""

    def __init__(self, *, settings: TuneSettings, storage: optuna.storages.RDBStorage) -> None:
        self.settings = settings
        self.storage = storage
        self.measured: dict[str, FrozenTrial] = {}  # trials measured to a verdict, by configuration
        self.launched_here: list[int] = []  # the trials this tuner launched, the baseline included

    def load(self, study: optuna.Study) -> None:
        self.measured = measured_configs(study)

    def seen(self, config: BalanceConfig) -> FrozenTrial | None:  # the trial that measured ``config`` already
        return self.measured.get(config.to_json())

    # ------------------------------------------------------------------ a launched trial
    def figures(self, study: optuna.Study, outcome: TrialOutcome) -> TrialFigures:
        """The trial's figures from its ranks' reports, built once per outcome."""
        s, cap = self.settings, study.user_attrs.get(StudyAttr.CAPACITY)
        return figures_from_outcome(outcome, world_size=s.world_size, caps=s.caps_bytes(),
                                    fallback_capacity=[float(c) for c in cap] if cap else None)

    def record(self, study: optuna.Study, trial: optuna.Trial, config: BalanceConfig, outcome: TrialOutcome,
               *, baseline: bool = False, figures: TrialFigures | None = None) -> FrozenTrial:
        """``figures``: :meth:`figures` of ``outcome`` when the caller built them already."""
        s = self.settings
        figures = figures or self.figures(study, outcome)
        attrs: dict[str, Any] = {
            **figures.user_attrs(s.headroom),
            TrialAttr.STATUS: outcome.status,
            TrialAttr.REASON: outcome.reason,
            TrialAttr.CONFIG: config.to_dict(),
            TrialAttr.SPLIT: config.split_text(),  # shown as is by the dashboard: rank 0: 6,6,5,5,5,5
            TrialAttr.BASELINE: baseline,
            TrialAttr.WALL_S: round(outcome.wall_s, 3),
            TrialAttr.TRIAL_DIR: outcome.trial_dir,
            TrialAttr.TIME_SPLIT: trial_time_split(outcome),  # launch to first step, compiling, steps, ...
        }
        if outcome.traceback:
            attrs[TrialAttr.ERROR_TAIL] = outcome.traceback[-1500:]
        if outcome.failing_rank is not None:
            attrs[TrialAttr.FAILING_RANK] = outcome.failing_rank
        dropout = [d for rep in outcome.reports.values() if isinstance(d := (rep.model or {}).get("dropout_modules"), int)]
        if dropout:  # verification launches its dropout runs only for a model with dropout (search/_timing.py)
            attrs[TrialAttr.DROPOUT_MODULES] = max(dropout)
        if outcome.pool_start_s > 0.05:
            attrs[TrialAttr.POOL_START_S] = round(outcome.pool_start_s, 3)
        # compile-step and steady peaks, the steps' spread, a warm trial's carry-over (tuner/_summary.py)
        attrs.update(measurement_attrs(outcome, world_size=s.world_size))
        try:  # per-rank memory chart as a trial artifact; Optuna accepts artifacts only before tell
            from autobalance.report import artifact_dir_for, upload_trial_chart

            upload_trial_chart(study, trial, artifact_dir_for(s.storage), attrs=attrs)
        except Exception as exc:
            warnings.warn(f"autobalance: trial {trial.number}'s memory chart was not stored ({exc})", stacklevel=2)
        self.launched_here.append(trial.number)
        return self.tell(study, trial, figures, attrs, outcome.status)

    def tell(self, study: optuna.Study, trial: optuna.Trial, figures: TrialFigures, attrs: dict[str, Any],
             status: Status) -> FrozenTrial:
        """Set the attributes, then tell: objective values and constraints, pruned, or failed."""
        s = self.settings
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        if status == Status.PRUNED:
            return study.tell(trial, state=TrialState.PRUNED)
        if status in TOLD_STATUSES:
            reference = study.user_attrs.get(StudyAttr.REFERENCE)
            if figures.measured and reference is None:  # the baseline's step, a reference run's, else the first
                reference = float(figures.step_time_s)  # type: ignore[arg-type]
                fix_exchange_rate(study, reference_step_s=reference, source=rate_source(trial.user_attrs),
                                  trial=trial.number, weight_spread=s.weight_spread, weight_time=s.weight_time,
                                  world_size=s.world_size, capacity_bytes=figures.capacity)
            met = constraints(figures, s)
            fits = all(c <= 0 for c in met) and status == Status.OK
            trial.set_user_attr(TrialAttr.FEASIBLE, fits)
            trial.set_user_attr(TrialAttr.OUTCOME, trial_outcome({**attrs, TrialAttr.FEASIBLE: fits}))
            self.storage.set_trial_system_attr(trial_id(trial), CONSTRAINTS_KEY, met)
            values = penalised(figures.values(reference_step_s=reference, weight_spread=s.weight_spread,
                                              weight_time=s.weight_time, multi_objective=s.multi_objective),
                               met, feasible=fits, weight_spread=s.weight_spread,
                               weight_time=s.weight_time, multi_objective=s.multi_objective)
            frozen = study.tell(trial, values)
        else:
            trial.set_user_attr(TrialAttr.OUTCOME,
                                trial_outcome({**attrs, TrialAttr.STATUS: status, TrialAttr.FEASIBLE: False}))
            frozen = study.tell(trial, state=TrialState.FAIL)
        write_notes(study)
        if TrialAttr.CONFIG in attrs and status in MEASURED_STATUSES:
            self.measured[json.dumps(attrs[TrialAttr.CONFIG], sort_keys=True)] = frozen
        return frozen

    # ------------------------------------------------------------------ trials that launch nothing
    def reuse(self, study: optuna.Study, trial: optuna.Trial, seen: FrozenTrial) -> FrozenTrial:
        """A configuration measured before: copy its result."""
        for key, value in seen.user_attrs.items():
            if key not in (TrialAttr.BASELINE, TrialAttr.TIME_SPLIT):  # its time was spent by the trial it reuses
                trial.set_user_attr(key, value)
        trial.set_user_attr(TrialAttr.BASELINE, False)
        trial.set_user_attr(TrialAttr.REUSED_FROM, seen.number)
        trial.set_user_attr(TrialAttr.OUTCOME, trial_outcome({**seen.user_attrs, TrialAttr.REUSED_FROM: seen.number}))
        self.storage.set_trial_system_attr(trial_id(trial), CONSTRAINTS_KEY,
                                           list(seen.system_attrs.get(CONSTRAINTS_KEY, [1.0])))
        return study.tell(trial, list(seen.values))

    def predicted(self, study: optuna.Study, trial: optuna.Trial, config: BalanceConfig,
                  prediction: tuple[TrialFigures, dict[str, Any]]) -> FrozenTrial:
        """A configuration the models say cannot fit: recorded as infeasible without launching."""
        figures, attrs = prediction
        attrs = {**attrs, TrialAttr.CONFIG: config.to_dict(), TrialAttr.SPLIT: config.split_text()}
        return self.tell(study, trial, figures, attrs, Status.PREDICTED_OOM)

    def surplus(self, study: optuna.Study, trial: optuna.Trial) -> bool:
        """Another worker asked for the last trial at the same moment: fail this one (not counted)."""
        total = self.settings.trials
        counted = sum(1 for t in study.get_trials(deepcopy=False) if t.number < trial.number and counts(t))
        if counted < total:
            return False
        _fail(study, trial, Status.SURPLUS, f"{total} trials were already counted when it was asked (another "
                                            "worker took the last one); nothing was launched")
        return True

    def not_started(self, study: optuna.Study, trial: optuna.Trial, config: BalanceConfig, reason: str) -> None:
        """A proposal the time budget cannot hold with verification after it: failed, not counted
        (status ``surplus``: nothing launched), the loop stops asking."""
        _fail(study, trial, Status.SURPLUS, reason, {TrialAttr.CONFIG: config.to_dict()})

    def interrupted(self, study: optuna.Study, trial: optuna.Trial, config: BalanceConfig, exc: BaseException) -> None:
        """Ctrl-C (or another slot's failure) killed the trial: failed, run again on the next start."""
        partial: TrialOutcome | None = getattr(exc, "outcome", None)
        attrs: dict[str, Any] = {TrialAttr.CONFIG: config.to_dict()}
        if partial is not None:
            attrs[TrialAttr.TRIAL_DIR] = partial.trial_dir
        _fail(study, trial, Status.INTERRUPTED, INTERRUPTED_REASON, attrs)

    def unfinished(self, study: optuna.Study, trial: optuna.Trial, exc: BaseException) -> None:
        """Whatever stopped the tuner during a trial (Ctrl-C, a storage or launcher error), the trial
        must not stay RUNNING: record why (an interrupted one is run again on the next start)."""
        if storage_of(study).get_trial(trial_id(trial)).state != TrialState.RUNNING:
            return
        if isinstance(exc, KeyboardInterrupt):
            _fail(study, trial, Status.INTERRUPTED, INTERRUPTED_REASON)
        else:
            why = f"the tuner failed: {type(exc).__name__}: {mask_url(str(exc))[:250]}"
            _fail(study, trial, Status.CRASH, why)

    def launch_settings(self, study: optuna.Study, *, cold: bool) -> None:
        """How this run starts the script (once it is accepted): what ``promote`` verifies with."""
        s = self.settings
        if s.nnodes == 1:
            study.set_user_attr(StudyAttr.LAUNCH, {
                "script": os.path.abspath(s.script), "script_args": list(s.script_args),
                "nproc_per_node": s.nproc_per_node, "device": s.device, "torchrun_args": list(s.torchrun_args),
                "runs_dir": os.path.abspath(s.runs_dir), "trial_timeout": s.trial_timeout, "cold": cold,
                "compile_env": compile_env(s)})
