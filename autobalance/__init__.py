"""autobalance: even GPU memory and fast steps for data-parallel training.

Training scripts use :func:`plan`; the tuner lives behind the ``autobalance`` command.
Heavy modules (torch, optuna, sqlalchemy) are imported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autobalance._config import DTYPES, BalanceConfig, micro_step_sizes, split_evenly
from autobalance._errors import (
    AutobalanceError,
    ConfigError,
    HardwareMismatchError,
    LaunchError,
    SchemaVersionError,
    StorageError,
    StorageURLError,
    StudyNotFoundError,
    TrialScriptError,
    UsageError,
    VerificationError,
)

if TYPE_CHECKING:
    from autobalance.runtime import Plan

__version__ = "0.1.0"

__all__ = [
    "DTYPES",
    "AutobalanceError",
    "BalanceConfig",
    "ConfigError",
    "HardwareMismatchError",
    "LaunchError",
    "Plan",
    "SchemaVersionError",
    "StorageError",
    "StorageURLError",
    "StudyNotFoundError",
    "TrialScriptError",
    "UsageError",
    "VerificationError",
    "micro_step_sizes",
    "plan",
    "split_evenly",
]


def plan(**kwargs: Any) -> Plan:
    """The configuration for this run; see :func:`autobalance.runtime.plan`."""
    from autobalance.runtime import plan as _plan

    return _plan(**kwargs)


def __getattr__(name: str) -> Any:
    if name == "Plan":
        from autobalance.runtime import Plan

        return Plan
    raise AttributeError(f"module 'autobalance' has no attribute {name!r}")
