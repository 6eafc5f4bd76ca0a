"""Where an eager configuration's step-time spread comes from (issue 14, item 3).

On one H200 the eager configuration A of ``warm_cold_sequence.py`` (bf16, micro-batch 4 x 8, three
blocks checkpointed, rank-0 EMA) measured 230-311 ms in four runs, with an IQR of 11-25 % inside
single cold runs, while compiled C repeated within 0.7 %. A is launch-bound (field notes): the host
issues kernels barely faster than the GPU runs them, so anything that slows the host shows up in the
step time. This script runs A outside the tuner, in several fresh processes, each running the same
steps under a few variants in turn, and records per step:

- ``wall_s``: from one step's end to the next;
- ``host_s``: the part spent in the training loop's own code (forward, backward, optimizer, EMA:
  issuing kernels), ``wait_s``: the rest (the plan waiting for the GPU at the step's end, the next
  batch's loading);
- the main thread's involuntary context switches and CPU migrations during the step (another
  thread or process took its core).

Variants (each a segment of ``--steps`` measured steps after two unmeasured ones):

- ``base``: as in a trial (the example's pageable ``x.to(device, non_blocking=True)``: for pageable
  memory CUDA synchronises the stream before the copy, so host and GPU take turns every micro-step);
- ``pinned``: the loader pins its batches (``pin_memory=True``): the copies no longer wait for the
  GPU, the host issues the next micro-step while the GPU runs this one;
- ``one_thread``: ``torch.set_num_threads(1)`` (no intra-op pool on the host);
- ``pinned_core``: the main thread pinned to one core (no migrations);
- ``no_ema``: without rank 0's EMA update (about 400 small kernels per step).

    python benchmarks/step_jitter.py --processes 4              # one H200 (~2.5 min)
    python benchmarks/step_jitter.py --cpu --small --processes 2 # CPU smoke run (seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import GPT, write_result

VARIANTS = ["base", "pinned", "one_thread", "pinned_core", "no_ema"]
GPU_MODEL = {"n_layer": 16, "n_embd": 1024, "n_head": 16, "block_size": 1024, "vocab": 32768}
SMALL_MODEL = {"n_layer": 4, "n_embd": 64, "n_head": 4, "block_size": 64, "vocab": 512}
MIB = 2**20


def thread_counters() -> dict[str, int]:
    """The calling thread's context switches and (where the kernel says) CPU migrations."""
    out: dict[str, int] = {}
    try:
        with open("/proc/thread-self/status") as fh:
            for line in fh:
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    key, value = line.split(":")
                    out[key] = int(value)
    except OSError:
        pass
    try:
        with open("/proc/thread-self/sched") as fh:
            for line in fh:
                if line.startswith("se.nr_migrations"):
                    out["migrations"] = int(line.split(":")[1])
    except OSError:
        pass
    return out


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("gpt_example", GPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(args: argparse.Namespace) -> None:
    """One fresh process: every variant in turn (rotated by ``--rotate`` so no variant is always first)."""
    import torch

    import autobalance as ab

    gpt = load_example()
    dims = SMALL_MODEL if args.small else GPU_MODEL
    plan = ab.plan(micro_batch=args.micro_batch, accumulation=args.accumulation, dtype=args.dtype,
                   checkpoint=args.checkpoint, device="cpu" if args.cpu else "cuda",
                   memory_cap_gib=None if args.cpu else args.memory_cap_gib)
    torch.manual_seed(0)
    with torch.device(plan.device):
        model = gpt.GPT(dropout=0.0, **dims)
    model = plan.wrap(model, loss=gpt.lm_loss)
    raw = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    ema = copy.deepcopy(raw).requires_grad_(False)
    val_cache = torch.randint(0, dims["vocab"], (int(args.val_cache_mib * MIB // 8) or 1,), device=plan.device)
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, dims["vocab"], (args.samples, dims["block_size"] + 1), generator=g)
    dataset = torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:].clone())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=plan.device.type == "cuda")
    all_cpus = sorted(os.sched_getaffinity(0))
    default_threads = torch.get_num_threads()
    order = VARIANTS[args.rotate % len(VARIANTS):] + VARIANTS[:args.rotate % len(VARIANTS)]
    results: dict[str, Any] = {"order": order, "threads": default_threads, "cpus": len(all_cpus),
                               "val_cache_bytes": val_cache.numel() * 8, "variants": {}}
    for variant in order:
        if variant == "pinned" and plan.device.type != "cuda":
            continue
        loader = plan.dataloader(dataset, pin_memory=(variant == "pinned"))
        if variant == "one_thread":
            torch.set_num_threads(1)
        if variant == "pinned_core":
            os.sched_setaffinity(0, {all_cpus[len(all_cpus) // 2]})  # 0: the calling thread only
        gc.collect()
        gc.freeze()  # as the trial's clock does before its measured steps
        steps: list[dict[str, float]] = []
        last_end = time.perf_counter()
        counters = thread_counters()
        for micro_batches in plan.steps(loader):
            body_start = time.perf_counter()
            for x, y in micro_batches:
                x, y = x.to(plan.device, non_blocking=True), y.to(plan.device, non_blocking=True)
                with plan.micro_step():
                    plan.backward(model(x, y))
            plan.optimizer_step(optimizer)
            if variant != "no_ema":
                with torch.no_grad():
                    for pe, pm in zip(ema.parameters(), raw.parameters(), strict=True):
                        pe.lerp_(pm.detach().float(), 0.01)
            body_end = time.perf_counter()
            if plan.device.type == "cuda":
                torch.cuda.synchronize(plan.device)
            end = time.perf_counter()
            now = thread_counters()
            steps.append({"wall_s": end - last_end, "host_s": body_end - body_start,
                          "wait_s": (end - last_end) - (body_end - body_start),
                          **{k: now.get(k, 0) - counters.get(k, 0) for k in now}})
            last_end, counters = end, now
            if len(steps) >= args.steps + 2:
                break
        gc.unfreeze()
        torch.set_num_threads(default_threads)
        os.sched_setaffinity(0, all_cpus)
        results["variants"][variant] = steps[2:]
        print(f"  {variant}: median {statistics.median(s['wall_s'] for s in steps[2:]) * 1000:.1f} ms", flush=True)
    if plan.device.type == "cuda":
        results["max_reserved_gib"] = torch.cuda.max_memory_reserved(plan.device) / 2**30
        results["alloc_retries"] = torch.cuda.memory_stats(plan.device).get("num_alloc_retries", 0)
    with open(args.child_out, "w") as fh:
        json.dump(results, fh)


def iqr_pct(values: list[float]) -> float:
    if len(values) < 4:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return 100.0 * (q[2] - q[0]) / statistics.median(values)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: each process's median step, the spread of those medians, the within-run IQR, and
    where the time went."""
    table: dict[str, Any] = {}
    for variant in VARIANTS:
        segments = [r["variants"][variant] for r in runs if variant in r.get("variants", {})]
        if not segments:
            continue
        medians = [statistics.median(s["wall_s"] for s in seg) for seg in segments]
        center = statistics.median(medians)
        steps = [s for seg in segments for s in seg]
        table[variant] = {
            "median_ms_per_process": [round(m * 1000, 1) for m in medians],
            "worst_deviation_pct": round(100.0 * max(abs(m - center) for m in medians) / center, 2),
            "iqr_pct_per_process": [round(iqr_pct([s["wall_s"] for s in seg]), 1) for seg in segments],
            "host_share_pct": round(100.0 * sum(s["host_s"] for s in steps) / sum(s["wall_s"] for s in steps), 1),
            "involuntary_cs_per_step": round(statistics.mean(s.get("nonvoluntary_ctxt_switches", 0) for s in steps), 2),
            "migrations_per_step": round(statistics.mean(s.get("migrations", 0) for s in steps), 2),
        }
    return table


def markdown(table: dict[str, Any], command: str) -> str:
    lines = [f"`{command}`", "",
             "| variant | median ms per process | worst deviation % | IQR % per process | host share % | "
             "involuntary cs / step | migrations / step |", "|---|---|---|---|---|---|---|"]
    for variant, row in table.items():
        lines.append(f"| {variant} | {', '.join(map(str, row['median_ms_per_process']))} | {row['worst_deviation_pct']} | "
                     f"{', '.join(map(str, row['iqr_pct_per_process']))} | {row['host_share_pct']} | "
                     f"{row['involuntary_cs_per_step']} | {row['migrations_per_step']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=4, help="fresh processes, each running every variant")
    p.add_argument("--steps", type=int, default=12, help="measured steps per variant and process")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=8)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--checkpoint", type=int, default=3, help="first N blocks checkpointed")
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--val-cache-mib", type=float, default=3072)
    p.add_argument("--memory-cap-gib", type=float, default=16.0)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--small", action="store_true", help="a tiny GPT (CPU smoke run)")
    p.add_argument("--timeout-s", type=float, default=180, help="per process")
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rotate", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.val_cache_mib = min(args.val_cache_mib, 1)
    if args.child_out:
        child(args)
        return
    out = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOBALANCE_")}
    passthrough = [f"--steps={args.steps}", f"--micro-batch={args.micro_batch}", f"--accumulation={args.accumulation}",
                   f"--dtype={args.dtype}", f"--checkpoint={args.checkpoint}", f"--samples={args.samples}",
                   f"--val-cache-mib={args.val_cache_mib}", f"--memory-cap-gib={args.memory_cap_gib}",
                   *(["--cpu"] if args.cpu else []), *(["--small"] if args.small else [])]
    runs: list[dict[str, Any]] = []
    started = time.time()
    for i in range(args.processes):
        path = os.path.join(out, f"step_jitter_process{i}.json")
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--child-out", path, "--rotate", str(i)]
        print(f"process {i}: {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            print(f"process {i} timed out after {args.timeout_s} s", flush=True)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its whole session, whatever it left behind
            proc.wait()
        if proc.returncode == 0 and os.path.exists(path):
            with open(path) as fh:
                runs.append(json.load(fh))
        else:
            print(f"process {i} failed (exit {proc.returncode})", flush=True)
    table = summarize(runs)
    command = "python benchmarks/step_jitter.py " + " ".join(sys.argv[1:])
    text = markdown(table, command) + f"\nprocesses: {len(runs)} of {args.processes}; wall {time.time() - started:.0f} s\n"
    print(text, flush=True)
    with open(os.path.join(out, "step_jitter.md"), "w") as fh:
        fh.write(text)
    write_result("step_jitter", {"command": command, "summary": table, "runs": runs})


if __name__ == "__main__":
    main()
