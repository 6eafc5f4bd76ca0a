"""``autobalance tune`` on training scripts written the way users write them
(tests/scripts/user_train.py; real torchrun trials, 2 CPU ranks, gloo, a tiny model): what is saved,
what is said, and the exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tune_helpers import REPO, assert_verified_in_the_study_pool, cli, load, processes_with

pytestmark = pytest.mark.slow

USER = str(REPO / "tests" / "scripts" / "user_train.py")


def _tune(tmp_path, *extra: str, script_args: tuple[str, ...], trials: int):
    db = tmp_path / "a.db"
    args = ["tune", USER, "--trials", str(trials), "--nproc-per-node", "2", "--device", "cpu",
            "--storage", f"sqlite:///{db}", "--study-name", "s", "--seed", "0", "--trial-timeout", "120",
            "--runs-dir", str(tmp_path / "runs"), *extra, "--", *script_args]
    return cli(args, cwd=tmp_path, timeout=900), db


def test_a_sum_reduced_fp16_loss_never_saves_an_uneven_split(tmp_path):
    """Every uneven candidate fails verification and the script's own split is kept instead (it is
    exact for any loss). fp16 (with its gradient scaler) through the whole tune; that the fp32 math check fails a
    sum-reduced loss in bf16 as in fp16 is test_verify_user_scripts.py::
    test_a_sum_reduced_loss_fails_the_fp32_math_whatever_the_dtype."""
    dtype = "fp16"
    # rank 0 holds an extra tensor, so balanced (uneven) splits have the smaller spread: the best
    # candidates are uneven, and with a sum-reduced loss each of them weights samples by micro-batch
    # (a systematic reweighting of a few per cent that the bf16/fp16 rounding tolerance used to hide)
    proc, db = _tune(tmp_path, "--dtypes", dtype, "--max-accumulation", "1", "--memory-cap-gib", "0.002",
                     "--weight-time", "0", trials=5,
                     script_args=("--loss", "sum", "--dtype", dtype, "--micro-batch", "128", "--samples", "1024",
                                  "--rank0-extra-mb", "0.2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = load(db)
    verdicts = {k: v for k, v in study.user_attrs.items()
                if k.startswith("autobalance:verify:") and not v["passed"]}
    assert len(verdicts) == 3, verdicts
    # the candidates share the runs that do not depend on the configuration: each baseline ran once
    for name in ("baseline", "baseline-fp32"):
        assert len({v["runs"][name] for v in verdicts.values()}) == 1, [v["runs"] for v in verdicts.values()]
    assert len({v["runs"]["tuned-fp32"] for v in verdicts.values()}) == 3
    # and they ran in the workers of the study's own pool, without its cap: no second start-up
    assert_verified_in_the_study_pool(tmp_path / "runs" / "s")
    for verdict in verdicts.values():
        math = {c["name"]: c for c in verdict["checks"]}["equivalence"]
        assert math["name"] == "equivalence" and math["runs"] == ["tuned-fp32", "baseline-fp32"]
        assert math["grad_rel"] > 1e-3 and math["tolerance"][0] == verdict["bound"] <= 1e-4
    assert "both run in fp32" in proc.stdout and "reduction='sum'" in proc.stdout
    said = " ".join(proc.stdout.split())
    assert "kept the script's own split (rank 0: 128; rank 1: 128)" in said, said[-3000:]
    best = cli(["best", "--study-name", "s", "--storage", f"sqlite:///{db}", "--format", "json"], cwd=tmp_path)
    assert json.loads(best.stdout)["config"]["micro_batches"] == [128, 128]  # the script's own split
    assert processes_with(str(tmp_path)) == []  # the study's workers did not outlive the verification


def test_a_batchnorm_model_keeps_its_split_says_why_and_is_verified_in_train_mode(tmp_path):
    proc, db = _tune(tmp_path, "--strategy", "optuna", "--sampler", "random", "--dtypes", "fp32",
                     "--max-accumulation", "2", "--weight-time", "0", "--memory-cap-gib", "0.002", trials=4,
                     script_args=("--norm", "batch", "--micro-batch", "128", "--samples", "1024",
                                  "--rank0-extra-mb", "0.2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = " ".join((proc.stderr + proc.stdout).split())
    assert "Blocks: 6 at 'body.layers'" in said  # found inside an nn.Sequential
    assert "Batch-dependent layers (body.layers.0.norm (BatchNorm1d)" in said
    assert "stay the script's own" in said and "--allow-batch-dependent" in said
    study = load(db)
    assert study.user_attrs["autobalance:space"]["fixed_split"] is True
    configs = [t.user_attrs["config"] for t in study.trials if t.user_attrs.get("config")]
    assert len(configs) == 4
    assert all(c["micro_batches"] == [128, 128] and c["accumulation"] == 1 for c in configs), configs
    assert any(any(c["checkpoint"]) for c in configs)  # the blocks are searched
    saved = json.loads(cli(["best", "--study-name", "s", "--storage", f"sqlite:///{db}", "--format", "json"],
                           cwd=tmp_path).stdout)
    assert saved["config"]["micro_batches"] == [128, 128]
    verdicts = [v for k, v in study.user_attrs.items() if k.startswith("autobalance:verify:") and not v["skipped"]]
    assert verdicts, (configs, [t.values for t in study.trials])  # a checkpointed trial beat the baseline
    for verdict in verdicts:
        assert verdict["passed"], verdict
        assert any("train mode" in note for note in verdict["notes"])
        assert {c["name"]: c for c in verdict["checks"]}["equivalence"]["buffer_rel"] <= 1e-6  # running statistics as the script's own step


def test_splits_are_searched_with_allow_batch_dependent_and_verified_in_eval_mode(tmp_path):
    # the user accepts that a split changes BatchNorm's batch statistics: uneven splits are tried,
    # and the saved one was verified in eval mode (where BatchNorm uses its running statistics)
    proc, db = _tune(tmp_path, "--dtypes", "fp32", "--max-accumulation", "1", "--memory-cap-gib", "0.002",
                     "--weight-time", "0", "--allow-batch-dependent", trials=4,
                     script_args=("--norm", "batch", "--micro-batch", "128", "--samples", "1024",
                                  "--rank0-extra-mb", "0.2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = " ".join((proc.stderr + proc.stdout).split())
    assert "splits are searched (--allow-batch-dependent) and verified in eval mode" in said
    study = load(db)
    assert study.user_attrs["autobalance:space"]["fixed_split"] is False
    assert study.user_attrs["autobalance:allow_batch_dependent"] is True
    configs = [t.user_attrs["config"] for t in study.trials if t.user_attrs.get("config")]
    assert any(c["micro_batches"] != [128, 128] for c in configs), configs
    saved = json.loads(cli(["best", "--study-name", "s", "--storage", f"sqlite:///{db}", "--format", "json"],
                           cwd=tmp_path).stdout)
    verdicts = [v for k, v in study.user_attrs.items() if k.startswith("autobalance:verify:") and not v["skipped"]]
    assert saved["config"]["micro_batches"] != [128, 128] and verdicts, (saved, verdicts)
    for verdict in verdicts:
        assert verdict["passed"], verdict
        assert any("verified in eval mode (allowed to change" in note for note in verdict["notes"]), verdict
        info = json.loads((Path(verdict["runs"]["tuned"]) / "verify-step.json").read_text())
        assert info["train_mode"] is False and info["allow_batch_dependent"] is True


def test_no_blocks_and_a_dataset_smaller_than_one_global_batch_are_said_first_and_measured_truly(tmp_path):
    # one MLP without repeated blocks, 20 samples for a global batch of 64: every step is a
    # 20-sample partial step; both facts are the study's first lines, and samples/s counts 20 per step
    proc, db = _tune(tmp_path, "--dtypes", "fp32", "--max-accumulation", "1", trials=3,
                     script_args=("--body", "flat", "--samples", "20", "--micro-batch", "32", "--epochs", "20"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    head = " ".join(proc.stderr.split("  trial 0 ok")[0].split())  # before the baseline's own result
    assert head.startswith("autobalance tune "), proc.stderr[:2000]
    facts = head.split("trial 0 baseline (the script's own configuration) ... ", 1)[1]
    assert facts.startswith("No repeated blocks found in the model") and 'blocks="path.to.blocks"' in facts, facts
    assert "The dataset has 20 samples, fewer than one global batch (64)" in facts, facts
    study = load(db)
    configs = [t.user_attrs["config"] for t in study.trials if t.user_attrs.get("config")]
    assert len(configs) == 3 and not any(any(c["checkpoint"]) for c in configs), configs
    for t in study.trials:
        assert t.user_attrs["samples_per_s"] == pytest.approx(20 / (t.user_attrs["step_time_ms"] / 1e3), rel=0.01)
    saved = json.loads(cli(["best", "--study-name", "s", "--storage", f"sqlite:///{db}", "--format", "json"],
                           cwd=tmp_path).stdout)
    figures = saved["figures"]
    assert figures["samples_per_s"] == pytest.approx(20 / (figures["step_time_ms"] / 1e3), rel=0.01), figures


def test_an_always_on_batch_term_keeps_the_scripts_split_and_says_why(tmp_path):
    """Issue 29: a load-balancing term over the micro-batch's routing fractions, always on, makes
    every uneven split compute another update; verify refuses them (fp32, far above the floor) and
    ``tune`` then saves the best trial with the script's own split instead of nothing, and says why.
    Fails if such a study saves an uneven split, saves nothing, or stays silent about the reason."""
    proc, db = _tune(tmp_path, "--dtypes", "fp32", "--max-accumulation", "1", "--memory-cap-gib", "0.004",
                     "--weight-time", "0", trials=5,
                     script_args=("--aux", "always", "--micro-batch", "64", "--samples", "512",
                                  "--rank0-extra-mb", "0.5"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = " ".join(proc.stdout.split())
    assert "kept the script's own split (rank 0: 64; rank 1: 64)" in said, said[-3000:]
    study = load(db)
    verdicts = {int(k.rsplit(":", 1)[1]): v for k, v in study.user_attrs.items() if k.startswith("autobalance:verify:")}
    failed = [v for v in verdicts.values() if not v["passed"]]
    assert failed and all(v["failure"] == "math" for v in failed), verdicts
    assert all(v["checks"][1]["grad_rel"] > 100 * v["floor"] for v in failed)
    saved = json.loads(cli(["best", "--study-name", "s", "--storage", f"sqlite:///{db}", "--format", "json"],
                           cwd=tmp_path).stdout)
    assert saved["config"]["micro_batches"] == [64, 64] and saved["config"]["accumulation"] == 1, saved
