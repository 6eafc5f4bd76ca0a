"""The one place autobalance reaches past Optuna's public API (and optuna-dashboard's).

Every other module calls these functions; ``tests/test_optuna_access.py`` fails when a private
Optuna name appears anywhere else in the package, so an Optuna upgrade that moves one of them
breaks here, in one file. Where a public API exists it is used; each remaining private access says
why it stays:

- :func:`trial_id`: ``Trial._trial_id`` / ``FrozenTrial._trial_id``. The storage's own methods
  (heartbeats, system attributes, ``get_trial``) take the trial id, and Optuna exposes no public
  accessor; the public route (``storage.get_trial_id_from_study_id_trial_number``) costs a database
  query per trial, and the tuner reads the id of every running trial each time it waits.
- :func:`storage_of`: ``Study._storage``. A study has no public storage attribute (a live
  ``optuna.Trial`` has the public ``trial.storage``); ``upload_artifact`` needs it for a
  ``FrozenTrial``, and reading one trial's state through it avoids loading every trial of the study.
- :func:`study_id`: public (``storage.get_study_id_from_name``).
- :func:`stale_trial_ids`: ``RDBStorage._get_stale_trial_ids``. The public
  ``optuna.storages.fail_stale_trials`` fails those trials itself, without the ``stale`` status and
  reason autobalance records and without saying which trials it failed.
- :func:`study_system_attr_table`, :func:`heartbeat_table`: ``optuna.storages._rdb.models``. The
  baseline claim needs an atomic insert on the unique key of the study's system attributes, and
  finding trials that never beat needs the heartbeat table: Optuna's schema has no public API.
- :func:`dashboard_notes`: ``optuna_dashboard._note``, the functions that read and write the notes
  optuna-dashboard shows (it has no public note API).

Importing this module imports neither optuna nor sqlalchemy.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "dashboard_notes",
    "heartbeat_table",
    "stale_trial_ids",
    "storage_of",
    "study_id",
    "study_system_attr_table",
    "trial_id",
]


def trial_id(trial: Any) -> int:
    """The storage's id of an ``optuna.Trial`` or ``FrozenTrial`` (not its ``number``)."""
    return int(trial._trial_id)


def storage_of(study: Any) -> Any:
    """The Optuna storage of an ``optuna.Study``."""
    return study._storage


def study_id(study: Any, storage: Any = None) -> int:
    """The storage's id of a study (an ``optuna.Study``, or a ``FrozenStudy`` with its ``storage``)."""
    return int((storage if storage is not None else storage_of(study)).get_study_id_from_name(study.study_name))


def stale_trial_ids(storage: Any, study_id: int) -> list[int]:
    """RUNNING trials of the study whose heartbeat stopped longer than the storage's grace period ago."""
    return list(storage._get_stale_trial_ids(study_id))


def study_system_attr_table() -> Any:
    """Optuna's ``study_system_attributes`` table (SQLAlchemy ``Table``)."""
    from optuna.storages._rdb import models

    return models.StudySystemAttributeModel.__table__


def heartbeat_table() -> Any:
    """Optuna's ``trial_heartbeats`` table (SQLAlchemy ``Table``)."""
    from optuna.storages._rdb import models

    return models.TrialHeartbeatModel.__table__


def dashboard_notes() -> tuple[Any, Any, Any]:
    """optuna-dashboard's ``(get_note_from_system_attrs, note_ver_key, save_note_with_version)``;
    raises ImportError without optuna-dashboard."""
    from optuna_dashboard._note import (
        get_note_from_system_attrs,
        note_ver_key,
        save_note_with_version,
    )

    return get_note_from_system_attrs, note_ver_key, save_note_with_version
