"""Runtime overhead: the GPT training step through an autobalance plan versus a hand-written DDP
loop with the same configuration (bf16 autocast, same micro-batch, same DDP settings).
Alternates the two loops in rounds so drift hits both equally; reports median step times.

    torchrun --nproc-per-node 2 benchmarks/overhead.py [--steps 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "gpt"))

from train import GPT

import autobalance as ab


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_plan(plan: ab.Plan, model: nn.Module, opt: torch.optim.Optimizer, loader, steps: int) -> list[float]:
    times: list[float] = []
    it = iter(plan.steps(loader))
    for _ in range(steps):
        sync(plan.device)
        t = time.perf_counter()
        micro_batches = next(it)
        for x, y in micro_batches:
            x, y = x.to(plan.device, non_blocking=True), y.to(plan.device, non_blocking=True)
            with plan.micro_step():
                logits = model(x)
                plan.backward(F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)))
        plan.optimizer_step(opt)
        sync(plan.device)
        times.append(time.perf_counter() - t)
    return times


def run_hand(model: nn.Module, opt: torch.optim.Optimizer, data, mb: int, device: torch.device, dtype, steps: int,
             rank: int, world: int) -> list[float]:
    times: list[float] = []
    n = len(data)
    for step in range(steps):
        sync(device)
        t = time.perf_counter()
        start = ((step * world + rank) * mb) % (n - mb)
        x, y = data[start : start + mb]
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--small", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args()
    shape = dict(vocab=256, block_size=32, n_layer=2, n_embd=64, n_head=4) if args.small else \
        dict(vocab=32768, block_size=1024, n_layer=16, n_embd=1024, n_head=16)
    mb = 4 if args.small else 8
    cfg = ab.BalanceConfig(micro_batches=[mb, mb], global_batch=2 * mb, dtype="bf16", bucket_cap_mb=25.0)
    plan = ab.plan(config=cfg)
    device, rank, world = plan.device, plan.rank, plan.world_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape["vocab"], (512, shape["block_size"] + 1), generator=g)
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    torch.manual_seed(0)
    with torch.device(device):
        raw_a = GPT(dropout=0.0, **shape)
    model_a = plan.wrap(raw_a)
    opt_a = torch.optim.AdamW(model_a.parameters(), lr=1e-4, fused=device.type == "cuda")
    loader = plan.dataloader(dataset)
    torch.manual_seed(0)
    with torch.device(device):
        raw_b = GPT(dropout=0.0, **shape)
    model_b = nn.parallel.DistributedDataParallel(raw_b, device_ids=[device.index] if device.type == "cuda" else None,
                                                  bucket_cap_mb=25.0)
    opt_b = torch.optim.AdamW(model_b.parameters(), lr=1e-4, fused=device.type == "cuda")
    run_plan(plan, model_a, opt_a, loader, 3)  # warm-up both
    run_hand(model_b, opt_b, dataset, mb, device, torch.bfloat16, 3, rank, world)
    plan_times: list[float] = []
    hand_times: list[float] = []
    for _ in range(args.rounds):
        plan_times += run_plan(plan, model_a, opt_a, loader, args.steps)
        hand_times += run_hand(model_b, opt_b, dataset, mb, device, torch.bfloat16, args.steps, rank, world)
    if rank == 0:
        a, b = statistics.median(plan_times), statistics.median(hand_times)
        line = (f"plan median step {1000 * a:.2f} ms, hand-written {1000 * b:.2f} ms, overhead {100 * (a / b - 1):+.2f}% "
                f"({len(plan_times)} steps each, {args.rounds} alternating rounds)")
        print(line, flush=True)
        if args.out:
            import json

            with open(args.out, "w") as fh:
                json.dump({"plan_ms": 1000 * a, "hand_ms": 1000 * b, "overhead_pct": 100 * (a / b - 1),
                           "steps_each": len(plan_times), "rounds": args.rounds, "plan_times_s": plan_times,
                           "hand_times_s": hand_times, "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
