"""The GPU smoke suite: every test takes the ``device`` fixture.

On a machine with CUDA the device is ``cuda``. Without CUDA the tests skip with the reason,
unless AUTOBALANCE_GPU_SMOKE_ON_CPU=1: then they run on ``cpu`` (gloo, the CPU memory tracker,
the aot_eager_decomp_partition compile backend), which proves the tests themselves before GPU
time is spent on them. Run on a GPU machine with ``python3 -m pytest tests/gpu -q -rs``.
"""

from __future__ import annotations

import os

import pytest

ON_CPU_ENV = "AUTOBALANCE_GPU_SMOKE_ON_CPU"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def device() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get(ON_CPU_ENV) == "1":
        return "cpu"
    pytest.skip(f"GPU smoke suite: no CUDA device here (torch {torch.__version__}, "
                f"torch.cuda.is_available() is False); set {ON_CPU_ENV}=1 to run it on CPU")
