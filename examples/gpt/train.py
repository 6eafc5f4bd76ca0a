"""Train a small GPT with DDP through an autobalance plan, rank 0 holding real extras.

Rank 0 keeps an EMA copy of the weights and a cached validation batch on its device: the
classic reason one GPU fills up while the others idle. autobalance fixes that by giving rank 0
fewer samples per micro-step (or more checkpointing) with the global batch unchanged.

    torchrun --nproc-per-node 2 examples/gpt/train.py                  # CPU: tiny, seconds
    torchrun --nproc-per-node 2 examples/gpt/train.py --n-layer 24 --n-embd 1024 --block-size 1024
    torchrun --nproc-per-node 2 examples/gpt/train.py --variable-length   # padded sequences, token-mean loss
    autobalance tune examples/gpt/train.py --trials 30 --nproc-per-node 2

The lines that adopt autobalance are marked with `# ab`.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

import autobalance as ab  # ab

IGNORE = -100  # label of padding positions (F.cross_entropy's default ignore_index)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, *, vocab: int, block_size: int, n_layer: int, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the real (non-padding) tokens, in fp32."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE)


def sum_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy (``--sum-loss``, for comparison: a sample's weight then depends on its micro-batch)."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--samples", type=int, default=512, help="synthetic dataset size")
    p.add_argument("--micro-batch", type=int, default=8, help="default per-rank micro-batch")
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0 = all)")
    p.add_argument("--val-cache-mib", type=float, default=4.0, help="rank-0 cached validation batch size")
    p.add_argument("--no-ema", action="store_true", help="rank 0 keeps no EMA copy")
    p.add_argument("--loss-outside", action="store_true",
                   help="compute the loss outside the wrapped model (as most scripts do; for comparison)")
    p.add_argument("--variable-length", action="store_true",
                   help="sequences of random length, padded; the loss is the mean over real tokens")
    p.add_argument("--tf32", action="store_true",
                   help="TF32 matmuls and convolutions (nanoGPT turns them on; verify holds them off)")
    p.add_argument("--clip-grad", type=float, default=0.0,
                   help="clip the gradients' global norm (through plan.optimizer_step, after unscaling in fp16)")
    p.add_argument("--no-shard", action="store_true",
                   help="build AdamW without plan.optimizer (the state on every rank; for comparison: the "
                        "study then never shards it)")
    p.add_argument("--sum-loss", action="store_true",
                   help="a summed loss instead of the mean (for comparison: verify refuses uneven splits)")
    p.add_argument("--no-count", action="store_true",
                   help="with --variable-length: do not pass count= (for comparison: uneven splits then "
                        "change the update, and verify refuses them)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    plan = ab.plan(micro_batch=args.micro_batch, accumulation=args.accumulation, dtype=args.dtype)  # ab
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    with torch.device(plan.device):  # build the weights where they train (fast for big models)
        model = GPT(
            vocab=args.vocab, block_size=args.block_size, n_layer=args.n_layer,
            n_embd=args.n_embd, n_head=args.n_head, dropout=args.dropout,
        )
    # ab: checkpointing of the chosen blocks, then DDP; with loss= the wrapped model returns the loss,
    # so a compiled configuration compiles model and loss together (the logits are not stored at full size)
    loss_fn = sum_loss if args.sum_loss else lm_loss
    model = plan.wrap(model, loss=None if args.loss_outside else loss_fn)
    raw = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model

    # Rank-0-only extras: an EMA copy of the weights and a cached validation batch.
    ema = None
    val_cache = None
    if plan.is_main:
        if not args.no_ema:
            ema = copy.deepcopy(raw).requires_grad_(False)
        tokens = int(args.val_cache_mib * 2**20 // 8)
        val_cache = torch.randint(0, args.vocab, (max(1, tokens),), device=plan.device)
        extras = sum(p.numel() * p.element_size() for p in ema.parameters()) if ema else 0
        extras += val_cache.numel() * val_cache.element_size()
        print(f"rank 0 extras: {extras / 2**20:.1f} MiB (EMA + cached validation batch)", flush=True)

    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, args.vocab, (args.samples, args.block_size + 1), generator=g)
    inputs, targets = data[:, :-1], data[:, 1:].clone()
    if args.variable_length:  # padding is never predicted: it is ignored by the loss
        lengths = torch.randint(1, args.block_size + 1, (args.samples,), generator=g)
        targets[torch.arange(args.block_size)[None, :] >= lengths[:, None]] = IGNORE
    dataset = torch.utils.data.TensorDataset(inputs, targets)
    loader = plan.dataloader(dataset)  # ab: this rank's micro-batches, uneven shards
    # ab: a loss averaged over real tokens is weighted by each micro-batch's share of the step's
    # real tokens (over all ranks), so every split computes the global token-mean update
    count = (lambda batch: (batch[1] != IGNORE).sum()) if args.variable_length and not args.no_count else None
    # ab: with optimizer_sharding='zero1' each rank keeps its share of AdamW's state only (same update)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=plan.device.type == "cuda")
    if not args.no_shard:
        optimizer = plan.optimizer(optimizer)
    # ab: a per-step schedule counts optimizer steps under the configuration in force (the same on every
    # rank), not len(loader): that counts this rank's micro-batches, `accumulation` of them per step
    total_steps = args.epochs * plan.steps_per_epoch(loader)
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)

    step = 0
    for _epoch in range(args.epochs):
        for micro_batches in plan.steps(loader, count=count):  # ab: one optimizer step each
            for x, y in micro_batches:
                x, y = x.to(plan.device, non_blocking=True), y.to(plan.device, non_blocking=True)
                with plan.micro_step():  # ab: autocast + no_sync on all but the last
                    loss = loss_fn(model(x), y) if args.loss_outside else model(x, y)
                    plan.backward(loss)  # ab: uneven-batch loss weighting, GradScaler for fp16
            plan.optimizer_step(optimizer, clip_grad_norm=args.clip_grad or None)  # ab: clips unscaled gradients
            scheduler.step()
            if ema is not None:
                with torch.no_grad():
                    for pe, pm in zip(ema.parameters(), raw.parameters(), strict=True):
                        pe.lerp_(pm.detach().float(), 0.01)
            step += 1
            if plan.is_main and step % 10 == 0:
                print(f"step {step} loss {loss.item():.3f} ppl {math.exp(min(20.0, loss.item())):.1f}", flush=True)
            if args.max_steps and step >= args.max_steps:
                break
    if plan.is_main:
        print(f"done: {step} steps", flush=True)


if __name__ == "__main__":
    main()
