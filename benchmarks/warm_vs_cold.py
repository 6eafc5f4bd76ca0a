"""The GPT scenario under several configurations, each run cold (one torchrun job) and warm
(one long-lived worker pool): per-rank memory, step time, trial wall time.

Shows the rank-0 extras' spread and how an uneven split / per-rank checkpointing closes it
(issue: runtime), and that warm measurements equal cold ones (issue: warm pool).

    python benchmarks/warm_vs_cold.py [--device cuda] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autobalance import BalanceConfig
from autobalance.launcher import TrialLaunch, WarmPool, run_trial, trial_processes
from benchmarks.common import GPT, GPT_ARGS, per_rank, write_result


def configs(small: bool) -> list[tuple[str, BalanceConfig | None]]:
    half = list(range(8)) if not small else [0, 1]
    return [
        ("baseline (script defaults: 8+8 fp32)", None),
        ("even 8+8 bf16", BalanceConfig(micro_batches=[8, 8], global_batch=16, dtype="bf16")),
        ("uneven 6+10 bf16", BalanceConfig(micro_batches=[6, 10], global_batch=16, dtype="bf16")),
        ("uneven 7+9 bf16, rank 0 checkpoints half", BalanceConfig(
            micro_batches=[7, 9], global_batch=16, dtype="bf16", checkpoint=[half, []])),
        ("even 4+4 x2 accumulation bf16", BalanceConfig(micro_batches=[4, 4], accumulation=2, global_batch=16,
                                                       dtype="bf16", gradient_as_bucket_view=True)),
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny model (CPU smoke run)")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    script_args = [] if args.small else GPT_ARGS
    root = tempfile.mkdtemp(prefix="ab-wvc-")
    template = TrialLaunch(script=GPT, script_args=script_args, nproc_per_node=2, device=args.device,
                           trial_dir=root, steps=args.steps, warmup=2, timeout_s=300)
    rows = []
    cold_runs = []
    # all cold runs first: a warm pool alive at the same time would hold memory on the GPUs
    for i, (_name, cfg) in enumerate(configs(args.small)):
        fields = {**template.__dict__, "config_json": None if cfg is None else cfg.to_json()}
        cold_runs.append(run_trial(TrialLaunch(**{**fields, "trial_dir": f"{root}/cold{i}", "trial_id": f"cold{i}-{os.getpid()}"})))
    pool = WarmPool(template=template, pool_dir=os.path.join(root, "pool"))
    pool_start = time.monotonic()
    try:
        for i, (name, cfg) in enumerate(configs(args.small)):
            fields = {**template.__dict__, "config_json": None if cfg is None else cfg.to_json()}
            warm = pool.run(TrialLaunch(**{**fields, "trial_dir": f"{root}/warm{i}", "trial_id": f"warm{i}-{os.getpid()}"}))
            cold = cold_runs[i]
            row = {"config": name, "cold_status": cold.status, "warm_status": warm.status,
                   "cold_wall_s": cold.wall_s, "warm_wall_s": warm.wall_s,
                   "cold": per_rank(cold), "warm": per_rank(warm)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        pool.close()
    pool_total = time.monotonic() - pool_start
    write_result("warm_vs_cold", {"device": args.device, "script_args": script_args, "steps": args.steps,
                                  "rows": rows, "pool_starts": pool.starts, "wall_s_total": pool_total,
                                  "leftover_processes": trial_processes(pool.pool_id)})


if __name__ == "__main__":
    main()
