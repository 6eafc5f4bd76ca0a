"""A Lightning script that adopts autobalance with one line (``strategy=BalanceStrategy(...)``).

    torchrun --nproc-per-node 2 examples/lightning/train.py
    autobalance tune examples/lightning/train.py --trials 10 --nproc-per-node 2 --device cpu

A small MLP of repeated blocks on synthetic data; the strategy applies the configuration (per-rank
micro-batches, accumulation, checkpointed blocks, precision, DDP buckets) and weights the ranks in
DDP's all-reduce, so an uneven split trains as one process on the whole global batch would.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from autobalance.integrations.lightning import BalanceStrategy

FEATURES = 32


class Classifier(pl.LightningModule):
    def __init__(self, *, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
                                      for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, positions, features)
        return self.head(self.blocks(self.inp(x)).mean(dim=1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        # Lightning counts optimizer steps of the strategy's loader (the configuration's accumulation in force)
        steps = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


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
    strategy = BalanceStrategy(micro_batch=args.micro_batch)  # ab: the one added line (and strategy= below)
    cache = torch.randn(int(args.rank0_extra_mib * 2**20) // 4) if strategy.ab_plan.rank == 0 else None
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(args.samples, args.positions, FEATURES),
                                          torch.randint(0, 10, (args.samples,)))
    loader = torch.utils.data.DataLoader(data, batch_size=args.micro_batch, shuffle=True)
    trainer = pl.Trainer(accelerator="auto", devices=strategy.devices, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(width=args.width, depth=args.depth), train_dataloaders=loader)
    if trainer.is_global_zero:
        print(f"done (rank 0 held {0 if cache is None else cache.numel() * 4 / 2**20:.1f} MiB of extras)", flush=True)


if __name__ == "__main__":
    main()
