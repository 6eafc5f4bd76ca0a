"""Token-weighted losses (issue 20): ``plan.steps(loader, count=...)`` makes every optimizer step
the global token-mean update, for any split, accumulation and checkpoint set."""

from __future__ import annotations

import json

import pytest

from tests.conftest import torchrun

pytestmark = pytest.mark.slow


def _token_check(tmp_path, repo, *args: str, nproc: int) -> dict[str, list[dict]]:
    out = tmp_path / "tokens.json"
    proc = torchrun([str(repo / "tests/dist_scripts/token_grad_check.py"), str(out), *args], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _assert_one_scalar_then_one_gradient_all_reduce(result: dict, *, scalar: bool) -> None:
    """Every step of every rank, in order: the count's scalar all-reduce (``S``) before the first
    backward (``B``), no other collective, and exactly one gradient all-reduce (``G``) in the last
    backward. Fails if the count is reduced per micro-batch, after a backward, or by another
    collective, or if a micro-step all-reduces gradients (``no_sync`` lost)."""
    for rank, (steps, micro_steps) in enumerate(zip(result["events"], result["micro_steps"], strict=True)):
        assert len(steps) == result["steps"], (rank, result)
        for events, n in zip(steps, micro_steps, strict=True):
            assert events == ("S" if scalar else "") + "B" * n + "G", (rank, events, result["config"])


@pytest.mark.parametrize(("nproc", "equal", "any_"), [(2, 8, 6), (3, 4, 4)])
def test_token_mean_update_is_exact_over_a_whole_epoch(tmp_path, repo, nproc, equal, any_):
    """Equal micro-steps per rank (random uneven ranks, accumulation 1-4) and any split (micro-steps
    of unequal sizes within a rank), checkpointed blocks, whole epochs with a short last step: the
    gradient each optimizer step applies is one process's gradient of the global token mean within
    1e-6 (fp32). Fails if the count weighting is dropped, uses sample counts, a per-rank or
    per-micro-step total, or the any-split micro-step sizes are mixed up."""
    results = _token_check(tmp_path, repo, str(equal), str(any_), nproc=nproc)
    equal_r, any_r = results["equal"], results["any"]
    assert {r["config"]["accumulation"] for r in equal_r} == {1, 2, 3, 4}
    assert any(len(set(r["config"]["micro_batches"])) > 1 for r in equal_r)
    assert any(r["unequal_micro_steps"] for r in any_r)  # the any-split form really has unequal micro-steps
    assert any(r["config"].get("rank_samples") for r in any_r)  # stored in the any-split form
    assert any(any(r["config"]["checkpoint"]) for r in equal_r + any_r)
    assert any(r["last_step_samples"] < r["config"]["global_batch"] for r in equal_r + any_r)  # a short last step
    for r in equal_r + any_r:
        assert r["steps"] == r["schedule_steps"] >= 2, r
        assert r["rel_error"] <= 1e-6, r
        _assert_one_scalar_then_one_gradient_all_reduce(r, scalar=True)


def test_without_count_the_same_token_mean_script_is_not_exact(tmp_path, repo):
    """The control: per-sample weighting of a token-mean loss is not the global token mean, so the
    exactness check above can fail (and does, without ``count=``); and without ``count=`` no
    scalar all-reduce is added (one gradient all-reduce per step only)."""
    results = _token_check(tmp_path, repo, "2", "2", "--no-count", nproc=2)
    for r in results["equal"] + results["any"]:
        assert r["rel_error"] > 1e-3, r
        _assert_one_scalar_then_one_gradient_all_reduce(r, scalar=False)


def test_tune_saves_a_verified_uneven_split_for_a_token_mean_script(tmp_path):
    """A script whose loss is a token mean (``--variable-length``, ``count=``) under a cap where its
    own 8 + 8 runs out of memory on rank 0: tune finds an uneven split and verify accepts it
    (it would not without ``count=``: the test above shows the update then differs)."""
    from tests.tune_helpers import (
        GPT,
        assert_saved_split_is_uneven_and_fits,
        assert_verified_in_the_study_pool,
        cli,
        load,
        tune_args,
    )

    db = tmp_path / "a.db"
    # 7 trials: the reference run that fixes the exchange rate (the script's own split fits nowhere) takes one,
    # and on a busy machine the OOM baseline may lose rank 1's peak (rank 0's OOM ends the job first): the
    # memory model's first proposals then miss (a CI run: [1, 15] over the cap, [4, 12] at 5.0 MiB of spread
    # against the reference run's 4.8); spread only: whether an uneven split beats that even run must not
    # rest on 3 CPU steps' timing
    args = tune_args(GPT, db, "--memory-cap-gib", "0.0145", "--strategy", "model",
                     "--max-accumulation", "1", "--weight-time", "0", trials=7)
    proc = cli([*args, "--", "--variable-length"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    best = cli(["best", "--study-name", "s", "--storage", f"sqlite:///{db}", "--format", "json"], cwd=tmp_path)
    assert best.returncode == 0, best.stdout + best.stderr
    saved = json.loads(best.stdout)
    text = json.dumps(saved)
    config = saved.get("config", saved)
    assert config["global_batch"] == 16, saved
    assert_saved_split_is_uneven_and_fits(saved)
    assert "verif" in text, saved
    # the saved trial was really verified (not skipped as the script's own): fp32 against the baseline
    study = load(db)
    verdicts = {int(k.rsplit(":", 1)[1]): v for k, v in study.user_attrs.items() if k.startswith("autobalance:verify:")}
    verdict = verdicts[saved["trial_number"]]
    assert verdict["passed"] and not verdict["skipped"], verdict
    check = {c["name"]: c for c in verdict["checks"]}["equivalence"]
    assert check["name"] == "equivalence" and [r.split("-")[0] for r in check["runs"]] == ["tuned", "baseline"], check
    assert check["grad_rel"] <= 1e-6, check
    assert_verified_in_the_study_pool(tmp_path / "autobalance_runs" / "s")  # the trials' workers, uncapped


def test_tune_of_the_same_script_without_count_saves_no_uneven_split_and_says_why(tmp_path):
    """The issue's first observation, from the user's side: the same token-mean script without
    ``count=`` under the same cap: every uneven candidate fails fp32 verification and the output names
    ``count=``; none is saved. An even split computes the script's own update even so: the reference run
    that fixes the exchange rate (the script's own split, every block checkpointed) may be saved,
    verified; when nothing is, ``tune`` exits 1 and its final error says what to do. Fails if an uneven
    split is saved or the explanation loses the token-mean fix."""
    from autobalance import BalanceConfig
    from tests.tune_helpers import GPT, cli, load, tune_args

    db = tmp_path / "a.db"
    # spread only: on spread and time a CI run saved the even reference run first (its 3 CPU steps measured
    # fast enough to beat the uneven split's objective), and no uneven candidate reached verification
    args = tune_args(GPT, db, "--memory-cap-gib", "0.0145", "--strategy", "model",
                     "--max-accumulation", "1", "--weight-time", "0", trials=7)  # 7: as the study above
    proc = cli([*args, "--", "--variable-length", "--no-count"], cwd=tmp_path)
    said = " ".join((proc.stdout + proc.stderr).split())
    study = load(db)
    uneven = {t.number for t in study.trials if t.user_attrs.get("config")
              and len(set(BalanceConfig.from_dict(t.user_attrs["config"]).samples_per_rank)) > 1}
    verdicts = {int(k.rsplit(":", 1)[1]): v for k, v in study.user_attrs.items() if k.startswith("autobalance:verify:")}
    failed = [v for n, v in verdicts.items() if n in uneven]
    assert failed and not any(v["passed"] for v in failed), (verdicts, uneven, said[-3000:])
    assert all({c["name"]: c for c in v["checks"]}["equivalence"]["grad_rel"] > 1e-3 for v in failed), failed
    assert "a mean over tokens (padding, ignore_index) needs `plan.steps(loader, count=" in said
    best = cli(["best", "--study-name", "s", "--storage", f"sqlite:///{db}", "--format", "json"], cwd=tmp_path)
    if proc.returncode == 0:  # an even split passed: saved, and only it
        saved = json.loads(best.stdout)["trial_number"]
        assert saved not in uneven and verdicts[saved]["passed"] is True, (saved, verdicts)
        return
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "No configuration was saved" in said and "nothing was saved: every configuration tried failed" in said
    assert "a token mean needs plan.steps(loader, count=...)" in said  # what to do, in the final error
    assert best.returncode != 0  # nothing in the store


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
    said = " ".join((without.stdout + without.stderr).split())
    # the likely causes in words, and what to change for each
    for words in ("not a per-sample mean", "mean over tokens (padding, ignore_index)",
                  "plan.steps(loader, count=", "reduction='sum'", "README: Losses",
                  "layers whose step depends on the batch", "a term computed over the whole micro-batch"):
        assert words in said, (words, said[-3000:])


def test_tune_with_every_candidate_rejected_is_an_error_that_says_what_to_do():
    """``tune`` exits non-zero (VerificationError, exit 1 through the CLI: see
    test_tune_verify_user_scripts.py::test_a_sum_reduced_fp16_loss_is_never_saved_and_tune_exits_1)
    when verification rejected every candidate, naming the token-mean fix. Fails if nothing saved
    passes silently or the message drops ``count=``."""
    from autobalance._errors import VerificationError
    from autobalance.tuner._finish import Saving

    Saving(trial=3, rejected=[1, 2]).check()  # something was saved: no error
    Saving().check()  # nothing feasible (said elsewhere), nothing rejected: not this error
    with pytest.raises(VerificationError) as caught:
        Saving(rejected=[1, 2]).check()
    said = str(caught.value)
    for words in ("nothing was saved", "trial(s) 1, 2", "count=", "a sum must become a mean", "--study-name",
                  "autobalance promote"):
        assert words in said, (words, said)
