"""``autobalance verify`` on training scripts written the way users write them
(tests/scripts/user_train.py; real torchrun jobs, 2 CPU ranks, gloo, a tiny model).

Each test is one verification: a handful of one-step runs in one warm pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autobalance import BalanceConfig
from tests.bugs import inject
from tests.tune_helpers import REPO, cli

pytestmark = pytest.mark.slow

USER = str(REPO / "tests" / "scripts" / "user_train.py")


def _verify(tmp_path: Path, cfg: BalanceConfig, *script_args: str, name: str = "c.json",
            env: dict[str, str] | None = None) -> tuple[int, dict, str]:
    path = tmp_path / name
    path.write_text(cfg.to_json())
    proc = cli(["verify", USER, "--config", str(path), "--device", "cpu", "--runs-dir", str(tmp_path / "runs"),
                "--trial-timeout", "120", "--json", "--", *script_args], cwd=tmp_path, env=env, timeout=600)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout), proc.stderr


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_sum_reduced_loss_fails_the_fp32_math_whatever_the_dtype(tmp_path, dtype):
    # each sample weighs 11/16 on one rank and 5/16 on the other instead of 1/2: a systematic
    # reweighting that the bf16/fp16 tolerance of the baseline's own rounding used to hide
    cfg = BalanceConfig(micro_batches=[5, 11], global_batch=16, dtype=dtype)
    code, verdict, err = _verify(tmp_path, cfg, "--loss", "sum", "--dtype", dtype, "--micro-batch", "8")
    assert code == 1, err[-3000:]
    assert verdict["passed"] is False and verdict["failure"] == "math"
    checks = {c["name"]: c for c in verdict["checks"]}
    assert list(checks) == ["floor", "equivalence"]
    equivalence = checks["equivalence"]
    assert equivalence["runs"] == ["tuned-fp32", "baseline-fp32"]
    # the bound comes from the floor measured in this verification (20x, at least 1e-6)
    assert checks["floor"]["runs"] == ["floor", "baseline-fp32"]
    assert equivalence["tolerance"][0] == verdict["bound"] == max(1e-6, 20 * checks["floor"]["grad_rel"])
    assert verdict["bound"] <= 1e-4 and "rounding floor" in verdict["reason"]
    assert equivalence["grad_rel"] > 1e-3
    assert "both run in fp32" in verdict["reason"] and "per-sample mean" in verdict["reason"]
    assert "reduction='sum'" in verdict["reason"]
    assert "tuned" not in verdict["runs"]  # the dtype's own run is not even needed


BATCHNORM = ("--norm", "batch", "--micro-batch", "8")


def test_batchnorm_model_is_verified_in_train_mode(tmp_path):
    # an uneven split changes what BatchNorm normalises with: in train mode the step differs
    code, verdict, err = _verify(tmp_path, BalanceConfig(micro_batches=[5, 11], global_batch=16), *BATCHNORM)
    assert code == 1, err[-3000:]
    checks = {c["name"]: c for c in verdict["checks"]}
    assert verdict["passed"] is False and checks["equivalence"]["grad_rel"] > 1e-3
    assert any("batch-dependent layers (body.layers.0.norm (BatchNorm1d)" in n and "train mode" in n
               for n in verdict["notes"]), verdict["notes"]
    # the refusal names the model's own layers first, with the fix, before the loss causes
    assert verdict["failure"] == "math"
    reason = verdict["reason"]
    assert "first suspect: the batch-dependent layers (body.layers.0.norm (BatchNorm1d)" in reason, reason
    assert "--allow-batch-dependent" in reason and reason.index("first suspect") < reason.index("per-sample mean")


def test_checkpointed_batchnorm_updates_running_stats_once_and_verify_catches_a_second_update(tmp_path):
    """Fails if checkpointing recomputes BatchNorm's buffer update (the no-keep-buffers mutation passes verify)."""
    # the script's split with every BatchNorm block checkpointed (rank 0: verify reads rank 0's buffers):
    # the same step, running statistics included
    # (functional dropout in each block: the dropout-off runs hold its probability at 0 in train mode,
    # and the recomputation is replayed with dropout on)
    ckpt = BalanceConfig(micro_batches=[8, 8], global_batch=16, checkpoint=[[0, 1, 2, 3, 4, 5], [0, 1]])
    code, verdict, err = _verify(tmp_path, ckpt, *BATCHNORM, "--dropout", "0.2", name="ckpt.json")
    assert code == 0, err[-3000:] + json.dumps(verdict)[-2000:]
    checks = {c["name"]: c for c in verdict["checks"]}
    assert checks["equivalence"]["grad_rel"] <= verdict["bound"] and checks["equivalence"]["buffer_rel"] <= 1e-6
    assert checks["rng-replay"]["buffer_rel"] <= 1e-6
    step = torch.load(Path(verdict["runs"]["tuned"]) / "verify-step.pt", weights_only=True)
    tracked = {k: v for k, v in step["buffers"].items() if k.endswith("num_batches_tracked")}
    assert len(tracked) == 6 and all(float(v) == 1.0 for v in tracked.values()), tracked
    info = json.loads((Path(verdict["runs"]["tuned"]) / "verify-step.json").read_text())
    assert info["train_mode"] is True

    # the runtime without the buffers' protection (tests/bugs): the recomputation updates them again;
    # the gradients agree, so only the buffers can tell, and the verdict says so and names the buffer
    code, verdict, err = _verify(tmp_path, ckpt, *BATCHNORM, "--dropout", "0.2", name="bug.json",
                                 env=inject("no-keep-buffers"))
    assert code == 1, err[-3000:] + json.dumps(verdict)[-2000:]
    equivalence = {c["name"]: c for c in verdict["checks"]}["equivalence"]
    assert verdict["passed"] is False and verdict["failure"] == "buffers"
    assert equivalence["grad_rel"] <= verdict["bound"] and equivalence["param_rel"] <= equivalence["tolerance"][1]
    assert equivalence["buffer_rel"] > 1e-3
    worst = equivalence["worst_buffer"]
    assert worst.startswith("body.layers.") and worst.rsplit(".", 1)[1] in (
        "num_batches_tracked", "running_mean", "running_var"), worst
    assert f"worst buffer {worst}" in verdict["reason"] and "only the buffers differ" in verdict["reason"]
    assert "worst parameter" not in verdict["reason"], verdict["reason"]
    step = torch.load(Path(verdict["runs"]["tuned"]) / "verify-step.pt", weights_only=True)
    assert float(step["buffers"]["body.layers.0.norm.num_batches_tracked"]) == 2.0  # updated twice


def test_an_fp16_script_whose_first_step_overflows_verifies(tmp_path):
    # the loss x 1000 overflows fp16 at the GradScaler's initial scale (65536): the script's first
    # steps are skipped until the scale is low enough, in every fp16 run; the fp32 runs are unaffected
    cfg = BalanceConfig(micro_batches=[5, 11], global_batch=16, dtype="fp16")
    code, verdict, err = _verify(tmp_path, cfg, "--dtype", "fp16", "--loss-factor", "1000", "--micro-batch", "8")
    assert code == 0, err[-3000:] + json.dumps(verdict)[-3000:]
    assert verdict["passed"] is True
    assert [c["name"] for c in verdict["checks"]] == ["floor", "equivalence", "noise", "dtype"]
    assert all(c["grad_rel"] is not None for c in verdict["checks"])  # finite everywhere
    overflow = [n for n in verdict["notes"] if "overflow" in n]
    assert overflow and "GradScaler skipped" in overflow[0] and "baseline" in overflow[0] and "tuned" in overflow[0]
    assert "worst parameter )" not in verdict["reason"]
    skips = json.loads((Path(verdict["runs"]["tuned"]) / "verify-step.json").read_text())["overflow_skips"]
    assert skips >= 1


UNEVEN_FP16 = BalanceConfig(micro_batches=[5, 11], global_batch=16, dtype="fp16")


def test_fp16_clipping_while_scaled_is_refused_and_the_amp_recipe_verifies(tmp_path):
    """Fails if a script that clips its fp16 gradients while they are still scaled (clip_grad_norm_
    right before plan.optimizer_step) passes verify (issue 29: its own error, 1.0, used to set a
    bound of 4.0), or if one that unscales first (plan.scaler.unscale_, PyTorch's AMP recipe) is
    refused or has its gradients divided by the scale twice."""
    args = ("--dtype", "fp16", "--micro-batch", "8", "--loss-factor", "50")
    code, verdict, err = _verify(tmp_path, UNEVEN_FP16, *args, "--clip", "scaled", name="scaled.json")
    assert code == 1, err[-3000:] + json.dumps(verdict)[-2000:]
    assert verdict["failure"] == "baseline-precision", verdict["reason"]
    noise = {c["name"]: c for c in verdict["checks"]}["noise"]
    assert noise["grad_rel"] > 0.1
    assert "clipped while still scaled" in verdict["reason"] and "clip_grad_norm=" in verdict["reason"]
    assert "tuned" not in verdict["runs"]  # refused before the tuned fp16 run

    code, verdict, err = _verify(tmp_path, UNEVEN_FP16, *args, "--clip", "recipe", name="recipe.json")
    assert code == 0, err[-3000:] + json.dumps(verdict)[-2000:]
    checks = {c["name"]: c for c in verdict["checks"]}
    assert checks["noise"]["grad_rel"] < 0.05 and checks["dtype"]["passed"], checks


def test_a_train_only_batch_term_is_verified_in_train_mode(tmp_path):
    """Fails if verify runs the model in eval mode, where a load-balancing term computed only
    ``if self.training`` is absent and an uneven split passes (issue 29: [24, 40] passed with 2.1e-7),
    or if the script's functional dropout stays on in the dropout-off runs (the script's own split
    would then fail too)."""
    cfg = BalanceConfig(micro_batches=[5, 11], global_batch=16)
    code, verdict, err = _verify(tmp_path, cfg, "--aux", "train", "--dropout", "0.3", "--micro-batch", "8")
    assert code == 1, err[-3000:] + json.dumps(verdict)[-2000:]
    assert verdict["failure"] == "math", verdict["reason"]
    checks = {c["name"]: c for c in verdict["checks"]}
    assert checks["equivalence"]["grad_rel"] > 100 * checks["floor"]["grad_rel"]
    assert "a term computed over the whole micro-batch" in verdict["reason"]
    info = json.loads((Path(verdict["runs"]["tuned"]) / "verify-step.json").read_text())
    assert info["training"] is True and info["dropout_seen"] is True

    # the same split, the same model without the term: dropout held at 0 in train mode, it passes
    code, verdict, err = _verify(tmp_path, cfg, "--dropout", "0.3", "--micro-batch", "8", "--tf32", name="plain.json")
    assert code == 0, err[-3000:] + json.dumps(verdict)[-2000:]
    assert any("TF32 matmuls" in n and "held off" in n for n in verdict["notes"]), verdict["notes"]
