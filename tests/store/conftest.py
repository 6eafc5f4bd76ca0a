"""Fixtures of the store tests: SQLite files, a PostgreSQL schema per test, sample data."""

from __future__ import annotations

import dataclasses
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # store_workers must be importable in spawned processes
    sys.path.insert(0, str(HERE))

from autobalance import BalanceConfig  # noqa: E402
from autobalance.store import HardwareFingerprint, mask_url  # noqa: E402
from tests.pg_helpers import throwaway_schema  # noqa: E402
from tests.services import service_missing  # noqa: E402

POSTGRES_ENV = "AUTOBALANCE_TEST_POSTGRES_URL"
POSTGRES_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"

GIB = 1024**3


def full_config() -> BalanceConfig:
    """A configuration where every field differs from its default."""
    return BalanceConfig(
        micro_batches=[3, 5, 2],
        accumulation=3,
        global_batch=30,
        checkpoint=[[0, 2], [], [1]],
        dtype="fp16",
        bucket_cap_mb=12.5,
        gradient_as_bucket_view=True,
        optimizer_sharding="zero1",
        optimizer_shares=[0.25, 0.5, 0.25],
    )


def full_compiled_config() -> BalanceConfig:
    """The compiled counterpart: compile and per-rank budgets set (checkpointing excludes them), and
    micro-steps that differ by one (``rank_samples``: 3,3,2 / 5,5,4 / 3,3,2)."""
    return dataclasses.replace(full_config(), checkpoint=[[], [], []], compile="max-autotune-no-cudagraphs",
                               compile_scope="regional", activation_budget=[0.45, 0.8, 1.0], rank_samples=[8, 14, 8],
                               micro_batches=[3, 5, 3])


def full_sharded_config() -> BalanceConfig:
    """The parameter-sharded counterpart (sharding excludes fp16 and ZeRO-1): FSDP2 on the blocks, their
    gathered weights and the embeddings' kept through the backward, the same micro-steps on every rank."""
    return BalanceConfig(micro_batches=[3, 5, 2], accumulation=3, global_batch=30, checkpoint=[[0, 2], [], [1]],
                         dtype="bf16", param_sharding="blocks", keep_gathered=["embeddings", "blocks"])


def make_fingerprint(**overrides: Any) -> HardwareFingerprint:
    world = overrides.pop("world_size", 3)
    data: dict[str, Any] = {
        "device_type": "cuda",
        "device_name": "NVIDIA H200",
        "capacity_bytes": [140 * GIB] * world,
        "cap_bytes": [None, 40 * GIB, None][:world] + [None] * max(0, world - 3),
        "world_size": world,
        "nnodes": 1,
        "torch_version": "2.6.0+cu124",
        "cuda_version": "12.4",
    }
    data.update(overrides)
    return HardwareFingerprint(**data)


FIGURES: dict[str, Any] = {
    "peak_bytes": [10 * GIB, 12 * GIB, 9 * GIB],
    "spread": 0.14,
    "step_time_s": 0.231,
    "baseline": {"peak_bytes": [20 * GIB, 8 * GIB, 8 * GIB], "step_time_s": 0.3},
}


@pytest.fixture
def fingerprint() -> HardwareFingerprint:
    return make_fingerprint()


@pytest.fixture
def config() -> BalanceConfig:
    return full_config()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
def study_name() -> str:
    return f"study-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def save_kwargs(
    config: BalanceConfig, fingerprint: HardwareFingerprint
) -> Callable[..., dict[str, Any]]:
    def make(**overrides: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "study_name": "s",
            "trial_number": 7,
            "config": config,
            "figures": FIGURES,
            "fingerprint": fingerprint,
            "script_sha256": "a" * 64,
            "saved_by": "alice@node1 (tune)",
        }
        kwargs.update(overrides)
        return kwargs

    return make


def _postgres_base_url() -> str:
    return os.environ.get(POSTGRES_ENV) or POSTGRES_DEFAULT


@pytest.fixture(scope="session")
def postgres_server() -> str:
    """The PostgreSQL URL under test; skips (with the masked URL as reason) when no server answers."""
    from sqlalchemy import create_engine, text

    from autobalance._errors import StorageError
    from autobalance.store import normalize_storage_url

    raw = _postgres_base_url()
    try:
        url = normalize_storage_url(raw)
    except StorageError as exc:
        service_missing(f"PostgreSQL tests skipped: {exc}")
    engine = create_engine(url, connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        first = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        service_missing(
            f"PostgreSQL tests skipped: no server answers at {mask_url(url)} ({first}); "
            f"set {POSTGRES_ENV} to a reachable server."
        )
    finally:
        engine.dispose()
    return url


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A URL whose tables live in a fresh schema of their own, dropped after the test.

    Nothing outside that schema (Optuna's tables, other tests' data) is touched.
    """
    with throwaway_schema(postgres_server, prefix="autobalance_test") as url:
        yield url
