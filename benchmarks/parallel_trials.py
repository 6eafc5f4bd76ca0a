"""Two one-GPU trials at once versus one after the other: wall time for the same trials.

Three measurements, each "sequential" (one slot: GPU 0) against "parallel" (two slots: GPU 0 and
GPU 1, ``CUDA_VISIBLE_DEVICES`` per trial, as ``autobalance tune --gpus-per-trial 1`` does):

* ``cold``: the same fixed list of configurations, one torchrun job per trial (launcher API);
* ``warm``: the same list through warm worker pools (one pool per slot);
* ``tune``: the real ``autobalance tune --trials N --nproc-per-node 1 [--gpus-per-trial 1]``
  (the sampler picks the configurations, so the two runs measure different ones).

The fixed-list runs also give each configuration's step time measured alone and next to another
trial: running trials side by side must not change what they measure.

    python benchmarks/parallel_trials.py                      # 2 GPUs, GPT 8 x 1024, 8 trials
    python benchmarks/parallel_trials.py --device cpu --small # CPU smoke run: 2 cores, tiny GPT
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autobalance import BalanceConfig
from autobalance.launcher import TrialLaunch, TrialOutcome, WarmPool, run_trial, trial_processes
from benchmarks.common import GPT, run_tree, write_result

GPT_1GPU = ["--n-layer", "8", "--n-embd", "1024", "--n-head", "16", "--block-size", "1024", "--vocab", "32768",
            "--val-cache-mib", "1024", "--samples", "256", "--micro-batch", "8", "--dropout", "0.0"]
"""A ~135M-parameter GPT that trains on one GPU (global batch 8), rank 0's extras included."""
GPT_SMALL = ["--n-layer", "2", "--n-embd", "64", "--samples", "64", "--micro-batch", "8"]


def configs(n: int, *, layers: int, device: str) -> list[BalanceConfig]:
    """``n`` distinct one-rank configurations of global batch 8 (dtype, accumulation, checkpointing, bucket)."""
    dtypes = ["bf16", "fp32"] if device == "cuda" else ["fp32"]
    out = []
    i = 0
    while len(out) < n:
        acc = (1, 2, 4)[i % 3]
        ckpt = [list(range(layers // 2))] if (i // 3) % 2 else [[]]
        out.append(BalanceConfig(micro_batches=[8 // acc], accumulation=acc, global_batch=8,
                                 dtype=dtypes[(i // 6) % len(dtypes)], checkpoint=ckpt,
                                 bucket_cap_mb=25.0 + i, gradient_as_bucket_view=bool(i % 2)))
        i += 1
    return out


def slots(device: str, count: int) -> list[dict[str, Any]]:
    """What each slot gets: one GPU (CUDA_VISIBLE_DEVICES) or one core (affinity)."""
    if device == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(count)]
        return [{"env": {"CUDA_VISIBLE_DEVICES": gpus[i]}, "cpus": None} for i in range(count)]
    cores = sorted(os.sched_getaffinity(0))
    return [{"env": {}, "cpus": [cores[i]]} for i in range(count)]


def run_list(cfgs: list[BalanceConfig], *, nslots: int, warm: bool, args: argparse.Namespace, script_args: list[str],
             root: str) -> dict[str, Any]:
    """Run ``cfgs`` on ``nslots`` concurrent slots; returns wall time and per-trial figures."""
    todo: queue.Queue[tuple[int, BalanceConfig]] = queue.Queue()
    for item in enumerate(cfgs):
        todo.put(item)
    rows: dict[int, dict[str, Any]] = {}
    leftovers: list[int] = []

    def work(slot_index: int, slot: dict[str, Any]) -> None:
        pool: WarmPool | None = None
        try:
            while True:
                try:
                    i, cfg = todo.get_nowait()
                except queue.Empty:
                    return
                launch = TrialLaunch(script=GPT, script_args=script_args, nproc_per_node=1, device=args.device,
                                     config_json=cfg.to_json(), steps=args.steps, warmup=args.warmup,
                                     trial_dir=os.path.join(root, f"trial-{i:02d}"), timeout_s=args.trial_timeout,
                                     env=dict(slot["env"]), cpus=slot["cpus"],
                                     trial_id=f"bench-{os.getpid()}-{os.path.basename(root)}-{i}")
                started = time.monotonic()
                outcome: TrialOutcome
                if warm:
                    if pool is None:
                        pool = WarmPool(template=launch, pool_dir=os.path.join(root, f"pool-slot{slot_index}"))
                    outcome = pool.run(launch)
                else:
                    outcome = run_trial(launch)
                    leftovers.extend(trial_processes(launch.trial_id))
                rep = outcome.reports[0].to_dict() if 0 in outcome.reports else {}
                rows[i] = {"config": cfg.to_dict(), "slot": slot_index, "status": outcome.status,
                           "reason": outcome.reason if outcome.status != "ok" else "",
                           "wall_s": round(time.monotonic() - started, 3),
                           "step_time_ms": round(1000 * rep["step_time_s"], 3) if rep.get("step_time_s") else None,
                           "peak_device_gib": round(rep["memory"]["peak_device"] / 2**30, 4) if rep.get("memory") else None,
                           "startup_s": (rep.get("timing") or {}).get("startup_s")}
                print(json.dumps({"slots": nslots, "warm": warm, "trial": i, **rows[i]}), flush=True)
        finally:
            if pool is not None:
                pool_id = pool.pool_id
                pool.close()
                leftovers.extend(trial_processes(pool_id))

    start = time.monotonic()
    threads = [threading.Thread(target=work, args=(k, s)) for k, s in enumerate(slots(args.device, nslots))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"slots": nslots, "warm": warm, "wall_s": round(time.monotonic() - start, 3),
            "trials": [rows[i] for i in sorted(rows)], "leftover_pids": leftovers}


def run_tune(*, nslots: int, args: argparse.Namespace, script_args: list[str], root: str) -> dict[str, Any]:
    """The real ``autobalance tune``, one trial at a time or ``--gpus-per-trial 1`` / ``--cpus-per-trial 1``."""
    db = os.path.join(root, "study.db")
    cmd = [sys.executable, "-m", "autobalance", "tune", GPT, "--trials", str(args.trials), "--nproc-per-node", "1",
           "--device", args.device, "--storage", f"sqlite:///{db}", "--study-name", "bench", "--strategy", "optuna",
           "--seed", "0", "--steps", str(args.steps), "--warmup", str(args.warmup), "--prune-factor", "0",
           "--trial-timeout", str(args.trial_timeout), "--runs-dir", os.path.join(root, "runs")]
    if nslots > 1:
        cmd += ["--gpus-per-trial", "1"] if args.device == "cuda" else ["--cpus-per-trial", "1"]
    if args.device == "cpu" and nslots == 1:
        cmd = ["taskset", "-c", str(sorted(os.sched_getaffinity(0))[0]), *cmd]  # one core, as one slot has
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    if args.device == "cuda" and nslots == 1:
        env["CUDA_VISIBLE_DEVICES"] = slots("cuda", 1)[0]["env"]["CUDA_VISIBLE_DEVICES"]
    proc = run_tree([*cmd, "--", *script_args], timeout_s=args.trials * args.trial_timeout + 600, env=env, cwd=root)
    wall = proc.wall_s
    trials: list[dict[str, Any]] = []
    try:
        import optuna

        study = optuna.load_study(study_name="bench", storage=f"sqlite:///{db}")
        for t in study.get_trials():
            trials.append({"number": t.number, "state": t.state.name, "status": t.user_attrs.get("status"),
                           "wall_s": t.user_attrs.get("wall_s"), "step_time_ms": t.user_attrs.get("step_time_ms"),
                           "reused": t.user_attrs.get("reused_from") is not None,
                           "start": str(t.datetime_start), "complete": str(t.datetime_complete)})
    except Exception as exc:
        trials.append({"error": str(exc)})
    print(json.dumps({"tune_slots": nslots, "returncode": proc.returncode, "wall_s": round(wall, 3)}), flush=True)
    return {"slots": nslots, "returncode": proc.returncode, "wall_s": round(wall, 3), "trials": trials,
            "stderr_tail": proc.stderr[-3000:] if proc.returncode else "", "command": cmd}


def _pairs(seq: dict[str, Any], par: dict[str, Any]) -> dict[str, Any]:
    """Speed-up and how much each configuration's step time moved when run next to another trial."""
    moved = []
    for a, b in zip(seq["trials"], par["trials"], strict=False):
        if a.get("step_time_ms") and b.get("step_time_ms"):
            moved.append(b["step_time_ms"] / a["step_time_ms"] - 1)
    return {"sequential_wall_s": seq["wall_s"], "parallel_wall_s": par["wall_s"],
            "speedup": round(seq["wall_s"] / par["wall_s"], 3) if par["wall_s"] else None,
            "step_time_change_median": round(sorted(moved)[len(moved) // 2], 4) if moved else None,
            "step_time_change_max_abs": round(max((abs(m) for m in moved), default=0.0), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="tiny GPT (CPU smoke run)")
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--trial-timeout", type=float, default=600)
    p.add_argument("--modes", default="cold,warm,tune", help="comma-separated: cold, warm, tune")
    args = p.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            sys.exit(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    elif len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs 2 cores")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    script_args = GPT_SMALL if args.small else GPT_1GPU
    layers = int(script_args[script_args.index("--n-layer") + 1])
    cfgs = configs(args.trials, layers=layers, device=args.device)
    root = tempfile.mkdtemp(prefix="ab-parallel-")
    result: dict[str, Any] = {"device": args.device, "script_args": script_args, "trials": args.trials,
                              "steps": args.steps, "warmup": args.warmup, "root": root}
    for mode in modes:
        if mode in ("cold", "warm"):
            runs = {n: run_list(cfgs, nslots=n, warm=mode == "warm", args=args, script_args=script_args,
                                root=os.path.join(root, f"{mode}-{n}slot")) for n in (1, 2)}
            result[mode] = {"sequential": runs[1], "parallel": runs[2], "summary": _pairs(runs[1], runs[2])}
        elif mode == "tune":
            os.makedirs(os.path.join(root, "tune-1slot"))
            os.makedirs(os.path.join(root, "tune-2slot"))
            seq = run_tune(nslots=1, args=args, script_args=script_args, root=os.path.join(root, "tune-1slot"))
            par = run_tune(nslots=2, args=args, script_args=script_args, root=os.path.join(root, "tune-2slot"))
            result["tune"] = {"sequential": seq, "parallel": par,
                              "summary": {"sequential_wall_s": seq["wall_s"], "parallel_wall_s": par["wall_s"],
                                          "speedup": round(seq["wall_s"] / par["wall_s"], 3) if par["wall_s"] else None}}
        else:
            sys.exit(f"unknown mode {mode!r}")
        print(json.dumps({mode: result[mode]["summary"]}), flush=True)
    result["summary"] = {m: result[m]["summary"] for m in modes}
    name = "parallel_trials" + ("_small" if args.small else "")
    if sorted(modes) != ["cold", "tune", "warm"]:  # a partial run does not overwrite the full one
        name += "_" + "_".join(modes)
    write_result(name, result)


if __name__ == "__main__":
    main()
