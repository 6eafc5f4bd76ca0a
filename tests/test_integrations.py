"""Issue 35: the Lightning, Hugging Face Trainer and Accelerate integrations.

- the core imports no framework, and ``autobalance.integrations`` none until a module of it is imported;
- the rank weighting hook: DDP's all-reduce gives ``w_r * g_r`` summed, not the average;
- the loss factor of micro-steps of unequal sizes, and the full-step batch sampler;
- CPU, gloo, 2 and 3 ranks: each integration, with an uneven split, accumulation of micro-steps of
  unequal sizes and checkpointing, gives one process's full-batch SGD update within 1e-6 over 3 steps,
  where DDP's plain average is off by more than 1e-3 (so removing the hook fails the test);
- ``tune`` on ``examples/lightning``, ``examples/hf`` and ``examples/accelerate``, rank 0 holding extras and emulated slower,
  saves a verified uneven configuration (rank 0 fewer samples) that a production run then loads (by
  study name, and from an exported file).

The frameworks are in the ``test`` extra (CI installs them); ``importorskip`` only spares a bare install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autobalance._config import BalanceConfig
from autobalance.runtime import (
    FullStepSampler,
    micro_step_factor,
    rank_weight,
    register_rank_weighting,
)
from tests.tune_helpers import REPO, cli

FRAMEWORKS = ("lightning", "transformers", "accelerate")


def test_core_imports_no_framework():
    """Fails if the core (or the integrations package itself) imports Lightning, transformers or Accelerate."""
    code = ("import sys, autobalance, autobalance.runtime, autobalance.integrations, autobalance.tuner, "
            "autobalance.cli, autobalance.store, autobalance.verify; "
            f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_rank_weighting_hook_scales_the_all_reduce(tmp_path):
    """One gloo rank: the all-reduced gradient is ``weight`` times the local one (DDP's average would
    leave it unchanged); the hook ran."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = nn.Linear(4, 3)
        weighted = nn.Linear(4, 3)
        weighted.load_state_dict(plain.state_dict())
        ddp = nn.parallel.DistributedDataParallel(weighted)
        state = register_rank_weighting(ddp, weight=0.25)
        x = torch.randn(5, 4)
        plain(x).square().mean().backward()
        ddp(x).square().mean().backward()
        assert state.calls >= 1
        for a, b in zip(plain.parameters(), weighted.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            torch.testing.assert_close(b.grad, 0.25 * a.grad)
    finally:
        dist.destroy_process_group()


def test_micro_step_factor_makes_unequal_micro_steps_a_rank_mean():
    """Rank 0 of 7+4 in 2 micro-steps (4, 3): factor/accumulation times each micro-batch's mean sums to
    the mean over its 7 samples; rank weights are n_r / N."""
    config = BalanceConfig.any_split(rank_samples=[7, 4], accumulation=2)
    values = torch.arange(7, dtype=torch.float64)
    sizes = config.micro_step_sizes(0)
    assert sizes == [4, 3]
    chunks = torch.split(values, sizes)
    total = sum(micro_step_factor(config, 0, m) / config.accumulation * chunk.mean() for m, chunk in enumerate(chunks))
    assert float(total) == pytest.approx(float(values.mean()), rel=1e-12)
    assert micro_step_factor(config, 1, 0) == 1.0  # 2, 2: equal micro-steps need no factor
    assert [rank_weight(config, r) for r in (0, 1)] == [7 / 11, 4 / 11]


@pytest.mark.parametrize(("dtype", "mixed", "matmul"), [("bf16", "bf16", "bfloat16"), ("fp32", "no", "float32")])
def test_hf_trainer_runs_in_the_configurations_dtype(dtype, mixed, matmul):
    """The script's TrainingArguments say nothing of precision; the plan's dtype reaches the Trainer's
    Accelerator and its autocast. transformers resolves ``mixed_precision`` when the arguments are
    built, so setting ``bf16=True`` afterwards alone ran bf16 configurations in fp32 (this fails then)."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "hf_precision.py"), dtype],
                          capture_output=True, text=True, cwd=REPO, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert result == [[mixed, matmul]], proc.stdout[-2000:]


def test_hf_trainer_owns_checkpointing_and_takes_the_scripts_as_its_default():
    """TrainingArguments(gradient_checkpointing=True) and no plan: the script's default is every block
    checkpointed, autobalance wraps them, and transformers' own checkpointing stays off (on top, it
    recomputed every block whatever the configuration said, so what a trial measured was not its
    configuration). transformers 5.25 calls it activation_checkpointing, 4.x gradient_checkpointing.
    Its ``torch_compile`` is turned off the same way: the configuration compiles, or not."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "hf_checkpointing.py")],
                          capture_output=True, text=True, cwd=REPO, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert result == [["0,1,2", "False", "3", "False"]], proc.stdout[-2000:]


@pytest.mark.parametrize(("mode", "words"), [
    ("ok", "ok"),
    ("dtype", "Accelerator(mixed_precision='no') but th"),
    ("dynamo", "Accelerator(dynamo_backend='inductor') w"),
])
def test_accelerate_refuses_an_accelerator_built_against_the_configuration(mode, words):
    """An Accelerator whose mixed precision is not the configuration's ran the trial in another dtype than
    the one measured; one with its own dynamo backend compiled the prepared model on top of the
    configuration's compile. Both are refused at prepare(), with the fix named."""
    pytest.importorskip("accelerate")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "accelerate_mismatch.py"), mode],
                          capture_output=True, text=True, cwd=REPO, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert result == [words], proc.stdout[-2000:]


class _Loop:
    def __init__(self) -> None:
        self.epochs = 0

    def epoch_started(self, schedule) -> None:
        self.epochs += 1


def test_full_step_sampler_drops_the_partial_step_and_reshuffles_per_epoch():
    config = BalanceConfig.any_split(rank_samples=[7, 4], accumulation=2)
    loop = _Loop()
    sampler = FullStepSampler(loop=loop, num_samples=3 * 11 + 5, config=config, rank=0, seed=0)  # type: ignore[arg-type]
    first = list(sampler)
    assert [len(mb) for mb in first] == [4, 3] * 3 and len(sampler) == 6
    assert sampler.schedule.dropped == 5
    second = list(sampler)
    assert loop.epochs == 2 and first != second


def _torchrun(nproc: int, args: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", *args], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_each_integration_gives_the_full_batch_update(tmp_path, world):
    """Uneven ranks (7+4, 6+3+2), two micro-steps of unequal sizes, different checkpointed blocks per
    rank, 3 SGD steps: every integration within 1e-6 of one process on the whole global batches."""
    for name in FRAMEWORKS:
        pytest.importorskip(name)
    out = tmp_path / "exact.json"
    proc = _torchrun(world, ["tests/integrations_exact.py", str(out), "lightning,hf,accelerate"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert sorted(results) == ["accelerate", "hf", "lightning"]
    for name, r in results.items():
        assert r["rel_error"] <= 1e-6, (name, r)
        assert r["rel_error_unweighted"] > 1e-3, (name, r)  # the split matters: without the hook this fails
        assert r["hook_calls"] >= 3, (name, r)


def _saved_config(db: Path, study: str) -> BalanceConfig:
    proc = cli(["export", "--study-name", study, "--storage", f"sqlite:///{db}", "-o", str(db.parent / "best.json")],
               cwd=db.parent, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((db.parent / "best.json").read_text())
    return BalanceConfig.from_dict(data.get("config", data))


#: rank 0 is emulated 100 ms per sample slower (``runtime/_emulate.py``: a slower GPU, issue 33) and also
#: holds the extras: the fastest configuration that fits gives rank 0 fewer samples than rank 1, by
#: construction (an even split costs at least 8 x 100 ms on rank 0). The HF study needs five trials:
#: on CPU its memory model fits a per-sample slope only once a trial has varied the micro-batch
#: (seed 0's first two sampled trials run micro-batch 1 on both ranks, then 3 / 1).
SLOW_RANK0 = {"AUTOBALANCE_EMULATE_MS_PER_SAMPLE": "100,0"}


@pytest.mark.slow
@pytest.mark.parametrize(("example", "framework", "cap_gib", "trials", "script_args", "load"), [
    ("lightning", "lightning", "0.015", "3", ["--samples", "384", "--rank0-extra-mib", "4"], "study"),
    # 6 trials: the reference run that fixes the exchange rate (its own configuration fits nowhere) takes one
    ("hf", "transformers", "0.0127", "6", ["--samples", "256", "--rank0-extra-mib", "3"], "file"),
    ("accelerate", "accelerate", "0.015", "3", ["--samples", "384", "--rank0-extra-mib", "4"], "file"),
])
def test_tune_example_saves_a_verified_uneven_configuration_and_production_loads_it(
        tmp_path, example, framework, cap_gib, trials, script_args, load):
    """The script's own split does not fit under the cap on rank 0 (it holds extras), and rank 0 is
    the slow rank (:data:`SLOW_RANK0`): tune finds an uneven split that gives rank 0 fewer samples and
    fits on every rank, verifies it and saves it; a production run of the script loads it.

    Lightning broadcasts a flag before every micro-batch (a collective), so without that wait counted
    as wait (``FrameworkLoop.waiting``) the fast rank's busy time holds the slow rank's work, and the
    study gives rank 0 more samples (seed 0: 20 against 12): this test fails. Accelerate keeps its
    state per process, and verification runs the fp32 and bf16 runs in one warm worker: without
    ``AccelerateBalance`` clearing it there, verification fails and nothing is saved."""
    pytest.importorskip(framework)
    db = tmp_path / "ab.db"
    script = str(REPO / "examples" / example / "train.py")
    proc = cli(["tune", script, "--trials", trials, "--seed", "0", "--nproc-per-node", "2", "--device", "cpu",
                "--storage", f"sqlite:///{db}", "--study-name", example, "--memory-cap-gib", cap_gib,
                "--trial-timeout", "120", "--runs-dir", str(tmp_path / "runs"), "--", *script_args],
               cwd=tmp_path, timeout=600, env=SLOW_RANK0)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Verified trial" in proc.stdout and "Saved trial" in proc.stdout, proc.stdout[-3000:]
    config = _saved_config(db, example)
    figures = json.loads((tmp_path / "best.json").read_text())["figures"]
    assert figures["baseline"]["status"] == "oom", figures["baseline"]  # the script's own split does not fit
    assert figures["status"] == "ok" and figures["verification"]["passed"], figures
    assert max(figures["peak_device_gib"]) <= float(cap_gib), figures  # it fits on every rank, rank 0 too
    samples = config.samples_per_rank
    assert samples[0] < samples[1], (samples, proc.stdout[-3000:])  # uneven, away from the slow rank
    env = {"AUTOBALANCE_STUDY": example, "AUTOBALANCE_STORAGE": f"sqlite:///{db}"} if load == "study" else \
        {"AUTOBALANCE_CONFIG_FILE": str(tmp_path / "best.json")}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", script, *script_args], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("autobalance: using")]
    assert lines and all(part in lines[0] for part in config.split_lines()), lines
