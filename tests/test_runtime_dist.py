"""The runtime under real torchrun jobs (2 ranks, gloo)."""

from __future__ import annotations

import json

import pytest

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
