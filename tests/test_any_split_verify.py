"""verify's fp32 rule on an any split (issue 21; slow: real torchrun jobs of the small GPT): a
prime global batch split 3,2,2 / 4,3,3 passes within 1e-6, and a runtime that weights each
micro-batch by its rank's mean micro-batch instead of its own size (tests/bugs
``micro-step-weights``: exact for equal micro-batches) is rejected."""

from __future__ import annotations

import json

import pytest

from autobalance import BalanceConfig
from tests.bugs import inject
from tests.tune_helpers import GPT, cli

pytestmark = pytest.mark.slow

SMALL_GPT = ["--", "--n-layer", "2", "--n-embd", "32", "--samples", "128"]


def _verify(tmp_path, cfg: BalanceConfig, *, env=None):
    path = tmp_path / "c.json"
    path.write_text(cfg.to_json())
    return cli(["verify", GPT, "--config", str(path), "--device", "cpu", "--runs-dir", str(tmp_path / "runs"),
                "--json", *SMALL_GPT], cwd=tmp_path, env=env, timeout=400)


def test_verify_passes_an_any_split_and_rejects_weights_that_ignore_micro_batch_sizes(tmp_path):
    """Fails if verify passes a runtime that weights each micro-batch by its rank's mean micro-batch
    instead of its own size (tests/bugs ``micro-step-weights``: exact for equal micro-batches, wrong
    for the any split 3,2,2 / 4,3,3), or if it rejects the correct runtime on that split (fp32, 1e-6)."""
    cfg = BalanceConfig.any_split(rank_samples=[7, 10], accumulation=3, checkpoint=[[0], []])
    assert cfg.global_batch == 17 and cfg.split_text() == "rank 0: 3,2,2; rank 1: 4,3,3"
    ok = _verify(tmp_path, cfg)
    assert ok.returncode == 0, ok.stderr[-3000:] + ok.stdout[-3000:]
    verdict = json.loads(ok.stdout)
    checks = {c["name"]: c for c in verdict["checks"]}
    assert verdict["passed"] is True
    assert checks["equivalence"]["grad_rel"] <= 1e-6 and checks["equivalence"]["param_rel"] <= 1e-6

    wrong = _verify(tmp_path, cfg, env=inject("micro-step-weights"))
    assert wrong.returncode == 1, wrong.stderr[-3000:] + wrong.stdout[-3000:]
    verdict = json.loads(wrong.stdout)
    assert verdict["passed"] is False and "differs from the baseline" in verdict["reason"]
    assert {c["name"]: c for c in verdict["checks"]}["equivalence"]["grad_rel"] > 1e-3

    # the same injected runtime on equal micro-batches is exact: the rejection above is the any split's
    equal = _verify(tmp_path, BalanceConfig(micro_batches=[3, 5], accumulation=2, global_batch=16,
                                            checkpoint=[[0], []]), env=inject("micro-step-weights"))
    assert equal.returncode == 0, equal.stderr[-3000:] + equal.stdout[-3000:]
    assert json.loads(equal.stdout)["passed"] is True
