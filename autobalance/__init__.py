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


def plan(
    *,
    micro_batch: int = 1,
    accumulation: int = 1,
    dtype: str = "fp32",
    checkpoint: int | list[int] | None = None,
    bucket_cap_mb: float = 25.0,
    gradient_as_bucket_view: bool = False,
    global_batch: int | None = None,
    config: BalanceConfig | dict[str, Any] | str | None = None,
    config_file: str | None = None,
    study: str | None = None,
    storage: str | None = None,
    on_mismatch: str = "warn",
    device: str | None = None,
    memory_cap_gib: float | None = None,
    blocks: str | None = None,
    seed: int = 0,
) -> Plan:
    """The configuration for this run; see :func:`autobalance.runtime.plan` (the same parameters:
    tests/test_public_api.py keeps the two signatures equal; this one imports torch only when called)."""
    from autobalance.runtime import plan as _plan

    return _plan(
        micro_batch=micro_batch, accumulation=accumulation, dtype=dtype, checkpoint=checkpoint,
        bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view, global_batch=global_batch,
        config=config, config_file=config_file, study=study, storage=storage, on_mismatch=on_mismatch,
        device=device, memory_cap_gib=memory_cap_gib, blocks=blocks, seed=seed,
    )


def __getattr__(name: str) -> Any:
    if name == "Plan":
        from autobalance.runtime import Plan

        return Plan
    raise AttributeError(f"module 'autobalance' has no attribute {name!r}")
