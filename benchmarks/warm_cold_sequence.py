"""Warm trials measured as cold ones: the acceptance sequence of the warm-pool issue, on ONE GPU.

In one warm pool: eager A, compiled B (fp32), eager A, compiled C (budget 0.3), eager A, compiled C
again, eager A; then each configuration once cold (a fresh torchrun job each). The cold runs come
first (a warm pool alive at the same time would hold memory on the GPU), sharing one Inductor cache
with the warm ones. Checks, per warm trial against the cold run of its configuration:

- peak device memory (allocator peak reserved + outside PyTorch) within 2 % or 64 MiB;
- A's four step times within +-3 % of their median, C's two likewise;
- the compiling step's peak and the steady state's peak, both reported.

Writes ``$OUT/warm_cold_sequence.json`` and ``$OUT/warm_cold_sequence.md`` (a table for
``benchmarks/RESULTS.md``); exit code 0 whether or not the checks pass (the table says).

    python benchmarks/warm_cold_sequence.py                      # one H200: ~270M GPT, cap 16 GiB
    python benchmarks/warm_cold_sequence.py --cpu-smoke          # the same sequence, tiny, on CPU

``--inductor-cache DIR`` keeps Inductor's cache there (default: a fresh one under the run's
directory); ``--cache-tar PATH`` unpacks a tarball of it first and writes it back afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autobalance import BalanceConfig
from autobalance.launcher import TrialLaunch, TrialOutcome, WarmPool, run_trial, trial_processes
from benchmarks.common import GPT, write_result

GIB = 2**30
MIB = 2**20
# ~270M parameters (16 x 1024, 1024 tokens, 32k vocabulary); rank 0 (the only rank) keeps an EMA
# copy and a 3 GiB cached validation batch, as in the study the issue reports
GPU_ARGS = ["--n-layer", "16", "--n-embd", "1024", "--n-head", "16", "--block-size", "1024", "--vocab", "32768",
            "--samples", "2048", "--micro-batch", "8", "--accumulation", "4", "--val-cache-mib", "3072",
            "--dropout", "0.0"]
CPU_ARGS = ["--samples", "2048", "--micro-batch", "8", "--accumulation", "4", "--dropout", "0.0"]
SEQUENCE = ["A", "B", "A", "C", "A", "C", "A"]


def configs(cpu: bool) -> dict[str, BalanceConfig]:
    """A: eager bf16 4 x 8 with 3 blocks checkpointed; B: compiled fp32 2 x 16; C: compiled bf16 8 x 4
    at activation budget 0.3. The same global batch (32 samples) throughout."""
    low = "bf16" if not cpu else "fp32"  # bf16 autocast on CPU is slow and not what is measured here
    return {
        "A": BalanceConfig(micro_batches=[4], accumulation=8, global_batch=32, dtype=low, checkpoint=[[0, 1, 2]]),
        "B": BalanceConfig(micro_batches=[2], accumulation=16, global_batch=32, dtype="fp32", compile="default",
                           activation_budget=[0.5]),
        "C": BalanceConfig(micro_batches=[8], accumulation=4, global_batch=32, dtype=low, compile="default",
                           activation_budget=[0.3]),
    }


def figures(outcome: TrialOutcome) -> dict[str, Any]:
    rep = outcome.reports[0].to_dict() if 0 in outcome.reports else {}
    mem = rep.get("memory") or {}
    times = rep.get("step_times_s") or []
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else None
    median = statistics.median(times) if times else None
    compile_step = mem.get("compile_step") or {}
    steady = mem.get("steady") or {}
    warm = rep.get("warm") or {}
    comp = rep.get("compile") or {}

    def gib(v: Any) -> float | None:
        return None if v is None else round(float(v) / GIB, 4)

    return {
        "status": outcome.status, "reason": outcome.reason if outcome.status != "ok" else "",
        "wall_s": round(outcome.wall_s, 2), "pool_start_s": round(outcome.pool_start_s, 2),
        "peak_device_gib": gib(mem.get("peak_device")), "peak_reserved_gib": gib(mem.get("peak_reserved")),
        "peak_allocated_gib": gib(mem.get("peak_allocated")), "outside_pytorch_gib": gib(mem.get("outside_pytorch")),
        "nvml_scope": mem.get("nvml_scope"),
        "compile_peak_gib": gib(compile_step.get("peak_device")),
        "compile_peak_reserved_gib": gib(compile_step.get("peak_reserved")),
        "steady_peak_gib": gib(steady.get("peak_device")),
        "steady_peak_reserved_gib": gib(steady.get("peak_reserved")),
        "step_time_ms": None if median is None else round(1000 * median, 3),
        "step_iqr_pct": None if (q is None or not median) else round(100 * (q[2] - q[0]) / median, 2),
        "measured_steps": len(times), "step_times_ms": [round(1000 * t, 3) for t in times],
        "compile_s": comp.get("compile_s"), "fx_graph_hits": (comp.get("cache") or {}).get("fx_graph_hits"),
        "pool_trial": warm.get("pool_trial"), "inherited_outside_gib": gib(warm.get("inherited_outside")),
        "fresh_outside_gib": gib(warm.get("fresh_outside")), "start_reserved_gib": gib(warm.get("start_reserved")),
        "after_outside_gib": gib(warm.get("after_outside")), "recycled": outcome.recycled,
    }


def gpu_processes() -> str:
    """Who holds the GPU now (pids and MiB): shows leftover compile workers or pools."""
    try:
        return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def checks(cold: dict[str, dict[str, Any]], warm: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    memory = []
    for i, (name, w) in enumerate(warm):
        c = cold.get(name) or {"peak_device_gib": None, "step_time_ms": None}
        ok = None
        diff = None
        if w["peak_device_gib"] is not None and c["peak_device_gib"] is not None:
            diff = w["peak_device_gib"] - c["peak_device_gib"]
            tol = max(0.02 * c["peak_device_gib"], 64 / 1024)
            ok = abs(diff) <= tol
        memory.append({"trial": i + 1, "config": name, "warm_gib": w["peak_device_gib"], "cold_gib": c["peak_device_gib"],
                       "diff_mib": None if diff is None else round(diff * 1024, 1), "within": ok})
    times: dict[str, Any] = {}
    for name in ("A", "C"):
        runs = [w["step_time_ms"] for n, w in warm if n == name and w["step_time_ms"] is not None]
        if runs:
            mid = statistics.median(runs)
            worst = max(abs(r / mid - 1) for r in runs)
            times[name] = {"runs_ms": runs, "cold_ms": (cold.get(name) or {}).get("step_time_ms"), "median_ms": round(mid, 3),
                           "worst_dev_pct": round(100 * worst, 2), "within_3pct": worst <= 0.03}
    return {"memory": memory, "memory_all_within": bool(memory) and all(m["within"] for m in memory),
            "step_times": times, "step_times_all_within": bool(times) and all(t["within_3pct"] for t in times.values())}


def markdown(result: dict[str, Any]) -> str:
    def f(v: Any, nd: int = 3) -> str:
        return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))

    partial = "" if result.get("complete") else " - PARTIAL (cut short)"
    lines = [f"### Warm trials against cold runs, one GPU ({result['date']}, {result['device_name']}){partial}", "",
             f"`{result['command']}`; script args `{' '.join(result['script_args'])}`; cap "
             f"{result['memory_cap_gib']} GiB; {result['steps']} measured steps after {result['warmup']} warm-up.", "",
             "| # | run | config | status | peak device GiB | reserved | outside PyTorch | compile-step peak | "
             "steady peak | step ms | IQR % | steps | pool trial | inherited outside | recycled after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [(f"cold {n}", n, c) for n, c in result["cold"].items()]
    rows += [(f"warm {i + 1}", n, w) for i, (n, w) in enumerate(result["warm"])]
    for i, (run, n, r) in enumerate(rows):
        lines.append(f"| {i + 1} | {run} | {n} | {r['status']} | {f(r['peak_device_gib'])} | {f(r['peak_reserved_gib'])} | "
                     f"{f(r['outside_pytorch_gib'])} | {f(r['compile_peak_gib'])} | {f(r['steady_peak_gib'])} | "
                     f"{f(r['step_time_ms'], 1)} | {f(r['step_iqr_pct'], 1)} | {r['measured_steps']} | "
                     f"{f(r['pool_trial'])} | {f(r['inherited_outside_gib'])} | {(r['recycled'] or '-')[:60]} |")
    ch = result["checks"]
    lines += ["", "| warm trial | config | warm GiB | cold GiB | diff MiB | within 2 % / 64 MiB |", "|---|---|---|---|---|---|"]
    for m in ch["memory"]:
        lines.append(f"| {m['trial']} | {m['config']} | {f(m['warm_gib'])} | {f(m['cold_gib'])} | {f(m['diff_mib'], 1)} | "
                     f"{'-' if m['within'] is None else ('yes' if m['within'] else 'NO')} |")
    lines += ["", "| config | warm step times ms | cold ms | worst deviation from median | within +-3 % |",
              "|---|---|---|---|---|"]
    for name, t in ch["step_times"].items():
        lines.append(f"| {name} | {', '.join(f'{x:.1f}' for x in t['runs_ms'])} | {f(t['cold_ms'], 1)} | "
                     f"{t['worst_dev_pct']:.2f} % | {'yes' if t['within_3pct'] else 'NO'} |")
    lines += ["", f"Memory within tolerance for every warm trial: **{'yes' if ch['memory_all_within'] else 'no'}**; "
              f"step times within +-3 %: **{'yes' if ch['step_times_all_within'] else 'no'}**. "
              f"Pool starts: {result['pool_starts']}; recycled after: {len(result['recycled'])} trial(s). "
              f"Wall: cold {result['cold_wall_s']:.0f} s, warm {result['warm_wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU (aot_eager_decomp_partition backend)")
    p.add_argument("--memory-cap-gib", type=float, default=16.0, help="emulated device cap (GPU only)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per trial")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per trial (after the compiling step)")
    p.add_argument("--inductor-cache", default=None, help="TORCHINDUCTOR_CACHE_DIR (default: fresh, under the run dir)")
    p.add_argument("--cache-tar", default=None, help="unpack this tarball of the Inductor cache first; write it back after")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per trial")
    args = p.parse_args()
    if args.steps < 2 or args.warmup < 0:
        p.error(f"--steps {args.steps} / --warmup {args.warmup}: use --steps >= 2 and --warmup >= 0")
    cpu = args.cpu_smoke
    device = "cpu" if cpu else "cuda"
    root = tempfile.mkdtemp(prefix="ab-wcs-")
    cache = os.path.abspath(args.inductor_cache or os.path.join(root, "inductor-cache"))
    os.makedirs(cache, exist_ok=True)
    if args.cache_tar and os.path.exists(args.cache_tar):
        with tarfile.open(args.cache_tar) as tar:
            tar.extractall(cache, filter="data")
        print(f"unpacked {args.cache_tar} into {cache}", flush=True)
    env = {"TORCHINDUCTOR_CACHE_DIR": cache}
    if cpu:
        env["AUTOBALANCE_COMPILE_BACKEND"] = "aot_eager_decomp_partition"
        env["OMP_NUM_THREADS"] = "1"
    cap = None if cpu else [int(args.memory_cap_gib * GIB)]
    script_args = CPU_ARGS if cpu else GPU_ARGS
    template = TrialLaunch(script=GPT, script_args=script_args, nproc_per_node=1, device=device, trial_dir=root,
                           steps=args.steps, warmup=args.warmup, timeout_s=args.timeout_s, memory_cap_bytes=cap,
                           env=env)
    cfgs = configs(cpu)

    def launch(name: str, tag: str) -> TrialLaunch:
        fields = {**template.__dict__, "config_json": cfgs[name].to_json()}
        return TrialLaunch(**{**fields, "trial_dir": os.path.join(root, tag), "trial_id": f"{tag}-{os.getpid()}"})

    cold: dict[str, dict[str, Any]] = {}
    warm: list[tuple[str, dict[str, Any]]] = []
    procs: list[dict[str, str]] = []
    walls = {"cold": 0.0, "warm": 0.0}
    pool = WarmPool(template=template, pool_dir=os.path.join(root, "pool"))
    device_name = "cpu"
    if not cpu:
        import torch

        device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda"

    def save(final: bool) -> None:
        """Written after every run: a run cut short by a time limit still leaves its figures."""
        result: dict[str, Any] = {
            "command": "python benchmarks/warm_cold_sequence.py " + " ".join(sys.argv[1:]), "complete": final,
            "device": device, "device_name": device_name, "script_args": script_args,
            "configs": {n: c.to_dict() for n, c in cfgs.items()}, "sequence": SEQUENCE,
            "memory_cap_gib": None if cap is None else args.memory_cap_gib, "steps": args.steps,
            "warmup": args.warmup, "cold": cold, "warm": warm, "checks": checks(cold, warm),
            "pool_starts": pool.starts, "recycled": pool.recycled, "cold_wall_s": walls["cold"],
            "warm_wall_s": walls["warm"], "gpu_processes": procs,
            "leftover_processes": trial_processes(pool.pool_id) if final and pool.pool_id else [],
            "inductor_cache": cache, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        path = write_result("warm_cold_sequence", result)
        md = markdown(result)
        with open(os.path.splitext(path)[0] + ".md", "w") as fh:
            fh.write(md)
        if final:
            print(md, flush=True)

    t0 = time.monotonic()
    for name in cfgs:  # cold first: a live warm pool would hold the GPU's memory
        outcome = run_trial(launch(name, f"cold-{name}"))
        cold[name] = figures(outcome)
        procs.append({"after": f"cold {name}", "gpu": gpu_processes()})
        print(f"cold {name}: {json.dumps(cold[name])}", flush=True)
        walls["cold"] = time.monotonic() - t0
        save(False)
    t0 = time.monotonic()
    try:
        for i, name in enumerate(SEQUENCE):
            outcome = pool.run(launch(name, f"warm{i + 1}-{name}"))
            warm.append((name, figures(outcome)))
            procs.append({"after": f"warm {i + 1} {name}", "gpu": gpu_processes()})
            print(f"warm {i + 1} {name}: {json.dumps(warm[-1][1])}", flush=True)
            walls["warm"] = time.monotonic() - t0
            save(False)
    finally:
        pool.close()
    save(True)
    if args.cache_tar:
        with tarfile.open(args.cache_tar, "w:gz") as tar:
            tar.add(cache, arcname=".")
        print(f"wrote {args.cache_tar}", flush=True)


if __name__ == "__main__":
    main()
