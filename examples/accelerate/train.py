"""An Accelerate script (a custom loop with ``Accelerator``) that adopts autobalance (lines marked ``# ab``).

    torchrun --nproc-per-node 2 examples/accelerate/train.py
    autobalance tune examples/accelerate/train.py --trials 10 --nproc-per-node 2 --device cpu

A small MLP of repeated blocks on synthetic data, the loss outside the model. ``AccelerateBalance``
gives the ``Accelerator`` the configuration's accumulation, mixed precision and DDP buckets, prepares
the model (checkpointing this rank's chosen blocks, weighting the ranks in DDP's all-reduce) and
builds this rank's loader, so an uneven split trains as one process on the whole global batch would.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

from autobalance.integrations.accelerate import AccelerateBalance  # ab

FEATURES = 32


class Classifier(nn.Module):
    def __init__(self, *, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
                                      for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, positions, features)
        return self.head(self.blocks(self.inp(x)).mean(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--positions", type=int, default=64, help="positions per sample (activations grow with it)")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--rank0-extra-mib", type=float, default=0.0,
                        help="memory only rank 0 holds (a cached validation batch): what makes an uneven split pay")
    args = parser.parse_args()
    balance = AccelerateBalance(micro_batch=args.micro_batch)  # ab: the plan (your defaults)
    accelerator = Accelerator(**balance.accelerator_kwargs())  # ab: accumulation, mixed precision, DDP buckets
    cache = torch.randn(int(args.rank0_extra_mib * 2**20) // 4) if accelerator.is_main_process else None
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(args.samples, args.positions, FEATURES),
                                          torch.randint(0, 10, (args.samples,)))
    model = Classifier(width=args.width, depth=args.depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = balance.prepare(accelerator, model, optimizer, data)  # ab: was accelerator.prepare
    # ab: optimizer steps of an epoch under the configuration in force (len(loader) counts micro-batches)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=balance.steps_per_epoch())
    model.train()
    for x, y in loader:
        with accelerator.accumulate(model), balance.micro_step():  # ab: balance.micro_step()
            balance.backward(F.cross_entropy(model(x), y))  # ab: was accelerator.backward(...)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:  # an optimizer step ended
            scheduler.step()
    if accelerator.is_main_process:
        print(f"done (rank 0 held {0 if cache is None else cache.numel() * 4 / 2**20:.1f} MiB of extras)", flush=True)


if __name__ == "__main__":
    main()
