from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Inductor writes its default cache directory into os.environ the first time anything compiles in
# this process; every later subprocess (a tune under test) would inherit it and skip the study's own
# cache. The environment is put back after each test.
_INDUCTOR_CACHE_AT_START = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


@pytest.fixture(autouse=True)
def _no_inductor_cache_dir_leak():
    yield
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != _INDUCTOR_CACHE_AT_START:
        if _INDUCTOR_CACHE_AT_START is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE_AT_START


def torchrun(args: list[str], *, nproc: int = 2, timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a script under torchrun on CPU (gloo) and return the completed process."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)


@pytest.fixture
def repo() -> Path:
    return REPO


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with ``slow`` tests (real torchrun jobs) first, each file's tests in their own order.
    The test command (docs/development.md) runs the suite on two pytest-xdist workers, one file at a time each, in this
    order (``--dist loadfile --no-loadscope-reorder``): the quick files then fill the end of the run,
    instead of one worker finishing a long file alone while the other idles."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (item.path not in slow_files, order[id(item)]))
