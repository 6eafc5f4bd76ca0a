"""The store: best configurations saved in the study's database, export files, production loading.

Tables are ``autobalance_*`` (SQLAlchemy 2 ORM) beside Optuna's, in any SQLAlchemy database
(default ``sqlite:///autobalance.db``; PostgreSQL for shared studies). Configurations are stored
as validated JSON, never pickled. Importing this package does not import torch.
"""

from __future__ import annotations

from autobalance.store._file import export_file, read_export_file
from autobalance.store._fingerprint import (
    CAPACITY_TOLERANCE,
    DEVICE_TYPES,
    HardwareFingerprint,
    cap_lifted_note,
    current_fingerprint,
    differences,
    minor_differences,
    rank_order,
    rank_order_line,
)
from autobalance.store._models import SCHEMA_VERSION, TABLE_PREFIX
from autobalance.store._optuna_access import (
    dashboard_notes,
    heartbeat_table,
    stale_trial_ids,
    storage_of,
    study_id,
    study_system_attr_table,
    trial_id,
)
from autobalance.store._production import (
    MISMATCH_POLICIES,
    HardwareMismatchWarning,
    check_compatibility,
    load_saved_config,
    ranks_differ,
    script_sha256,
)
from autobalance.store._saved import EXPORT_FORMAT, EXPORT_FORMAT_VERSION, SavedConfig
from autobalance.store._store import ConfigStore, make_saved_by
from autobalance.store._studies import (
    HEARTBEAT_ENV,
    HEARTBEAT_INTERVAL_S,
    heartbeat_interval_s,
    list_studies,
    load_study,
    open_storage,
)
from autobalance.store._url import (
    DEFAULT_STORAGE,
    check_storage,
    engine_kwargs,
    make_engine,
    mask_url,
    normalize_storage_url,
)

__all__ = [
    "CAPACITY_TOLERANCE",
    "DEFAULT_STORAGE",
    "DEVICE_TYPES",
    "EXPORT_FORMAT",
    "EXPORT_FORMAT_VERSION",
    "HEARTBEAT_ENV",
    "HEARTBEAT_INTERVAL_S",
    "MISMATCH_POLICIES",
    "SCHEMA_VERSION",
    "TABLE_PREFIX",
    "ConfigStore",
    "HardwareFingerprint",
    "HardwareMismatchWarning",
    "SavedConfig",
    "cap_lifted_note",
    "check_compatibility",
    "check_storage",
    "current_fingerprint",
    "dashboard_notes",
    "differences",
    "engine_kwargs",
    "export_file",
    "heartbeat_interval_s",
    "heartbeat_table",
    "list_studies",
    "load_saved_config",
    "load_study",
    "make_engine",
    "make_saved_by",
    "mask_url",
    "minor_differences",
    "normalize_storage_url",
    "open_storage",
    "rank_order",
    "rank_order_line",
    "ranks_differ",
    "read_export_file",
    "script_sha256",
    "stale_trial_ids",
    "storage_of",
    "study_id",
    "study_system_attr_table",
    "trial_id",
]
