"""Run by tests under torchrun (gloo): for many configurations, the plan's one-step update must
equal one process's update on the concatenated global batch.

argv: output path (rank 0 writes a JSON list of results), number of cases, and the form:
``equal`` (2 ranks, equal micro-batches per rank, the default) or ``any`` (any world size: random
global batches, primes included, split any way over the ranks and 1-6 micro-steps).
"""

from __future__ import annotations

import gc
import json
import random
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autobalance as ab
from autobalance._config import split_at_least
from autobalance.runtime import epoch_schedule


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def one_case(cfg: ab.BalanceConfig, data: torch.utils.data.TensorDataset) -> dict:
    plan = ab.plan(config=cfg, device="cpu")
    torch.manual_seed(0)
    reference = Net()
    torch.manual_seed(0)
    model = plan.wrap(Net())
    calls = {"n": 0}
    if plan.ddp is not None:
        def hook(state, bucket):  # counts every bucket all-reduce
            calls["n"] += 1
            fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0] / dist.get_world_size())
        plan.ddp.register_comm_hook(None, hook)
    loader = plan.dataloader(data, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in reference.parameters()]
    for micro_batches in plan.steps(loader):
        for x, y in micro_batches:
            with plan.micro_step():
                plan.backward(F.cross_entropy(model(x), y))
        plan.optimizer_step(opt)
        break
    step = epoch_schedule(num_samples=len(data), config=cfg, epoch=0, seed=7).steps[0]
    idx = [i for rank in step.micro_batches for mb in rank for i in mb]
    x_all, y_all = data.tensors[0][idx], data.tensors[1][idx]
    F.cross_entropy(reference(x_all), y_all).backward()
    ref_grad = torch.cat([p.grad.flatten() for p in reference.parameters()])
    got = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters(), strict=True)])
    rel = float((got - ref_grad).norm() / ref_grad.norm())
    del model, plan, opt, loader
    gc.collect()
    return {"config": cfg.to_dict(), "rel_error": rel, "allreduce_calls": calls["n"]}


def epoch_check(cfg: ab.BalanceConfig, *, num_samples: int) -> dict:
    """One epoch through plan.steps on every rank: which samples each saw, and how many steps."""
    plan = ab.plan(config=cfg, device="cpu")
    loader = plan.dataloader(torch.utils.data.TensorDataset(torch.arange(num_samples)), seed=5)
    mine: list[int] = []
    steps = 0
    for micro_batches in plan.steps(loader):
        steps += 1
        for (x,) in micro_batches:
            mine.extend(int(i) for i in x)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"samples": mine, "steps": steps})
    seen = [i for g in gathered for i in g["samples"]]
    return {"num_samples": num_samples, "seen": len(seen), "distinct": len(set(seen)),
            "steps_per_rank": [g["steps"] for g in gathered]}


PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61]


def any_split(case: int, rng: random.Random, world: int) -> ab.BalanceConfig:
    acc = 1 + case % 6
    low = world * acc
    if case % 2 == 0:
        global_batch = rng.choice([p for p in PRIMES if p >= low])
    else:
        global_batch = rng.randint(low, low + 40)
    shares = [rng.uniform(0.05, 1.0) for _ in range(world)]
    ckpt = [sorted(rng.sample(range(4), rng.randint(0, 4))) for _ in range(world)]
    return ab.BalanceConfig.any_split(
        rank_samples=split_at_least(global_batch, shares, acc), accumulation=acc, checkpoint=ckpt,
        bucket_cap_mb=1000.0, gradient_as_bucket_view=bool(case % 3 == 1),
    )


def main() -> None:
    out = sys.argv[1]
    cases = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    form = sys.argv[3] if len(sys.argv) > 3 else "equal"
    dist.init_process_group("gloo")
    rng = random.Random(42 if form == "equal" else 42 + dist.get_world_size())
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(256, 16, generator=g), torch.randint(0, 5, (256,), generator=g))
    results = []
    for case in range(cases):
        if form == "any":
            cfg = any_split(case, rng, dist.get_world_size())
            results.append({**one_case(cfg, data), "epoch": epoch_check(cfg, num_samples=97 + case)})
            continue
        acc = 1 + case % 4
        mbs = [rng.randint(1, 9), rng.randint(1, 9)]
        ckpt = [sorted(rng.sample(range(4), rng.randint(0, 4))) for _ in range(2)]
        cfg = ab.BalanceConfig(
            micro_batches=mbs, accumulation=acc, global_batch=sum(mbs) * acc, checkpoint=ckpt,
            bucket_cap_mb=1000.0, gradient_as_bucket_view=bool(case % 2),
        )
        results.append(one_case(cfg, data))
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
