"""`autobalance diagnose`: the per-rank breakdown and the likely causes.

The CLI tests run the GPT example for real (2 CPU ranks, gloo): rank 0 keeps an EMA copy of the
weights and a cached validation batch, and prints their size; diagnose must name them first with
that size. The analysis tests feed synthetic per-rank reports for the other causes.
"""

from __future__ import annotations

import glob
import json
import os
import re
from types import SimpleNamespace
from typing import Any

import pytest

from autobalance.diagnose import analyse
from tests.tune_helpers import GPT, cli

MIB = 2**20


def _printed_extras(trial_dir: str) -> float:
    """The bytes the example says rank 0 holds (its stdout: 'rank 0 extras: X MiB ...')."""
    logs = glob.glob(os.path.join(trial_dir, "logs", "**", "0", "stdout.log"), recursive=True)
    assert logs, trial_dir
    match = re.search(r"rank 0 extras: ([0-9.]+) MiB", open(logs[0]).read())
    assert match, logs[0]
    return float(match.group(1)) * MIB


@pytest.fixture(scope="module")
def diag_json(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("diagnose")
    proc = cli(["diagnose", GPT, "--nproc-per-node", "2", "--device", "cpu", "--json", "--runs-dir", str(root / "runs"),
                "--val-cache-mib", "32"], cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_rank0_extras_are_the_top_finding_with_the_size_the_example_allocates(diag_json: dict[str, Any]) -> None:
    top = diag_json["findings"][0]
    assert top["cause"] == "rank_extras"
    assert top["ranks"] == [0]
    printed = _printed_extras(diag_json["trial_dir"])
    assert printed > 32 * MIB
    assert top["size_bytes"] == pytest.approx(printed, rel=0.10)
    assert top["command"].startswith("autobalance tune ")
    assert "--nproc-per-node 2" in top["command"] and top["command"].endswith("-- --val-cache-mib 32")


@pytest.mark.slow
def test_json_carries_the_per_rank_breakdown(diag_json: dict[str, Any]) -> None:
    assert diag_json["status"] == "ok" and diag_json["world_size"] == 2
    r0, r1 = diag_json["ranks"]
    for r in (r0, r1):
        assert r["status"] == "ok"
        for key in ("parameters", "gradients", "optimizer_state", "activations_peak", "ddp_buckets", "peak_device"):
            assert r[key] > 0, key
        assert r["optimizer_state"] == pytest.approx(2 * r["parameters"], rel=0.01)  # AdamW: two moments
        assert r["gradients"] == r["parameters"]
        assert r["micro_batch"] == 8 and r["autocast"] == "off" and r["blocks"] == "0/4 checkpointed"
        assert r["allocator_cache"] is None and r["outside_pytorch"] is None  # CUDA-only figures
    assert r0["parameters"] == r1["parameters"]
    assert r0["held_outside_training"] - r1["held_outside_training"] == diag_json["findings"][0]["size_bytes"]
    assert r1["held_outside_training"] < 2 * MIB
    assert diag_json["spread_bytes"] == abs(r0["peak_device"] - r1["peak_device"])
    # PyTorch's MemTracker broke the first step down by category on each rank
    for rank in ("0", "1"):
        cats = diag_json["memtracker"][rank]["peak_by_category"]
        assert cats["parameter"] == r0["parameters"] and cats["activation"] > 0


@pytest.mark.slow
def test_diagnose_prints_a_readable_table_and_the_tune_command(tmp_path) -> None:
    proc = cli(["diagnose", GPT, "--nproc-per-node", "2", "--device", "cpu", "--runs-dir", str(tmp_path / "runs")],
               cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for text in ("Per-rank memory", "rank 0", "rank 1", "optimizer state", "activations (peak)",
                 "held outside training state", "Likely causes, largest first", "1. rank 0 holds",
                 "Run: autobalance tune"):
        assert text in out, text


def test_diagnose_of_a_missing_script_is_a_usage_error(tmp_path) -> None:
    proc = cli(["diagnose", str(tmp_path / "nope.py"), "--device", "cpu"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr


# ---------------------------------------------------------------------- analysis on synthetic reports
def _report(rank: int, *, peak: int = 100 * MIB, extras: int = 1 * MIB, acts: int = 20 * MIB, opt: int = 20 * MIB,
            params: int = 10 * MIB, numel: int = 256, autocast: dict[str, Any] | None = None, out_dtype: str = "float32",
            dp: bool = False, fup: bool = False, blocks: int = 4, ckpt: int = 0, micro_batch: int = 8,
            status: str = "ok") -> dict[str, Any]:
    return {
        "status": status, "config": {"dtype": "fp32"},
        "device": {"type": "cpu", "capacity_bytes": 64 * 2**30, "cap_bytes": None},
        "memory": {"peak_device": peak, "peak_allocated": peak, "peak_reserved": peak, "outside_pytorch": 0},
        "breakdown": {
            "bytes": {"held_at_wrap": params, "parameters": params, "gradients": params, "ddp_buckets": params,
                      "optimizer_state": opt, "optimizer_state_tensors": opt, "activations_peak": acts,
                      "held_outside_training": extras, "held_before_wrap_excluding_model": 0},
            "flags": {"data_parallel": dp, "find_unused_parameters": fup, "num_blocks": blocks,
                      "checkpointed_blocks": ckpt, "micro_batch": micro_batch,
                      "autocast": autocast or {"enabled": False, "dtype": None}, "input_shape": [8, numel // 8],
                      "input_numel": numel, "output_dtype": out_dtype},
            "memtracker_peak": None, "modules": [], "error": None,
        },
    }


def _analyse(*reports: dict[str, Any], status: str = "ok") -> Any:
    outcome = SimpleNamespace(reports=dict(enumerate(reports)), status=status, reason="measured", trial_dir="/tmp/x")
    return analyse(outcome, script="train.py", script_args=["--big"], world_size=len(reports), device="cuda",
                   nproc_per_node=len(reports))


def test_balanced_ranks_give_no_finding() -> None:
    diag = _analyse(_report(0), _report(1))
    assert diag.findings == []
    assert diag.tune_command == "autobalance tune train.py --nproc-per-node 2 --device cuda -- --big"


def test_uneven_inputs_and_amp_on_some_ranks_are_named() -> None:
    diag = _analyse(_report(0, numel=512, acts=40 * MIB),
                    _report(1, numel=256, acts=10 * MIB, autocast={"enabled": True, "dtype": "bfloat16"},
                            out_dtype="bfloat16"))
    causes = {f.cause: f for f in diag.findings}
    assert causes["uneven_inputs"].ranks == [0] and causes["uneven_inputs"].size_bytes == 30 * MIB
    assert causes["amp_some_ranks"].ranks == [0]  # the rank without autocast
    assert "--dtypes fp32,bf16 -- --big" in (causes["amp_some_ranks"].command or "")


def test_data_parallel_and_find_unused_parameters_are_named() -> None:
    diag = _analyse(_report(0, dp=True, fup=True), _report(1, dp=True, fup=True))
    assert {f.cause for f in diag.findings} == {"data_parallel", "find_unused_parameters"}
    assert all(f.size_bytes is None for f in diag.findings)


def test_deep_model_without_checkpointing_and_heavy_optimizer_state_are_named() -> None:
    deep = _analyse(_report(0, blocks=24, acts=60 * MIB), _report(1, blocks=24, acts=60 * MIB))
    assert [f.cause for f in deep.findings] == ["no_checkpointing"]
    assert deep.findings[0].size_bytes == 60 * MIB
    heavy = _analyse(_report(0, opt=50 * MIB), _report(1, opt=50 * MIB))
    assert [f.cause for f in heavy.findings] == ["optimizer_state"]


def test_findings_are_ordered_by_size_and_oom_comes_first() -> None:
    diag = _analyse(_report(0, extras=30 * MIB, numel=512, acts=25 * MIB, status="oom"),
                    _report(1, numel=256, acts=20 * MIB), status="oom")
    assert [f.cause for f in diag.findings] == ["oom", "rank_extras", "uneven_inputs"]
    assert diag.findings[1].size_bytes == 29 * MIB


def test_imbalance_causes_come_before_larger_pressure_shared_by_all_ranks() -> None:
    # the GPT example on 2 H200s: 6.2 GiB of activations on each rank (24 blocks, none checkpointed)
    # and 1.4 GiB of rank-0 extras; the extras are what makes the ranks differ
    diag = _analyse(_report(0, peak=14_500 * MIB, blocks=24, acts=6_300 * MIB, extras=1_450 * MIB),
                    _report(1, peak=13_100 * MIB, blocks=24, acts=6_300 * MIB, extras=70 * MIB))
    assert [f.cause for f in diag.findings] == ["rank_extras", "no_checkpointing"]


def test_a_loss_outside_the_wrapped_model_is_named_with_the_logits_size() -> None:
    """Fails if diagnose stops reading ``loss_in_model`` / ``output_bytes`` from the rank reports."""
    outside = [_report(r) for r in range(2)]
    for rep in outside:
        rep["breakdown"]["flags"].update(loss_in_model=False, output_bytes=30 * MIB)
    causes = {f.cause: f for f in _analyse(*outside).findings}
    finding = causes["loss_outside_model"]
    assert finding.size_bytes == 30 * MIB and finding.ranks == [0, 1]
    assert "loss=" in finding.action
    inside = [_report(r) for r in range(2)]
    for rep in inside:
        rep["breakdown"]["flags"].update(loss_in_model=True, output_bytes=30 * MIB)
    assert "loss_outside_model" not in {f.cause for f in _analyse(*inside).findings}
