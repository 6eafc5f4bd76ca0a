"""A small training script as a user writes it, with the choices that test verification:

--loss mean|sum       the loss reduction (``sum``: a sample's weight depends on its micro-batch)
--norm layer|batch    LayerNorm or BatchNorm1d in each block (BatchNorm: a batch-dependent layer)
--body sequential|flat  six identical blocks in ``model.body.layers`` (an nn.Sequential), or one
                      MLP without repeated blocks
--dtype fp32|bf16|fp16  the script's own dtype
--loss-factor F       multiply the loss by F (large: the first fp16 steps overflow at the
                      GradScaler's initial scale)
--samples N, --micro-batch B, --epochs E, --rank0-extra-mb M (an extra tensor on rank 0 only, like
                      an EMA copy: rank 0 needs more memory)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import autobalance as ab

WIDTH = 32


class Block(nn.Module):
    def __init__(self, norm: str) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH) if norm == "batch" else nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.fc(x)))


class Net(nn.Module):
    def __init__(self, *, norm: str, body: str) -> None:
        super().__init__()
        self.embed = nn.Linear(16, WIDTH)
        self.body = nn.Module()
        if body == "sequential":
            self.body.layers = nn.Sequential(*[Block(norm) for _ in range(6)])
        else:
            self.body.layers = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body.layers(self.embed(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loss", choices=["mean", "sum"], default="mean")
    parser.add_argument("--norm", choices=["layer", "batch"], default="layer")
    parser.add_argument("--body", choices=["sequential", "flat"], default="sequential")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--loss-factor", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--rank0-extra-mb", type=float, default=0.0)
    args = parser.parse_args()

    plan = ab.plan(micro_batch=args.micro_batch, dtype=args.dtype)
    torch.manual_seed(0)
    model = plan.wrap(Net(norm=args.norm, body=args.body))
    extra = None
    if plan.rank == 0 and args.rank0_extra_mb > 0:
        extra = torch.zeros(int(args.rank0_extra_mb * 2**20 / 4))  # kept alive: rank 0's extra
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(args.samples, 16, generator=g),
                                          torch.randint(0, 4, (args.samples,), generator=g))
    loader = plan.dataloader(data)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(args.epochs):
        for micro_batches in plan.steps(loader):
            for x, y in micro_batches:
                with plan.micro_step():
                    loss = F.cross_entropy(model(x), y, reduction=args.loss) * args.loss_factor
                    plan.backward(loss)
            plan.optimizer_step(opt)
    del extra


if __name__ == "__main__":
    main()
