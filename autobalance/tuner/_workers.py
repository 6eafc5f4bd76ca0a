"""Several tuner processes on one study: one baseline, stale trials, no trial beyond the total.

Any number of ``autobalance tune`` processes may work on one study (same ``--storage`` and
``--study-name``), on one host or many. What keeps them consistent:

* **One baseline.** The baseline trial measures the script's own configuration and defines the
  search space. The first worker takes a claim (a row in Optuna's ``study_system_attributes``
  whose unique key makes the insert atomic on SQLite and PostgreSQL alike) and runs it; the others
  wait until it is recorded. A claim whose owner stops refreshing it (killed) is taken over.
* **Stale trials.** A RUNNING trial whose heartbeat stopped (its tuner was killed) is marked
  FAIL with status ``stale`` and is not counted, so the study runs another trial in its place.
* **One launch per configuration.** A worker launches a configuration only under its claim (a row
  per configuration, :class:`RunningClaim`, atomic like the baseline's); a worker that finds another
  worker's trial holding it waits for that trial and reuses its result. A claim whose trial is no
  longer running (finished, or failed as stale when its tuner died) is taken over.
* **No surplus.** Two workers may ask for the last trial at the same moment. Trial numbers are
  unique and increasing, so a trial that finds ``--trials`` counted trials numbered before it
  is failed at once with status ``surplus`` (not counted, nothing launched).
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
from typing import Any

import optuna
from optuna.trial import TrialState

from autobalance.protocol import Status, StudyAttr, TrialAttr
from autobalance.store import (
    heartbeat_table,
    stale_trial_ids,
    study_id,
    study_system_attr_table,
    trial_id,
)

__all__ = ["CLAIM_KEY", "NOT_COUNTED", "BaselineClaim", "RunningClaim", "fail_stale_trials", "worker_id"]

CLAIM_KEY = StudyAttr.BASELINE_CLAIM
NOT_COUNTED = (None, Status.INTERRUPTED, Status.STALE, Status.SURPLUS)
"""Statuses of FAIL trials that do not count towards ``--trials`` (they are run again)."""


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class BaselineClaim:
    """Who runs the baseline of a study: an atomic claim in the study's system attributes."""

    def __init__(self, storage: optuna.storages.RDBStorage, study_id: int, *, owner: str,
                 stale_after_s: float) -> None:
        self.storage = storage
        self.study_id = study_id
        self.owner = owner
        self.stale_after_s = stale_after_s
        self._value: str | None = None

    def _row(self) -> str | None:
        from sqlalchemy import select

        table = study_system_attr_table()
        with self.storage.engine.connect() as conn:
            row = conn.execute(
                select(table.c.value_json).where(table.c.study_id == self.study_id, table.c.key == CLAIM_KEY)
            ).first()
        return None if row is None else str(row[0])

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
        from sqlalchemy import delete, insert
        from sqlalchemy.exc import IntegrityError

        table = study_system_attr_table()
        raw = self._row()
        if raw is not None:
            current = self.holder() or {}
            if current.get("owner") == self.owner:
                return True
            if not self._stale(current):
                return False
            with self.storage.engine.begin() as conn:  # compare-and-delete: only that stale claim
                conn.execute(delete(table).where(table.c.study_id == self.study_id, table.c.key == CLAIM_KEY,
                                                 table.c.value_json == raw))
        value = json.dumps({"owner": self.owner, "at": time.time()})
        try:
            with self.storage.engine.begin() as conn:
                conn.execute(insert(table).values(study_id=self.study_id, key=CLAIM_KEY, value_json=value))
        except IntegrityError:
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
            done = conn.execute(update(table).where(
                table.c.study_id == self.study_id, table.c.key == CLAIM_KEY, table.c.value_json == self._value,
            ).values(value_json=value)).rowcount
        if done:
            self._value = value

    def release(self) -> None:
        from sqlalchemy import delete

        if self._value is None:
            return
        table = study_system_attr_table()
        with contextlib.suppress(Exception), self.storage.engine.begin() as conn:
            conn.execute(delete(table).where(table.c.study_id == self.study_id, table.c.key == CLAIM_KEY,
                                             table.c.value_json == self._value))
        self._value = None


class RunningClaim:
    """Which trial launches one configuration now (several workers on one study): a row in the
    study's system attributes keyed by the configuration, holding the trial's id. The insert is
    atomic (unique key, SQLite and PostgreSQL alike), so of two workers that propose the same
    configuration at once exactly one launches it. A claim whose trial is no longer RUNNING (recorded,
    or failed as stale: its tuner died and stopped its heartbeat) is taken over; the holder releases
    it once its trial is recorded."""

    def __init__(self, storage: optuna.storages.RDBStorage, study_id: int, *, config_json: str, trial_id: int) -> None:
        self.storage = storage
        self.study_id = study_id
        self.key = StudyAttr.RUNNING_CLAIM_PREFIX + hashlib.sha1(config_json.encode()).hexdigest()
        self.trial_id = trial_id
        self.held = False

    def _row(self) -> str | None:
        from sqlalchemy import select

        table = study_system_attr_table()
        with self.storage.engine.connect() as conn:
            row = conn.execute(select(table.c.value_json).where(table.c.study_id == self.study_id,
                                                                table.c.key == self.key)).first()
        return None if row is None else str(row[0])

    def try_acquire(self) -> int | None:
        """Take the claim: None when this trial holds it now, else the id of the trial that does."""
        from sqlalchemy import delete, insert
        from sqlalchemy.exc import IntegrityError

        table = study_system_attr_table()
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
            with self.storage.engine.begin() as conn:  # compare-and-delete: only that finished holder's claim
                conn.execute(delete(table).where(table.c.study_id == self.study_id, table.c.key == self.key,
                                                 table.c.value_json == raw))
        try:
            with self.storage.engine.begin() as conn:
                conn.execute(insert(table).values(study_id=self.study_id, key=self.key,
                                                  value_json=json.dumps(self.trial_id)))
        except IntegrityError:  # another worker claimed it between the read and the insert
            row = self._row()
            return int(json.loads(row)) if row is not None else self.try_acquire()
        self.held = True
        return None

    def release(self) -> None:
        from sqlalchemy import delete

        if not self.held:
            return
        table = study_system_attr_table()
        with contextlib.suppress(Exception), self.storage.engine.begin() as conn:
            conn.execute(delete(table).where(table.c.study_id == self.study_id, table.c.key == self.key,
                                             table.c.value_json == json.dumps(self.trial_id)))
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
        stale_ids = stale_trial_ids(storage, study_id(study, storage)) + _silent_trial_ids(study, storage, grace)
        for stale in stale_ids:
            try:
                storage.set_trial_user_attr(stale, TrialAttr.STATUS, Status.STALE)
                storage.set_trial_user_attr(
                    stale, "reason",
                    "its tuner stopped without finishing it (killed?): the heartbeat stopped; run again in its place",
                )
                if storage.set_trial_state_values(stale, state=TrialState.FAIL):
                    failed.append(storage.get_trial_number_from_id(stale))
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another worker failed it first
    return failed
