"""A CPU study of the GPT example with a prime global batch (slow: real trials). On one rank, 13
samples per step split equally only as 1 x 13, which does not fit the cap without checkpointing;
the model-guided search proposes splits that are not a divisor's (the largest micro-batch that
fits for each number of micro-steps), runs them, shows them plainly, verifies and saves the best."""

from __future__ import annotations

import json

import pytest

from autobalance import BalanceConfig
from tests.tune_helpers import GPT, cli, load

pytestmark = pytest.mark.slow


def test_prime_global_batch_study_runs_splits_that_are_not_a_divisors(tmp_path):
    db = tmp_path / "a.db"
    # tiny GPT on one rank: ~8.5 MiB fixed (weights, Adam, EMA, cached batch) + ~0.9 MiB per sample
    # of the largest micro-batch; 16 MiB x 0.95 usable holds about 7 samples at once, not 13
    args = ["tune", GPT, "--trials", "5", "--nproc-per-node", "1", "--device", "cpu", "--storage", f"sqlite:///{db}",
            "--study-name", "s", "--seed", "0", "--trial-timeout", "120", "--global-batch", "13",
            "--memory-cap-gib", "0.016"]
    proc = cli(args, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = load(db).get_trials()
    assert trials[0].user_attrs["status"] == "oom"  # the script's own 13 at once
    split = [t for t in trials if t.user_attrs.get("status") == "ok" and t.user_attrs.get("feasible")
             and not BalanceConfig.from_dict(t.user_attrs["config"]).equal_micro_batches]
    assert split, [(t.user_attrs.get("config"), t.user_attrs.get("status")) for t in trials]
    for t in split:
        cfg = BalanceConfig.from_dict(t.user_attrs["config"])
        sizes = cfg.micro_step_sizes(0)
        assert cfg.global_batch == 13 and 1 < cfg.accumulation < 13 and max(sizes) - min(sizes) == 1
        assert t.user_attrs["split"] == f"rank 0: {','.join(map(str, sizes))}"  # what the dashboard shows
    best = cli(["best", "--study-name", "s", "--storage", f"sqlite:///{db}", "--format", "json"], cwd=tmp_path)
    assert best.returncode == 0, best.stderr
    chosen = BalanceConfig.from_dict(json.loads(best.stdout)["config"])
    assert chosen.global_batch == 13
    if not chosen.equal_micro_batches:  # the summary shows the chosen micro-batches as they are
        assert chosen.split_text() in " ".join(proc.stdout.split())
    assert "Verified trial" in proc.stdout  # its step equals the reference's before it was saved
