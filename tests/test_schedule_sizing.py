"""A learning-rate schedule stepped once per optimizer step, sized the documented way, ends at its final
rate after exactly one epoch, under any configuration a study may store.

``len(loader)`` counts this rank's micro-batches: with accumulation 2 a cosine schedule sized by it
is twice too long (it ends the epoch at half the base rate), and with an uneven split the ranks do not
even agree on it. ``plan.steps_per_epoch(loader)`` counts optimizer steps, the same on every rank.
The frameworks: Lightning's ``estimated_stepping_batches`` and the HF Trainer count optimizer steps of
the loader the integration builds already; Accelerate sizes by ``balance.steps_per_epoch()``.

One torchrun launch (2 gloo ranks) runs every case (``tests/schedule_sizing.py``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import autobalance as ab
from autobalance._config import BalanceConfig
from autobalance._errors import UsageError
from autobalance.runtime import epoch_schedule
from tests.tune_helpers import REPO

FRAMEWORKS = {"lightning": "lightning", "hf": "transformers", "accelerate": "accelerate"}
UNEVEN = BalanceConfig.any_split(rank_samples=[7, 4], accumulation=2)
UNEVEN_SAMPLES = 3 * 11 + 7


@pytest.fixture(scope="module")
def sized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    names = [name for name, module in FRAMEWORKS.items() if _installed(module)]
    out = tmp_path_factory.mktemp("schedule") / "sizing.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", "127.0.0.1:0", "tests/schedule_sizing.py", str(out), ",".join(names)],
        capture_output=True, text=True, cwd=REPO, timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _ends_exactly_after_the_epoch(ranks: list[dict[str, Any]], steps: int) -> None:
    """Every rank took ``steps`` optimizer steps, the schedule was sized ``steps``, every step's rate
    was above the final one and after the last step the rate is the final one (cosine: 0); the ranks
    saw the same rates."""
    for r, rank in enumerate(ranks):
        assert rank["steps"] == steps, (r, rank)
        assert rank["t_max"] == steps, (r, rank)
        assert rank["final_lr"] == pytest.approx(0.0, abs=1e-12), (r, rank)
        assert len(rank["lrs"]) == steps and min(rank["lrs"]) > 1e-3, (r, rank)
        assert rank["lrs"] == sorted(rank["lrs"], reverse=True), (r, rank)
    assert all(rank["lrs"] == ranks[0]["lrs"] for rank in ranks), ranks


@pytest.mark.slow
@pytest.mark.parametrize(("case", "steps"), [("script", 4), ("accumulation-2", 4), ("uneven", 4)])
def test_a_schedule_sized_by_steps_per_epoch_ends_after_one_epoch(sized, case, steps):
    """The script's own configuration (accumulation 1), accumulation 2, and an uneven any-split whose
    partial last step has one micro-batch on rank 0 and two on rank 1 (so ``len(loader)`` is 7 and 8)."""
    ranks = sized[f"plan/{case}/documented"]
    _ends_exactly_after_the_epoch(ranks, steps)
    if case != "script":
        assert all(rank["len_loader"] > steps for rank in ranks)  # micro-batches: not what sizes the schedule
    if case == "uneven":
        assert [rank["len_loader"] for rank in ranks] == [7, 8]


@pytest.mark.slow
def test_the_natural_len_loader_is_what_the_check_catches(sized):
    """The pitfall, seen by the same check: fine at the script's own accumulation 1, wrong as soon as the
    configuration accumulates (half the base rate left after the epoch), and different on each rank with
    an uneven split."""
    _ends_exactly_after_the_epoch(sized["plan/script/natural"], 4)
    for case in ("accumulation-2", "uneven"):
        with pytest.raises(AssertionError):
            _ends_exactly_after_the_epoch(sized[f"plan/{case}/natural"], 4)
    assert [r["final_lr"] for r in sized["plan/accumulation-2/natural"]] == pytest.approx([0.05, 0.05])
    finals = [r["final_lr"] for r in sized["plan/uneven/natural"]]
    assert finals[0] != pytest.approx(finals[1])  # the ranks' rates differ


@pytest.mark.slow
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_each_integration_sizes_the_schedule_in_optimizer_steps(sized, framework):
    """The uneven any-split with accumulation 2 through each framework: its loader holds the epoch's
    full steps only (40 samples: 3 full steps of 11, the partial fourth dropped), and the schedule sized the
    framework's way (Lightning ``estimated_stepping_batches``, the HF Trainer's own cosine schedule,
    Accelerate ``balance.steps_per_epoch()``) ends at 0 after the epoch's 3 optimizer steps."""
    pytest.importorskip(FRAMEWORKS[framework])
    ranks = sized[framework]
    full_steps = UNEVEN_SAMPLES // UNEVEN.global_batch
    _ends_exactly_after_the_epoch(ranks, full_steps)
    for rank in ranks:
        if "plan_steps_per_epoch" in rank:
            assert rank["plan_steps_per_epoch"] == full_steps
        if "len_loader" in rank:
            assert rank["len_loader"] == full_steps * UNEVEN.accumulation  # micro-batches


# ---------------------------------------------------------------------- in this process, one rank
def _one_rank_plan(**kwargs: Any) -> Any:
    return ab.plan(device="cpu", **kwargs)


@pytest.mark.parametrize(("samples", "micro_batch", "accumulation"), [(20, 3, 2), (24, 3, 2), (7, 4, 1), (13, 2, 3)])
def test_steps_per_epoch_counts_the_steps_the_loop_takes(samples, micro_batch, accumulation):
    plan = _one_rank_plan(micro_batch=micro_batch, accumulation=accumulation)
    loader = plan.dataloader(torch.utils.data.TensorDataset(torch.arange(samples)))
    expected = len(epoch_schedule(num_samples=samples, config=plan.config, epoch=0, seed=0).steps)
    assert plan.steps_per_epoch(loader) == plan.steps_per_epoch() == expected
    assert expected == math.ceil(samples / (micro_batch * accumulation))
    assert sum(1 for _ in plan.steps(loader)) == expected
    assert sum(1 for _ in plan.steps(loader)) == plan.steps_per_epoch(loader)  # every epoch the same


def test_steps_per_epoch_names_the_loader_it_needs():
    plan = _one_rank_plan(micro_batch=2)
    with pytest.raises(UsageError, match=r"before plan\.dataloader\(\)"):
        plan.steps_per_epoch()
    plan.dataloader(torch.utils.data.TensorDataset(torch.arange(8)))
    foreign = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8)), batch_size=2)
    with pytest.raises(UsageError, match=r"made by plan\.dataloader"):
        plan.steps_per_epoch(foreign)
