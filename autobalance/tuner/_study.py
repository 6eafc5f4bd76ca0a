"""The study: the sampler, opening (or continuing) a study with the same objective and search space, and which
trials count towards ``--trials``.

**Workers.** Any number of ``autobalance tune`` processes may work on one study (same ``--storage`` and
``--study-name``, one host or many; ``docs/reliability.md``, section 6): one baseline (:class:`BaselineClaim`; a
claim whose owner stops refreshing it is taken over), stale trials failed and run again
(:func:`fail_stale_trials`), no trial beyond the total (``surplus``), and one launch per configuration
(:class:`RunningClaim`: a worker that finds another worker's trial holding it waits for that trial and reuses its
result; a claim whose trial is no longer running is taken over). A claim is a row of Optuna's
``study_system_attributes`` whose unique key makes its insert atomic on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import socket
import time
import uuid
import warnings
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._errors import UsageError
from autobalance.protocol import MEASURED_STATUSES, NOT_COUNTED, Status, StudyAttr, TrialAttr
from autobalance.store import (
    heartbeat_table,
    stale_trial_ids,
    study_id,
    study_system_attr_table,
    trial_id,
)
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner.search import SearchSpace, space_problem

__all__ = ["BaselineClaim", "RunningClaim", "check_space", "counted_trials", "counts", "fail_stale_trials",
           "measured_configs", "open_study", "worker_id"]


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
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True,
                                          n_startup_trials=min(10, max(3, n_trials // 4)))


def open_study(s: TuneSettings, storage: optuna.storages.RDBStorage) -> optuna.Study:
    """Create the study, or load it when its objective matches; stale trials of dead workers are failed."""
    directions: list[Any] = ["minimize", "minimize"] if s.multi_objective else ["minimize"]
    study = optuna.create_study(study_name=s.study_name, storage=storage, directions=directions,
                                sampler=make_sampler(s, n_trials=s.trials), load_if_exists=True)
    if [d.name.lower() for d in study.directions] != directions:
        mode = "--multi-objective" if s.multi_objective else "single objective"
        raise UsageError(f"--study-name={s.study_name!r} exists with {len(study.directions)} objective(s) but this run "
                         f"asks for {len(directions)} ({mode}); use the same setting or a new --study-name.")
    objective = {"weight_spread": s.weight_spread, "weight_time": s.weight_time, "headroom": s.headroom,
                 "multi_objective": s.multi_objective, "caps_bytes": s.caps_bytes(), "device": s.device,
                 "world_size": s.world_size, "nnodes": s.nnodes, "cap_mode": s.cap_mode,
                 "max_spread_gib": s.max_spread_gib}  # what a continued study must keep
    stored = study.user_attrs.get(StudyAttr.OBJECTIVE)
    if stored is None:
        study.set_user_attr(StudyAttr.OBJECTIVE, objective)
        names = ["spread_frac", "step_time_norm"] if s.multi_objective else ["spread_plus_time"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            study.set_metric_names(names)
    elif stored != objective:
        diff = sorted(k for k in objective if stored.get(k) != objective[k])
        raise UsageError(f"--study-name={s.study_name!r} exists with another search space/objective (differs in: "
                         f"{', '.join(diff)}); run with the original settings to continue it, or pass a new "
                         "--study-name.")
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
    if compile_problem := space_problem(s, space):
        problems.append(compile_problem)
    if problems:
        raise UsageError(f"--study-name={s.study_name!r} exists with another search space: {'; '.join(problems)}; "
                         "run with the original settings to continue it, or pass a new --study-name.")


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


# -------------------------------------------------------------------- several workers on one study

def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class _Claim:
    """A row of the study's system attributes under ``key``, inserted atomically (see above)."""

    def __init__(self, storage: optuna.storages.RDBStorage, study_id: int, key: str) -> None:
        self.storage = storage
        self.study_id = study_id
        self.key = key

    def _row(self) -> str | None:
        from sqlalchemy import select

        table = study_system_attr_table()
        with self.storage.engine.connect() as conn:
            row = conn.execute(select(table.c.value_json).where(table.c.study_id == self.study_id,
                                                                table.c.key == self.key)).first()
        return None if row is None else str(row[0])

    def _insert(self, value: str) -> bool:
        """Take the row; False when another worker holds it."""
        from sqlalchemy import insert
        from sqlalchemy.exc import IntegrityError

        try:
            with self.storage.engine.begin() as conn:
                table = study_system_attr_table()
                conn.execute(insert(table).values(study_id=self.study_id, key=self.key, value_json=value))
        except IntegrityError:
            return False
        return True

    def _delete(self, value: str) -> None:
        """Compare-and-delete: the row only while it holds ``value``."""
        from sqlalchemy import delete

        table = study_system_attr_table()
        with self.storage.engine.begin() as conn:
            conn.execute(delete(table).where(table.c.study_id == self.study_id, table.c.key == self.key,
                                             table.c.value_json == value))


class BaselineClaim(_Claim):
    """Who runs the baseline of a study (see the module docstring)."""

    def __init__(self, storage: optuna.storages.RDBStorage, study_id: int, *, owner: str, stale_after_s: float) -> None:
        super().__init__(storage, study_id, StudyAttr.BASELINE_CLAIM)
        self.owner = owner
        self.stale_after_s = stale_after_s
        self._value: str | None = None

    def holder(self) -> dict[str, Any] | None:
        raw = self._row()
        if raw is None:
            return None
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        return value if isinstance(value, dict) else {"owner": "?", "at": 0.0}

    def _stale(self, value: dict[str, Any]) -> bool:
        at = value.get("at")
        if not isinstance(at, (int, float)) or time.time() - at > self.stale_after_s:
            return True
        host, _, rest = str(value.get("owner", "")).partition(":")
        pid = rest.partition(":")[0]
        # an owner on this host whose process is gone (killed) need not be waited for
        return host == socket.gethostname() and pid.isdigit() and not os.path.exists(f"/proc/{pid}")

    def try_acquire(self) -> bool:
        """Take the claim (or a stale one); True when this worker now owns it."""
        raw = self._row()
        if raw is not None:
            current = self.holder() or {}
            if current.get("owner") == self.owner:
                return True
            if not self._stale(current):
                return False
            self._delete(raw)
        value = json.dumps({"owner": self.owner, "at": time.time()})
        if not self._insert(value):
            return False
        self._value = value
        return True

    def refresh(self) -> None:
        """Keep the claim fresh while the baseline runs (compare-and-set: never steal it back)."""
        from sqlalchemy import update

        if self._value is None:
            return
        table = study_system_attr_table()
        value = json.dumps({"owner": self.owner, "at": time.time()})
        with self.storage.engine.begin() as conn:
            done = conn.execute(update(table).where(table.c.study_id == self.study_id, table.c.key == self.key,
                                                    table.c.value_json == self._value)
                                .values(value_json=value)).rowcount
        if done:
            self._value = value

    def release(self) -> None:
        if self._value is not None:
            with contextlib.suppress(Exception):
                self._delete(self._value)
            self._value = None


class RunningClaim(_Claim):
    """Which trial launches one configuration now (see the module docstring): a row keyed by the
    configuration, holding the trial's id; the holder releases it once its trial is recorded."""

    def __init__(self, storage: optuna.storages.RDBStorage, study_id: int, *, config_json: str, trial_id: int) -> None:
        key = StudyAttr.RUNNING_CLAIM_PREFIX + hashlib.sha1(config_json.encode()).hexdigest()
        super().__init__(storage, study_id, key)
        self.trial_id = trial_id
        self.held = False

    def try_acquire(self) -> int | None:
        """Take the claim: None when this trial holds it now, else the id of the trial that does."""
        raw = self._row()
        if raw is not None:
            holder = json.loads(raw)
            if holder == self.trial_id:
                self.held = True
                return None
            try:
                running = self.storage.get_trial(int(holder)).state == TrialState.RUNNING
            except (KeyError, ValueError, TypeError):
                running = False
            if running:
                return int(holder)
            self._delete(raw)  # only that finished holder's claim
        if not self._insert(json.dumps(self.trial_id)):  # another worker claimed it since the read
            row = self._row()
            return int(json.loads(row)) if row is not None else self.try_acquire()
        self.held = True
        return None

    def release(self) -> None:
        if self.held:
            with contextlib.suppress(Exception):
                self._delete(json.dumps(self.trial_id))
            self.held = False


def _silent_trial_ids(study: optuna.Study, storage: optuna.storages.RDBStorage, grace_s: float) -> list[int]:
    """RUNNING trials that never sent a heartbeat and started more than ``grace_s`` ago (their tuner
    died between asking for the trial and starting it); Optuna's own check skips them forever."""
    from sqlalchemy import select

    old = datetime.datetime.now() - datetime.timedelta(seconds=grace_s)
    running = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
               if t.datetime_start is not None and t.datetime_start < old]
    if not running:
        return []
    ids = [trial_id(t) for t in running]
    table = heartbeat_table()
    with storage.engine.connect() as conn:
        beating = {row[0] for row in conn.execute(select(table.c.trial_id).where(table.c.trial_id.in_(ids)))}
    return [i for i in ids if i not in beating]


def fail_stale_trials(study: optuna.Study, storage: optuna.storages.RDBStorage) -> list[int]:
    """Fail RUNNING trials whose heartbeat stopped (their tuner died), marked ``stale``; returns their numbers."""
    if storage.heartbeat_interval is None:
        return []
    failed: list[int] = []
    with contextlib.suppress(Exception):
        grace = storage.grace_period or 2 * storage.heartbeat_interval
        for stale in stale_trial_ids(storage, study_id(study, storage)) + _silent_trial_ids(study, storage, grace):
            try:
                storage.set_trial_user_attr(stale, TrialAttr.STATUS, Status.STALE)
                storage.set_trial_user_attr(stale, "reason", "its tuner stopped without finishing it (killed?): "
                                            "the heartbeat stopped; run again in its place")
                if storage.set_trial_state_values(stale, state=TrialState.FAIL):
                    failed.append(storage.get_trial_number_from_id(stale))
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another worker failed it first
    return failed
