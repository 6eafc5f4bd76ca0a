"""GPU smoke suite: the paths that unit tests only reach through fakes, on a real device.

One rank per job, so one GPU is enough. On CUDA: the allocator's cap
(``set_per_process_memory_fraction``) turning a too-large allocation into a real CUDA OOM, NVML's
per-process figures (memory outside PyTorch), fp16 with a GradScaler skipping an overflowing step,
``--cap-mode judge``, a two-trial study in the warm worker pool, ``verify`` of a compiled
configuration (Inductor), and the hardware fingerprint. Without CUDA every test skips with the
reason, or runs on CPU under AUTOBALANCE_GPU_SMOKE_ON_CPU=1 (see conftest.py).

    python3 -m pytest tests/gpu -q -rs          # on the GPU machine, a few minutes
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tune_helpers import GPT, REPO, cli, load

GIB = 2**30
MLP = str(REPO / "examples" / "mlp" / "train.py")
CAP_GIB = 0.5
CACHE_MIB = 768
"""The GPT example's rank-0 cached batch: one allocation larger than the cap."""
FAST_COMPILE_ON_CPU = {"AUTOBALANCE_COMPILE_BACKEND": "aot_eager_decomp_partition"}


def tune(tmp_path: Path, device: str, *extra: str, trials: int, script_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    args = ["tune", GPT, "--trials", str(trials), "--nproc-per-node", "1", "--device", device,
            "--storage", f"sqlite:///{tmp_path / 'a.db'}", "--study-name", "s", "--strategy", "optuna",
            "--seed", "0", "--trial-timeout", "240", "--runs-dir", str(tmp_path / "runs"), "--no-verify", *extra]
    if script_args:
        args += ["--", *script_args]
    return cli(args, cwd=tmp_path, timeout=600)


def test_fingerprint_names_this_device(device: str) -> None:
    """The fingerprint reads the device itself: name and memory as torch sees them, the CUDA
    version of this torch; a cap is the usable memory; another GPU model is a difference."""
    import torch

    from autobalance.store import current_fingerprint, differences

    fp = current_fingerprint(device_type=device, world_size=1, cap_bytes=GIB)
    assert fp.device_type == device and fp.world_size == 1
    assert fp.torch_version == torch.__version__
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        assert fp.device_name == props.name
        # NVML's total and the CUDA runtime's total differ by the driver's reservation only
        assert abs(fp.capacity_bytes[0] - props.total_memory) <= 0.03 * props.total_memory, (fp, props)
        assert fp.cuda_version == torch.version.cuda
        other = current_fingerprint(device_type="cuda", world_size=1, cap_bytes=GIB)
        other.device_name = "NVIDIA Some Other GPU"
        assert differences(fp, other) == [f"GPU {fp.device_name!r} (tuned) vs 'NVIDIA Some Other GPU' (this job)"]
    else:
        with open("/proc/meminfo") as fh:
            total = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemTotal:"))
        assert abs(fp.capacity_bytes[0] - total) <= 0.01 * total
    assert fp.usable_bytes(0) == GIB
    assert differences(fp, current_fingerprint(device_type=device, world_size=1, cap_bytes=GIB)) == []


_FP16_SCRIPT = r"""
import json, sys
import torch
from torch import nn
import autobalance as ab

device = sys.argv[1]
plan = ab.plan(config=ab.BalanceConfig(micro_batches=[4], global_batch=4, dtype="fp16"), device=device)
torch.manual_seed(0)
model = plan.wrap(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
data = torch.utils.data.TensorDataset(torch.randn(12, 8), torch.randn(12, 1))
loader = plan.dataloader(data, shuffle=False)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
steps = []
for i, micro_batches in enumerate(plan.steps(loader)):
    before = [p.detach().clone() for p in model.parameters()]
    scale = float(plan.scaler.get_scale())
    for x, y in micro_batches:
        x, y = x.to(plan.device), y.to(plan.device)
        with plan.micro_step():
            out = model(x)
            loss = ((out.float() - y) ** 2).mean()
            if i == 1:
                loss = loss * 1e30  # fp32 loss; its fp16 gradients overflow to inf
            plan.backward(loss)
    plan.optimizer_step(opt)
    changed = any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    steps.append({"scale_before": scale, "scale_after": float(plan.scaler.get_scale()), "changed": changed,
                  "activation_dtype": str(out.dtype)})
print(json.dumps({"scaler": type(plan.scaler).__name__, "device": str(plan.device), "steps": steps}))
"""


def test_fp16_grad_scaler_skips_an_overflowing_step_and_halves_its_scale(device: str, tmp_path: Path) -> None:
    """fp16 through the plan: autocast runs the model in float16, the GradScaler scales the loss,
    skips the step whose gradients overflowed (weights unchanged) and halves its scale; the steps
    around it update the weights."""
    script = tmp_path / "fp16.py"
    script.write_text(_FP16_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), device], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["scaler"] == "GradScaler" and result["device"].startswith(device)
    first, overflow, third = result["steps"]
    assert all(s["activation_dtype"] == "torch.float16" for s in result["steps"])
    assert first["changed"] and first["scale_after"] == first["scale_before"] == 65536.0
    assert not overflow["changed"] and overflow["scale_after"] == overflow["scale_before"] / 2
    assert third["changed"] and third["scale_before"] == 32768.0


def test_capped_oom_comes_from_the_allocator(device: str, tmp_path: Path) -> None:
    """--memory-cap-gib 0.5 (enforced): the rank's allocator is limited to 0.5 GiB, so the 768 MiB
    cached batch raises a real out-of-memory error (CUDA: the caching allocator's "Tried to
    allocate"; CPU: the memory tracker's budget); the trial is recorded oom and infeasible."""
    proc = tune(tmp_path, device, "--cold", "--memory-cap-gib", str(CAP_GIB), trials=1,
                script_args=("--val-cache-mib", str(CACHE_MIB)))
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    trials = load(tmp_path / "a.db").get_trials()
    assert len(trials) == 1, proc.stderr[-3000:]
    attrs = trials[0].user_attrs
    assert attrs["status"] == "oom", attrs.get("reason")
    assert attrs["feasible"] is False
    assert attrs["capacity_gib"] == [CAP_GIB]
    expected = "Tried to allocate" if device == "cuda" else "memory budget exceeded"
    assert expected in attrs["reason"], attrs["reason"]


def test_judge_mode_in_a_warm_two_trial_study_with_nvml_figures(device: str, tmp_path: Path) -> None:
    """--cap-mode judge: the ranks run uncapped, so the 768 MiB batch fits and is measured, and the
    trial is judged infeasible against the 0.5 GiB cap (no OOM, no pool restart). Two trials in one
    warm pool: the first starts it, the second reuses it. On CUDA the peak includes memory outside
    PyTorch as NVML attributes it to the rank's process (the CUDA context: tens of MiB at least)."""
    proc = tune(tmp_path, device, "--cap-mode", "judge", "--memory-cap-gib", str(CAP_GIB), trials=2,
                script_args=("--val-cache-mib", str(CACHE_MIB)))
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    trials = load(tmp_path / "a.db").get_trials()
    assert len(trials) == 2, proc.stderr[-3000:]
    for t in trials:
        a = t.user_attrs
        assert a["status"] == "ok", a.get("reason")
        assert a["feasible"] is False and t.system_attrs["constraints"][0] > 0
        assert a["peak_device_gib"][0] > CACHE_MIB / 1024  # measured uncapped, above the cap
        assert a["capacity_gib"] == [CAP_GIB]
        outside = a["outside_pytorch_gib"][0]
        assert a["peak_device_gib"][0] == pytest.approx(a["peak_reserved_gib"][0] + outside, abs=2e-4)
        if device == "cuda":
            assert outside > 0.03, a  # NVML saw this process's CUDA context
        else:
            assert outside == 0
    assert trials[0].user_attrs.get("pool_start_s", 0) > 0  # the first trial started the warm pool
    assert "pool_start_s" not in trials[1].user_attrs  # the second ran in it


def test_verify_passes_a_compiled_configuration(device: str, tmp_path: Path) -> None:
    """A compiled configuration with an activation budget of 0.5 (the partitioner recomputes):
    verify compares it with the script's own eager step (equivalence); the MLP has no dropout, so
    the recomputation has no random masks to replay and the dropout runs are skipped. CUDA: Inductor; CPU: the same
    partitioner with the aot_eager_decomp_partition backend."""
    from autobalance import BalanceConfig

    cfg = BalanceConfig(micro_batches=[16], global_batch=16, compile="default", activation_budget=[0.5])
    path = tmp_path / "c.json"
    path.write_text(cfg.to_json())
    proc = cli(["verify", MLP, "--config", str(path), "--device", device, "--nproc-per-node", "1",
                "--runs-dir", str(tmp_path / "runs"), "--json"], cwd=tmp_path, timeout=600,
               env=FAST_COMPILE_ON_CPU if device == "cpu" else None)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    verdict = json.loads(proc.stdout)
    assert verdict["passed"] is True, verdict
    checks = {c["name"]: c for c in verdict["checks"]}
    assert checks["equivalence"]["passed"] and checks["equivalence"]["grad_rel"] <= verdict["bound"] <= 1e-4, checks
    # the budget recomputes, but this MLP has no dropout: no random masks to replay, so no dropout runs
    assert "rng-replay" not in checks and not any("dropout" in name for name in verdict["runs"]), verdict["runs"]


def test_a_warm_pool_lifts_a_trials_cap_for_the_next_run_without_one(device: str, tmp_path: Path) -> None:
    """What verification in the study's own workers relies on: the cap is per run. One warm pool
    runs a small trial under a 1 GiB cap, then a large run without a cap (a verification run after a
    capped study's trials) that needs more than that cap: the large run succeeds and is measured
    above the cap, in the same workers (CUDA: the allocator's memory fraction is reset before each
    run; without the reset it runs out of memory). Then the small trial capped again: still under."""
    from autobalance import BalanceConfig
    from autobalance.launcher import TrialLaunch, WarmPool, trial_processes

    cap = GIB
    template = TrialLaunch(script=GPT, script_args=["--block-size", "256", "--samples", "1024", "--no-ema",
                                                    "--val-cache-mib", "512"],
                           nproc_per_node=1, device=device, steps=1, warmup=0, trial_dir=str(tmp_path / "t"),
                           timeout_s=240)
    small = BalanceConfig(micro_batches=[8], global_batch=8).to_json()
    large = BalanceConfig(micro_batches=[256], global_batch=256).to_json()
    runs = [("small-capped", small, [cap]), ("large-uncapped", large, None), ("small-capped-again", small, [cap])]
    pool = WarmPool(template=template, pool_dir=str(tmp_path / "pool"))
    peaks = {}
    try:
        for name, config, caps in runs:
            run = TrialLaunch(**{**template.__dict__, "config_json": config, "memory_cap_bytes": caps,
                                 "trial_dir": str(tmp_path / name), "trial_id": f"{name}-{pool.seq}"})
            assert pool.serves(run)
            outcome = pool.run(run)
            assert outcome.status == "ok", (name, outcome.reason)
            peaks[name] = outcome.reports[0].memory.peak_allocated
        assert pool.starts == 1  # all three in the same workers
        pool_id = pool.pool_id
    finally:
        pool.close()
    assert trial_processes(pool_id) == []
    assert peaks["small-capped"] < cap and peaks["small-capped-again"] < cap, peaks
    assert peaks["large-uncapped"] > 1.2 * cap, peaks  # it needed more than the cap it was not given
