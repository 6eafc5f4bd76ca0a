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
    assert verdict["passed"] is False
    equivalence = verdict["checks"][0]
    assert equivalence["name"] == "equivalence" and equivalence["runs"] == ["tuned-fp32", "baseline-fp32"]
    assert equivalence["tolerance"] == [1e-6, 1e-6, 1e-6]
    assert equivalence["grad_rel"] > 1e-3
    assert "both run in fp32" in verdict["reason"] and "per-sample mean" in verdict["reason"]
    assert "reduction='sum'" in verdict["reason"]
    assert "tuned" not in verdict["runs"]  # the dtype's own run is not even needed


BATCHNORM = ("--norm", "batch", "--micro-batch", "8")


def test_batchnorm_model_is_verified_in_train_mode(tmp_path):
    # an uneven split changes what BatchNorm normalises with: in train mode the step differs
    code, verdict, err = _verify(tmp_path, BalanceConfig(micro_batches=[5, 11], global_batch=16), *BATCHNORM)
    assert code == 1, err[-3000:]
    assert verdict["passed"] is False and verdict["checks"][0]["grad_rel"] > 1e-3
    assert any("batch-dependent layers (body.layers.0.norm (BatchNorm1d)" in n and "train mode" in n
               for n in verdict["notes"]), verdict["notes"]


def test_checkpointed_batchnorm_updates_running_stats_once_and_verify_catches_a_second_update(tmp_path):
    """Fails if checkpointing recomputes BatchNorm's buffer update (the no-keep-buffers mutation passes verify)."""
    # the script's split with every BatchNorm block checkpointed (rank 0: verify reads rank 0's buffers):
    # the same step, running statistics included
    ckpt = BalanceConfig(micro_batches=[8, 8], global_batch=16, checkpoint=[[0, 1, 2, 3, 4, 5], [0, 1]])
    code, verdict, err = _verify(tmp_path, ckpt, *BATCHNORM, name="ckpt.json")
    assert code == 0, err[-3000:] + json.dumps(verdict)[-2000:]
    checks = {c["name"]: c for c in verdict["checks"]}
    assert checks["equivalence"]["grad_rel"] <= 1e-6 and checks["equivalence"]["buffer_rel"] <= 1e-6
    assert checks["rng-replay"]["buffer_rel"] <= 1e-6
    step = torch.load(Path(verdict["runs"]["tuned"]) / "verify-step.pt", weights_only=True)
    tracked = {k: v for k, v in step["buffers"].items() if k.endswith("num_batches_tracked")}
    assert len(tracked) == 6 and all(float(v) == 1.0 for v in tracked.values()), tracked
    info = json.loads((Path(verdict["runs"]["tuned"]) / "verify-step.json").read_text())
    assert info["train_mode"] is True

    # the runtime without the buffers' protection (tests/bugs): the recomputation updates them again;
    # the gradients agree, so only the buffers can tell, and the verdict says so and names the buffer
    code, verdict, err = _verify(tmp_path, ckpt, *BATCHNORM, name="bug.json", env=inject("no-keep-buffers"))
    assert code == 1, err[-3000:] + json.dumps(verdict)[-2000:]
    equivalence = verdict["checks"][0]
    assert verdict["passed"] is False and equivalence["name"] == "equivalence"
    assert equivalence["grad_rel"] <= 1e-6 and equivalence["param_rel"] <= 1e-6 and equivalence["buffer_rel"] > 1e-3
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
    assert [c["name"] for c in verdict["checks"]] == ["equivalence", "noise", "dtype"]
    assert all(c["grad_rel"] is not None for c in verdict["checks"])  # finite everywhere
    overflow = [n for n in verdict["notes"] if "overflow" in n]
    assert overflow and "GradScaler skipped" in overflow[0] and "baseline" in overflow[0] and "tuned" in overflow[0]
    assert "worst parameter )" not in verdict["reason"]
    skips = json.loads((Path(verdict["runs"]["tuned"]) / "verify-step.json").read_text())["overflow_skips"]
    assert skips >= 1
