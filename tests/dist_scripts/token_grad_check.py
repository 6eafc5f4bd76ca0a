"""Run by tests under torchrun (gloo): a small language model on variable-length sequences whose
loss is the mean over real tokens (``cross_entropy(..., ignore_index=-100)``). With
``plan.steps(loader, count=...)`` every optimizer step of a whole epoch (the short last step
included) must equal one process's step on the global token mean of that step's samples, for
uneven splits, accumulation 1-4 and checkpointed blocks; with exactly one gradient all-reduce and
one scalar all-reduce per optimizer step.

    torchrun --nproc-per-node 2 tests/dist_scripts/token_grad_check.py OUT.json [CASES] [--no-count]

``--no-count`` runs the same script without ``count=`` (the per-sample weighting): the control
that must *not* be exact. Writes a JSON list of results to OUT.json (rank 0 only).
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autobalance as ab
from autobalance.runtime import epoch_schedule

VOCAB, SEQ, WIDTH, DEPTH = 11, 12, 16, 3
IGNORE = -100


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
        self.blocks = nn.ModuleList([Block() for _ in range(DEPTH)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def token_mean_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=IGNORE)


def real_tokens(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (batch[1] != IGNORE).sum()


def make_data(n: int) -> torch.utils.data.TensorDataset:
    """Sequences with 1..SEQ real tokens each (very different lengths), the rest padding."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (n,), generator=g)
    y[torch.arange(SEQ)[None, :] >= lengths[:, None]] = IGNORE
    return torch.utils.data.TensorDataset(x, y)


def one_case(cfg: ab.BalanceConfig, data: torch.utils.data.TensorDataset, *, use_count: bool) -> dict:
    plan = ab.plan(config=cfg, device="cpu")
    torch.manual_seed(0)
    reference = TinyLM()
    torch.manual_seed(0)
    model = plan.wrap(TinyLM())
    grad_reductions = {"n": 0}
    original_all_reduce = dist.all_reduce
    if plan.ddp is not None:
        def hook(state, bucket):  # counts every gradient bucket all-reduce
            grad_reductions["n"] += 1
            fut = original_all_reduce(bucket.buffer(), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0] / dist.get_world_size())
        plan.ddp.register_comm_hook(None, hook)
    other_reductions = {"n": 0}

    def counting_all_reduce(tensor, *args, **kwargs):  # every all-reduce outside the DDP hook
        other_reductions["n"] += 1
        return original_all_reduce(tensor, *args, **kwargs)

    loader = plan.dataloader(data, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    schedule = epoch_schedule(num_samples=len(data), config=cfg, epoch=0, seed=7)
    worst = 0.0
    steps = 0
    dist.all_reduce = counting_all_reduce
    try:
        for micro_batches in plan.steps(loader, count=real_tokens) if use_count else plan.steps(loader):
            for x, y in micro_batches:
                with plan.micro_step():
                    plan.backward(token_mean_loss(model(x), y))
            plan.optimizer_step(opt)
            layout = schedule.steps[steps]
            idx = [i for rank in layout.micro_batches for mb in rank for i in mb]
            x_all, y_all = data.tensors[0][idx], data.tensors[1][idx]
            ref_opt.zero_grad()
            token_mean_loss(reference(x_all), y_all).backward()
            ref_opt.step()
            ref = torch.cat([p.detach().flatten() for p in reference.parameters()])
            got = torch.cat([p.detach().flatten() for p in model.parameters()])
            worst = max(worst, float((got - ref).norm() / ref.norm()))
            steps += 1
    finally:
        dist.all_reduce = original_all_reduce
    last = schedule.steps[-1]
    result = {
        "config": cfg.to_dict(), "rel_error": worst, "steps": steps, "schedule_steps": len(schedule.steps),
        "last_step_samples": last.total,
        "grad_allreduces_per_step": grad_reductions["n"] / max(steps, 1),
        "other_allreduces_per_step": other_reductions["n"] / max(steps, 1),
    }
    del model, plan, opt, loader
    gc.collect()
    return result


def main() -> None:
    out = sys.argv[1]
    cases = int(sys.argv[2]) if len(sys.argv) > 2 and not sys.argv[2].startswith("--") else 8
    use_count = "--no-count" not in sys.argv
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    rng = random.Random(11)
    data = make_data(101)  # a prime: the last step of most configurations is short
    results = []
    for case in range(cases):
        acc = 1 + case % 4
        mbs = [rng.randint(1, 7) for _ in range(world)]
        ckpt = [sorted(rng.sample(range(DEPTH), rng.randint(0, DEPTH))) for _ in range(world)]
        cfg = ab.BalanceConfig(
            micro_batches=mbs, accumulation=acc, global_batch=sum(mbs) * acc, checkpoint=ckpt,
            bucket_cap_mb=1000.0,
        )
        results.append(one_case(cfg, data, use_count=use_count))
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()
    # the checks are done and written: skip interpreter teardown, where a loaded machine has seen
    # torch's gloo threads abort ("terminate called without an active exception", exit -6)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
