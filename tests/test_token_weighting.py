"""Token-weighted losses (issue 20): ``plan.steps(loader, count=...)`` makes every optimizer step
the global token-mean update, for any split, accumulation and checkpoint set."""

from __future__ import annotations

import json

import pytest

from tests.conftest import torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("nproc", "cases"), [(2, 8), (3, 4)])
def test_token_mean_update_is_exact_over_a_whole_epoch(tmp_path, repo, nproc, cases):
    """Fails if the count weighting is dropped, uses sample counts, or uses a per-rank total."""
    out = tmp_path / "tokens.json"
    proc = torchrun([str(repo / "tests/dist_scripts/token_grad_check.py"), str(out), str(cases)], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert {r["config"]["accumulation"] for r in results} == {1, 2, 3, 4}
    assert any(len(set(r["config"]["micro_batches"])) > 1 for r in results)
    assert any(any(r["config"]["checkpoint"]) for r in results)
    for r in results:
        assert r["steps"] == r["schedule_steps"] >= 2, r
        assert r["rel_error"] <= 1e-6, r
        # one gradient all-reduce (one bucket) and one scalar all-reduce (the step's count) per step
        assert r["grad_allreduces_per_step"] == 1, r
        assert r["other_allreduces_per_step"] == 1, r


def test_without_count_the_same_token_mean_script_is_not_exact(tmp_path, repo):
    """The control: per-sample weighting of a token-mean loss is not the global token mean, so the
    exactness check above can fail (and does, without ``count=``)."""
    out = tmp_path / "tokens.json"
    proc = torchrun([str(repo / "tests/dist_scripts/token_grad_check.py"), str(out), "2", "--no-count"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert all(r["rel_error"] > 1e-3 for r in results), results
    assert all(r["other_allreduces_per_step"] == 0 for r in results), results


def test_tune_saves_a_verified_uneven_split_for_a_token_mean_script(tmp_path):
    """A script whose loss is a token mean (``--variable-length``, ``count=``) under a cap where its
    own 8 + 8 runs out of memory on rank 0: tune finds an uneven split and verify accepts it
    (it would not without ``count=``: the test above shows the update then differs)."""
    from tests.tune_helpers import GPT, cli, tune_args

    db = tmp_path / "a.db"
    args = tune_args(GPT, db, "--memory-cap-gib", "0.0145", "--strategy", "model",
                     "--max-accumulation", "1", trials=4)
    proc = cli([*args, "--", "--variable-length"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    best = cli(["best", "--study-name", "s", "--storage", f"sqlite:///{db}", "--format", "json"], cwd=tmp_path)
    assert best.returncode == 0, best.stdout + best.stderr
    saved = json.loads(best.stdout)
    text = json.dumps(saved)
    config = saved.get("config", saved)
    assert sum(config["micro_batches"]) * config["accumulation"] == 16, saved
    assert config["micro_batches"][0] < config["micro_batches"][1], saved  # rank 0 holds the extras
    assert "verif" in text, saved


def test_verify_accepts_a_token_mean_split_with_count_and_explains_without(tmp_path):
    """The same uneven split of a token-mean script: verified with ``count=``; without it verify
    fails in fp32 and names the fix (``count=``) in words."""
    from autobalance import BalanceConfig
    from tests.tune_helpers import REPO, cli

    script = str(REPO / "tests" / "scripts" / "token_lm.py")
    path = tmp_path / "c.json"
    path.write_text(json.dumps(BalanceConfig(micro_batches=[5, 11], global_batch=16).to_dict()))
    common = ["--config", str(path), "--device", "cpu", "--runs-dir", str(tmp_path / "runs")]
    with_count = cli(["verify", script, *common, "--", "--count"], cwd=tmp_path)
    assert with_count.returncode == 0, with_count.stdout[-3000:] + with_count.stderr[-3000:]
    without = cli(["verify", script, *common], cwd=tmp_path)
    assert without.returncode == 1, without.stdout[-3000:] + without.stderr[-3000:]
    assert "count=" in " ".join((without.stdout + without.stderr).split())
