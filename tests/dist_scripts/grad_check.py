"""Run by tests under torchrun (gloo, any world size): for many configurations, every optimizer
step of a whole epoch (the short last step included) must update the weights as one process would
on that step's samples concatenated.

argv: output path (rank 0 writes ``{"equal": [...], "any": [...]}``), the number of cases of each
form: ``equal`` (equal micro-batches on each rank, sizes random per rank, accumulation 1-4) and
``any`` (random global batches, primes included, split any way over the ranks and 1-6 micro-steps
whose sizes differ by one; with a one-epoch coverage check of its own).
"""

from __future__ import annotations

import gc
import random
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _finish import write_and_exit
from torch import nn

import autobalance as ab
from autobalance._config import split_at_least
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


def one_case(cfg: ab.BalanceConfig, data: torch.utils.data.TensorDataset, lr: float = 0.05) -> dict:
    """A whole epoch: before every optimizer step the reference takes the model's current weights.
    The gradient the optimizer is given (all-reduced, read just before ``plan.optimizer_step``) must
    equal the reference's gradient of the mean loss over exactly the samples the schedule gives that
    step (the short last step included): ``grad_errors``, fp32, the verify rule's 1e-6. The update
    that step applies must be ``lr`` x that gradient: ``rel_errors`` (read back from the weights, so
    fp32 rounding of ``weights - lr x grad`` leaves a few 1e-6)."""
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
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    schedule = epoch_schedule(num_samples=len(data), config=cfg, epoch=0, seed=7)
    errors: list[float] = []
    grad_errors: list[float] = []
    totals: list[int] = []
    allreduces: list[int] = []
    seen: list[int] = []
    for i, micro_batches in enumerate(plan.steps(loader)):
        before = [p.detach().clone() for p in model.parameters()]
        calls_before = calls["n"]
        for x, y in micro_batches:
            with plan.micro_step():
                plan.backward(F.cross_entropy(model(x), y))
        grad = torch.cat([p.grad.detach().flatten().clone() for p in model.parameters()])
        plan.optimizer_step(opt)
        allreduces.append(calls["n"] - calls_before)
        step = schedule.steps[i]
        idx = [j for rank in step.micro_batches for mb in rank for j in mb]
        seen.extend(idx)
        with torch.no_grad():
            for r, b in zip(reference.parameters(), before, strict=True):
                r.copy_(b)
        reference.zero_grad(set_to_none=True)
        x_all, y_all = data.tensors[0][idx], data.tensors[1][idx]
        F.cross_entropy(reference(x_all), y_all).backward()
        ref_grad = torch.cat([p.grad.flatten() for p in reference.parameters()])
        got = torch.cat([((b - p.detach()) / lr).flatten() for b, p in zip(before, model.parameters(), strict=True)])
        errors.append(float((got - ref_grad).norm() / ref_grad.norm()))
        grad_errors.append(float((grad - ref_grad).norm() / ref_grad.norm()))
        totals.append(step.total)
    result = {"config": cfg.to_dict(), "num_samples": len(data), "rel_errors": errors, "grad_errors": grad_errors,
              "rel_error": max(errors), "step_totals": totals, "schedule_steps": len(schedule.steps),
              "dropped": schedule.dropped, "allreduce_calls": allreduces, "samples_seen": len(seen),
              "distinct_samples": len(set(seen))}
    del model, plan, opt, loader
    gc.collect()
    return result


def epoch_data(full: torch.utils.data.TensorDataset, cfg: ab.BalanceConfig, rng: random.Random
               ) -> torch.utils.data.TensorDataset:
    """One or two full steps, then a short last step of at least one sample per rank when the
    global batch leaves room for one."""
    world = cfg.world_size
    tail = rng.randint(world, cfg.global_batch - 1) if cfg.global_batch - 1 >= world else 0
    n = cfg.global_batch * rng.randint(1, 2) + tail
    return torch.utils.data.TensorDataset(full.tensors[0][:n], full.tensors[1][:n])


def epoch_check(cfg: ab.BalanceConfig, *, num_samples: int) -> dict:
    """One epoch through plan.steps on every rank: which samples each saw, and how many steps."""
    plan = ab.plan(config=cfg, device="cpu")
    loader = plan.dataloader(torch.utils.data.TensorDataset(torch.arange(num_samples)), seed=5)
    mine: list[int] = []
    steps = 0
    for micro_batches in plan.steps(loader):
        steps += 1
        for (x,) in micro_batches:
            mine.extend(int(i) for i in x)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"samples": mine, "steps": steps})
    seen = [i for g in gathered for i in g["samples"]]
    return {"num_samples": num_samples, "seen": len(seen), "distinct": len(set(seen)),
            "steps_per_rank": [g["steps"] for g in gathered]}


PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61]


def any_split(case: int, rng: random.Random, world: int) -> ab.BalanceConfig:
    acc = 1 + case % 6
    low = world * acc
    if case % 2 == 0:
        global_batch = rng.choice([p for p in PRIMES if p >= low])
    else:
        global_batch = rng.randint(low, low + 40)
    shares = [rng.uniform(0.05, 1.0) for _ in range(world)]
    ckpt = [sorted(rng.sample(range(4), rng.randint(0, 4))) for _ in range(world)]
    return ab.BalanceConfig.any_split(
        rank_samples=split_at_least(global_batch, shares, acc), accumulation=acc, checkpoint=ckpt,
        bucket_cap_mb=1000.0, gradient_as_bucket_view=bool(case % 3 == 1),
    )


def equal_split(case: int, rng: random.Random, world: int) -> ab.BalanceConfig:
    acc = 1 + case % 4
    mbs = [rng.randint(1, 7) for _ in range(world)]
    mbs[0] = max(mbs[0], 2)  # a global batch of at least world + 1: room for a short last step
    ckpt = [sorted(rng.sample(range(4), rng.randint(0, 4))) for _ in range(world)]
    return ab.BalanceConfig(
        micro_batches=mbs, accumulation=acc, global_batch=sum(mbs) * acc, checkpoint=ckpt,
        bucket_cap_mb=1000.0, gradient_as_bucket_view=bool(case % 2),
    )


def main() -> None:
    out = sys.argv[1]
    equal_cases = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    any_cases = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    full = torch.utils.data.TensorDataset(torch.randn(400, 16, generator=g), torch.randint(0, 5, (400,), generator=g))
    results: dict[str, list[dict]] = {"equal": [], "any": []}
    rng = random.Random(42 + world)
    for case in range(equal_cases):
        cfg = equal_split(case, rng, world)
        results["equal"].append(one_case(cfg, epoch_data(full, cfg, rng)))
    rng = random.Random(42 + world)
    for case in range(any_cases):
        cfg = any_split(case, rng, world)
        results["any"].append({**one_case(cfg, epoch_data(full, cfg, rng)),
                               "epoch": epoch_check(cfg, num_samples=97 + case)})
    write_and_exit(out, results)


if __name__ == "__main__":
    main()
