"""The runtime under real torchrun jobs (2 ranks, gloo)."""

from __future__ import annotations

import json

import pytest

from autobalance import BalanceConfig
from tests.conftest import torchrun

pytestmark = pytest.mark.slow


def test_uneven_update_equals_single_process_update(tmp_path, repo):
    out = tmp_path / "grads.json"
    proc = torchrun([str(repo / "tests/dist_scripts/grad_check.py"), str(out), "16"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert len(results) == 16
    accs = {r["config"]["accumulation"] for r in results}
    assert accs == {1, 2, 3, 4}
    assert any(r["config"]["micro_batches"][0] != r["config"]["micro_batches"][1] for r in results)
    for r in results:
        assert r["rel_error"] <= 1e-6, r
        # one bucket (bucket_cap_mb=1000): exactly one all-reduce per optimizer step
        assert r["allreduce_calls"] == 1, r


@pytest.mark.parametrize("world", [1, 2, 3])
def test_any_split_update_equals_single_process_update(tmp_path, repo, world):
    """Random global batches (primes included) split any way over the ranks and 1-6 micro-steps
    whose sizes differ by one: one optimizer step equals one process's step on the whole batch,
    one all-reduce per step, every sample once per epoch (a tail below the world size dropped)."""
    out = tmp_path / "grads.json"
    proc = torchrun([str(repo / "tests/dist_scripts/grad_check.py"), str(out), "12", "any"], nproc=world)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert len(results) == 12
    configs = [BalanceConfig.from_dict(r["config"]) for r in results]
    assert {c.accumulation for c in configs} == set(range(1, 7))
    assert any(c.global_batch in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61)
               for c in configs)
    uneven = [c for c in configs if not c.equal_micro_batches]
    assert len(uneven) >= 6, "most random splits must be non-divisor ones"
    for r, cfg in zip(results, configs, strict=True):
        assert cfg.world_size == world
        assert r["rel_error"] <= 1e-6, r
        # one bucket (bucket_cap_mb=1000): exactly one all-reduce per optimizer step (none on one rank)
        assert r["allreduce_calls"] == (1 if world > 1 else 0), r
        epoch = r["epoch"]
        assert epoch["seen"] == epoch["distinct"], "a sample was given twice in one epoch"
        assert epoch["num_samples"] - world < epoch["seen"] <= epoch["num_samples"]
        assert len(set(epoch["steps_per_rank"])) == 1, "every rank runs the same number of steps"
