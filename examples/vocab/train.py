"""A small GPT with a large vocabulary and an untied head, trained through an autobalance plan.

The embedding and the head hold almost every parameter: with AdamW each rank's replica (weights,
gradients, two moments) is about 16 bytes a parameter before a single activation. Under a memory
cap smaller than that, no DDP split fits, however few samples a rank takes; sharding the embedding
and the head with FSDP2 (``param_sharding='embeddings'``) leaves each rank half of them, and it fits.

    torchrun --nproc-per-node 2 examples/vocab/train.py                 # CPU: tiny, seconds
    autobalance tune --config studies/vocab-cpu.toml                     # every DDP split runs out of memory

Top to bottom, nanoGPT style; the lines that adopt autobalance are marked with `# ab`.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import autobalance as ab  # ab

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--vocab", type=int, default=8192)
p.add_argument("--n-layer", type=int, default=2)
p.add_argument("--n-embd", type=int, default=64)
p.add_argument("--n-head", type=int, default=4)
p.add_argument("--block-size", type=int, default=16)
p.add_argument("--samples", type=int, default=256, help="synthetic dataset size")
p.add_argument("--micro-batch", type=int, default=4, help="default per-rank micro-batch")
p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: one epoch)")
p.add_argument("--save", default="", help="write the full model and optimizer state here at the end")
args = p.parse_args()


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(args.vocab, args.n_embd)  # large: found as embedding-like
        self.pos = nn.Embedding(args.block_size, args.n_embd)  # small: stays with the root
        self.blocks = nn.ModuleList([Block(args.n_embd, args.n_head) for _ in range(args.n_layer)])
        self.ln_f = nn.LayerNorm(args.n_embd)
        self.head = nn.Linear(args.n_embd, args.vocab, bias=False)  # untied: its own weight, vocabulary-sized

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


plan = ab.plan(micro_batch=args.micro_batch)  # ab: the configuration (a trial's, a saved one, or this default)
torch.manual_seed(0)
model = GPT()
n_params = sum(q.numel() for q in model.parameters())
# ab: checkpointing of the chosen blocks, then DDP, or FSDP2 on the embedding and head (and the blocks)
model = plan.wrap(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # ab: built on the wrapped model's parameters
if plan.is_main:
    print(f"{n_params / 1e6:.2f}M parameters, parameter sharding: {plan.config.param_sharding}", flush=True)

g = torch.Generator().manual_seed(1234)
data = torch.randint(0, args.vocab, (args.samples, args.block_size + 1), generator=g)
loader = plan.dataloader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]))  # ab: this rank's micro-batches

step = 0
for micro_batches in plan.steps(loader):  # ab: one optimizer step each
    for x, y in micro_batches:
        with plan.micro_step():  # ab: autocast; gradient sync on the last micro-step only
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            plan.backward(loss)  # ab: each micro-batch weighted by its share of the global batch
    plan.optimizer_step(optimizer, clip_grad_norm=1.0)  # ab: clips by the global norm, sharded or not
    step += 1
    if plan.is_main and step % 10 == 0:
        print(f"step {step} loss {loss.item():.3f}", flush=True)
    if args.max_steps and step >= args.max_steps:
        break

if args.save:  # ab: every rank calls it; rank 0 gets the whole state (its weights and AdamW's, on the CPU)
    state = plan.full_state_dict(model, optimizer)
    if plan.is_main:
        torch.save(state, args.save)
if plan.is_main:
    print(f"done: {step} steps", flush=True)
