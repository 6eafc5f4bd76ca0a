"""Run by tests under torchrun (2 ranks, gloo): for many configurations, the plan's one-step
update must equal one process's update on the concatenated global batch.

Writes a JSON list of results to the path in argv[1] (rank 0 only).
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


def main() -> None:
    out = sys.argv[1]
    cases = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    dist.init_process_group("gloo")
    rng = random.Random(42)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(256, 16, generator=g), torch.randint(0, 5, (256,), generator=g))
    results = []
    for case in range(cases):
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
