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
from pathlib import Path
from typing import Any

import pytest

from autobalance.diagnose import analyse
from autobalance.launcher import TrialOutcome
from autobalance.protocol import Status
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
    last = [line for line in out.splitlines() if line.strip()][-1]  # the line to paste: on CPU, the smallest cap
    assert last.startswith(f"autobalance tune {GPT} --nproc-per-node 2 --device cpu --memory-cap "), last
    assert last.endswith("MiB"), last


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
        "status": status, "config": {"dtype": "fp32"}, "step_time_s": 0.1,
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
    outcome = TrialOutcome(reports=dict(enumerate(reports)), status=Status(status), reason="measured",
                           trial_dir="/tmp/x")
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


# ---------------------------------------------------------------------- a slow rank, a model called twice, zero1
USER_TRAIN = str(Path(__file__).resolve().parent / "scripts" / "user_train.py")


@pytest.mark.slow
def test_diagnose_names_a_slow_rank_and_survives_a_model_called_twice_per_step(tmp_path: Path) -> None:
    """The script calls its model twice per micro-step (a no-grad pass first, as for a teacher's target):
    PyTorch's MemTracker used to raise inside that forward and diagnose said "the script failed at its own
    configuration". Rank 1 sleeps 50 ms per sample (16 samples: at least 800 ms of busy time per step,
    against rank 0's own work on a tiny model), so it is named slow with its figures whatever the load."""
    proc = cli(["diagnose", USER_TRAIN, "--nproc-per-node", "2", "--device", "cpu", "--runs-dir", str(tmp_path / "runs"),
                "--", "--no-grad-forward"], cwd=tmp_path, env={"AUTOBALANCE_EMULATE_MS_PER_SAMPLE": "0,50"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = " ".join(proc.stdout.split())
    assert "failed at its own configuration" not in out + proc.stderr
    for text in ("busy per step (own work)", "wait for the other ranks per step", "samples per step", "optimizer state",
                 "Module breakdown: the script calls its DistributedDataParallel more than once before the first "
                 "optimizer step", "(rank(s) 0, 1)", "1. rank 1 is slow:", "x the busy time per sample of rank 0",
                 "ms per sample): per optimizer step rank 1 is busy", "gives rank 1 fewer samples per step"):
        assert text in out, (text, out)
    # the slow rank's busy time holds at least its sleeps
    busy = re.search(r"busy per step \(own work\) +│ +([0-9.]+) ms │ +([0-9.]+) ms", proc.stdout)
    assert busy, proc.stdout
    assert float(busy.group(2)) >= 0.95 * 16 * 50


def _timed(rep: dict[str, Any], busy_s: float, wait_s: float, samples: int = 8) -> dict[str, Any]:
    rep.update(busy_time_s=busy_s, allreduce_wait_s=wait_s)
    rep["config"] = {"micro_batches": [samples, samples], "accumulation": 1, "global_batch": 2 * samples,
                     "dtype": "fp32"}
    return rep


def test_a_rank_slower_per_sample_is_named_with_its_figures() -> None:
    diag = _analyse(_timed(_report(0), 0.080, 0.090), _timed(_report(1), 0.170, 0.004))
    (finding,) = diag.findings
    assert finding.cause == "slow_rank" and finding.ranks == [1] and finding.size_bytes is None
    assert finding.title == "rank 1 is slow: 2.12x the busy time per sample of rank 0"
    assert ("rank 1 is 2.12x slower per sample than rank 0 (busy 21.2 vs 10 ms per sample): per optimizer step "
            "rank 1 is busy 170.0 ms for 8 samples, rank 0 80.0 ms for 8; rank 0 waits 90.0 ms") in finding.detail
    assert [r.samples_per_step for r in diag.ranks] == [8, 8]
    even = _analyse(_timed(_report(0), 0.080, 0.010), _timed(_report(1), 0.090, 0.004))
    assert even.findings == []  # within 1.2x: not named
    before = _analyse(_report(0), _report(1))  # reports from before busy times: nothing about time
    assert before.findings == [] and before.ranks[0].busy_time_s is None


def test_optimizer_state_is_its_own_row_and_zero1_shares_are_read_from_the_optimizer_section() -> None:
    from rich.console import Console

    r0, r1 = _report(0, opt=20 * MIB), _report(1, opt=20 * MIB)
    for rep, state in ((r0, 4 * MIB), (r1, 36 * MIB)):
        rep["optimizer"] = {"sharding": "zero1", "wrapped": True, "state_bytes": state}
    diag = _analyse(_timed(r0, 0.1, 0.01), _timed(r1, 0.1, 0.01))
    assert [r.optimizer_state for r in diag.ranks] == [4 * MIB, 36 * MIB]
    console = Console(record=True, width=160)
    from autobalance.diagnose import print_diagnosis

    print_diagnosis(diag, console=console)
    out = console.export_text()
    assert re.search(r"optimizer state \(zero1: its share\) +│ +4\.00 MiB │ +36\.0 MiB", out), out
    assert re.search(r"busy per step \(own work\) +│ +100\.0 ms │ +100\.0 ms", out), out
