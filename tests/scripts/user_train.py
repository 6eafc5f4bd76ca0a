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
--dropout P           functional dropout in each block, ``F.dropout(h, self.p, self.training)`` (nanoGPT's habit)
--clip none|scaled|recipe|plan  gradient clipping to norm 1: ``scaled`` calls clip_grad_norm_ right before
                      plan.optimizer_step (in fp16 it clips the scaled gradients: wrong); ``recipe`` unscales
                      first (plan.scaler.unscale_, PyTorch's AMP recipe); ``plan`` passes clip_grad_norm=
--aux none|train|always  a mixture-of-experts style load-balancing term over the micro-batch's routing
                      fractions added to the loss (``train``: computed only ``if self.training``)
--tf32                turn TF32 on after plan() (as nanoGPT does at its top)
--no-grad-forward     call the model a second time per micro-step, under no_grad, before the training
                      forward (a teacher's target or an EMA's evaluation from the same model)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import autobalance as ab

WIDTH = 32


class Block(nn.Module):
    def __init__(self, norm: str, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH) if norm == "batch" else nn.LayerNorm(WIDTH)
        self.p = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(torch.tanh(self.norm(self.fc(x))), self.p, self.training)


class Net(nn.Module):
    def __init__(self, *, norm: str, body: str, dropout: float = 0.0, aux: str = "none") -> None:
        super().__init__()
        self.aux = aux
        self.router = nn.Linear(WIDTH, 4) if aux != "none" else None
        self.embed = nn.Linear(16, WIDTH)
        self.body = nn.Module()
        if body == "sequential":
            self.body.layers = nn.Sequential(*[Block(norm, dropout) for _ in range(6)])
        else:
            self.body.layers = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body.layers(self.embed(x))
        aux = h.new_zeros(())
        if self.router is not None and (self.aux == "always" or self.training):
            fractions = torch.softmax(self.router(h), dim=-1).mean(0)  # routing share of each expert, this micro-batch
            aux = 4.0 * (fractions * fractions).sum()
        return self.head(h), aux


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
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--clip", choices=["none", "scaled", "recipe", "plan"], default="none")
    parser.add_argument("--aux", choices=["none", "train", "always"], default="none")
    parser.add_argument("--tf32", action="store_true")
    parser.add_argument("--no-grad-forward", action="store_true")
    args = parser.parse_args()

    plan = ab.plan(micro_batch=args.micro_batch, dtype=args.dtype)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = plan.wrap(Net(norm=args.norm, body=args.body, dropout=args.dropout, aux=args.aux))
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
                x, y = x.to(plan.device), y.to(plan.device)
                with plan.micro_step():
                    if args.no_grad_forward:
                        with torch.no_grad():
                            model(x)  # the script's second call of its model this micro-step
                    logits, aux = model(x)
                    loss = (F.cross_entropy(logits, y, reduction=args.loss) + 0.1 * aux) * args.loss_factor
                    plan.backward(loss)
            if args.clip == "scaled":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            elif args.clip == "recipe":
                if plan.scaler is not None:
                    plan.scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            plan.optimizer_step(opt, clip_grad_norm=1.0 if args.clip == "plan" else None)
    del extra


if __name__ == "__main__":
    main()
