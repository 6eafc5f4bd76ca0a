from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
