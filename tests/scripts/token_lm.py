"""A tiny language model on padded variable-length sequences whose loss is the mean over real
tokens (``ignore_index``): the script a user writes. ``--count`` passes the real-token count to
``plan.steps`` (exact for any split); without it the plan weights micro-batches by samples.

    torchrun --nproc-per-node 2 tests/scripts/token_lm.py [--count]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import autobalance as ab

VOCAB, SEQ, WIDTH, IGNORE = 13, 16, 16, -100


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(torch.tanh(self.ln(x)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--count", action="store_true", help="pass the real-token count to plan.steps")
    args = p.parse_args()
    plan = ab.plan(micro_batch=8)
    torch.manual_seed(0)
    model = plan.wrap(TinyLM())
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (256, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (256, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (256,), generator=g)
    y[torch.arange(SEQ)[None, :] >= lengths[:, None]] = IGNORE
    loader = plan.dataloader(torch.utils.data.TensorDataset(x, y))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    count = (lambda batch: (batch[1] != IGNORE).sum()) if args.count else None
    for micro_batches in plan.steps(loader, count=count):
        for xb, yb in micro_batches:
            with plan.micro_step():
                logits = model(xb)
                plan.backward(F.cross_entropy(logits.reshape(-1, VOCAB), yb.reshape(-1), ignore_index=IGNORE))
        plan.optimizer_step(opt)


if __name__ == "__main__":
    main()
