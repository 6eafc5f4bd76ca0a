"""Uneven ZeRO-1 at world size 1: what the sharded optimizer's code path costs, and the state it holds.

One process (a one-rank process group: NCCL on a GPU, gloo on the CPU, started here when torchrun did
not start one), the GPT of ``examples/gpt/`` at the size of ``studies/gpt-1gpu.toml`` (16 x 1024,
1024 tokens, 32k vocabulary, ~270M parameters), AdamW (fused on a GPU), bf16 autocast, micro-batch 8
x accumulation 4, through ``autobalance.plan``. Three variants, alternated in rounds so drift hits all
alike, each its own model and optimizer:

- ``plain``: ``optimizer_sharding='off'`` (the optimizer as the script builds it);
- ``zero1``: ``optimizer_sharding='zero1'`` through ``plan.optimizer`` (one rank owns everything: the
  wrapper's hyperparameter copy and step; nothing to exchange);
- ``zero1_exchange``: as ``zero1`` but every owned parameter is also flattened, broadcast (to the
  one-rank group) and copied back each step: the exchange path's per-step cost without the network.

World size 1 saves no memory (the one rank owns all the state); the JSON reports each variant's
optimizer-state bytes, peak allocated memory, median step time and median ``plan.optimizer_step``
time. ``--smoke`` runs a tiny model on the CPU (a minute on 2 cores).

    python benchmarks/zero1_overhead.py --out $OUT/zero1_overhead.json           # one GPU
    python benchmarks/zero1_overhead.py --smoke --out /tmp/zero1_smoke.json       # CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "gpt"))

from train import GPT

import autobalance as ab
from autobalance.runtime._zero import ShardedOptimizer, state_bytes

VARIANTS = ("plain", "zero1", "zero1_exchange")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Variant:
    def __init__(self, name: str, args: argparse.Namespace, device: torch.device) -> None:
        self.name = name
        sharding = "off" if name == "plain" else "zero1"
        cfg = ab.BalanceConfig(micro_batches=[args.micro_batch], accumulation=args.accumulation,
                               global_batch=args.micro_batch * args.accumulation, dtype=args.dtype,
                               optimizer_sharding=sharding)
        self.plan = ab.plan(config=cfg, device=str(device))
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(vocab=args.vocab, block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd,
                        n_head=args.n_head, dropout=0.0)
        self.model = self.plan.wrap(model)
        opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, fused=device.type == "cuda")
        self.opt = self.plan.optimizer(opt)
        if name == "zero1_exchange":
            assert isinstance(self.opt, ShardedOptimizer)
            self.opt.always_exchange = True
        g = torch.Generator().manual_seed(1234)
        data = torch.randint(0, args.vocab, (args.samples, args.block_size + 1), generator=g)
        self.loader = self.plan.dataloader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:].clone()))
        self.steps = iter(())
        self.step_s: list[float] = []
        self.opt_step_s: list[float] = []
        self.device = device

    def next_batches(self) -> list[Any]:
        try:
            return next(self.steps)
        except StopIteration:
            self.steps = iter(self.plan.steps(self.loader))
            return next(self.steps)

    def run(self, steps: int, *, record: bool) -> None:
        for _ in range(steps):
            micro_batches = self.next_batches()
            sync(self.device)
            t0 = time.perf_counter()
            for x, y in micro_batches:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                with self.plan.micro_step():
                    logits = self.model(x)
                    self.plan.backward(F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1)))
            sync(self.device)
            t1 = time.perf_counter()
            self.plan.optimizer_step(self.opt)
            sync(self.device)
            t2 = time.perf_counter()
            if record:
                self.step_s.append(t2 - t0)
                self.opt_step_s.append(t2 - t1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    p.add_argument("--steps", type=int, default=10, help="measured steps per variant and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    size = (dict(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab=256, micro_batch=4, accumulation=2,
                 samples=256, dtype="bf16") if args.smoke else
            dict(n_layer=16, n_embd=1024, n_head=16, block_size=1024, vocab=32768, micro_batch=8, accumulation=4,
                 samples=2048, dtype="bf16"))
    for k, v in size.items():
        setattr(args, k, v)
    if args.smoke:
        args.steps, args.rounds, args.warmup = min(args.steps, 4), min(args.rounds, 2), 1
    if not dist.is_initialized():  # a one-rank group, so the exchange variant really calls broadcast
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    variants = [Variant(name, args, device) for name in VARIANTS]
    for v in variants:
        v.run(args.warmup, record=False)
    peaks: dict[str, int] = {}
    for _ in range(args.rounds):
        for v in variants:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            v.run(args.steps, record=True)
            if device.type == "cuda":
                peaks[v.name] = max(peaks.get(v.name, 0), int(torch.cuda.max_memory_allocated(device)))
    params = sum(q.numel() for q in variants[0].model.parameters())
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(device)
        if device.type == "cuda" else "cpu", "torch": torch.__version__, "world_size": 1,
        "model": {k: size[k] for k in ("n_layer", "n_embd", "n_head", "block_size", "vocab")}, "parameters": params,
        "micro_batch": args.micro_batch, "accumulation": args.accumulation, "dtype": args.dtype,
        "optimizer": "AdamW" + (" fused" if device.type == "cuda" else ""), "steps": args.steps, "rounds": args.rounds,
        "variants": {},
    }
    for v in variants:
        result["variants"][v.name] = {
            "optimizer_state_bytes": state_bytes(v.opt),
            "step_ms_median": 1000 * statistics.median(v.step_s),
            "optimizer_step_ms_median": 1000 * statistics.median(v.opt_step_s),
            "optimizer_step_ms_iqr": 1000 * (statistics.quantiles(v.opt_step_s, n=4)[2]
                                             - statistics.quantiles(v.opt_step_s, n=4)[0]),
            "peak_allocated_bytes_during_own_rounds": peaks.get(v.name),
        }
    base = result["variants"]["plain"]
    for name in VARIANTS[1:]:
        var = result["variants"][name]
        var["optimizer_step_ms_over_plain"] = var["optimizer_step_ms_median"] - base["optimizer_step_ms_median"]
        var["step_ms_over_plain"] = var["step_ms_median"] - base["step_ms_median"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
