"""The smallest adoption of autobalance: an MLP on synthetic data under DDP.

    torchrun --nproc-per-node 2 examples/mlp/train.py
    autobalance tune examples/mlp/train.py --trials 10 --nproc-per-node 2 --device cpu
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import autobalance as ab


def main() -> None:
    plan = ab.plan(micro_batch=16)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)], nn.Linear(64, 10))
    model = plan.wrap(model)
    data = torch.utils.data.TensorDataset(torch.randn(1024, 64), torch.randint(0, 10, (1024,)))
    loader = plan.dataloader(data)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # a per-step schedule counts optimizer steps: plan.steps_per_epoch(loader), not len(loader) (micro-batches)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=plan.steps_per_epoch(loader))
    for micro_batches in plan.steps(loader):
        for x, y in micro_batches:
            with plan.micro_step():
                plan.backward(F.cross_entropy(model(x.to(plan.device)), y.to(plan.device)))
        plan.optimizer_step(optimizer)
        scheduler.step()
    if plan.is_main:
        print("done", flush=True)


if __name__ == "__main__":
    main()
