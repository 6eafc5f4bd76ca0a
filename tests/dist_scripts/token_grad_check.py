"""Run by tests under torchrun (gloo): a small language model on variable-length sequences whose
loss is the mean over real tokens (``cross_entropy(..., ignore_index=-100)``). With
``plan.steps(loader, count=...)`` every optimizer step of a whole epoch (the short last step
included) must update the weights as one process's step on the global token mean of that step's
samples, for uneven splits (equal micro-steps per rank, and any split: micro-steps of unequal
sizes within a rank), accumulation 1-4 (1-6 for any split) and checkpointed blocks. Every
collective of every step is recorded in order, on every rank: one scalar all-reduce (the step's
count) before the step's first backward, and exactly one gradient all-reduce, in its last.

    torchrun --nproc-per-node 2 tests/dist_scripts/token_grad_check.py OUT.json [EQUAL [ANY]] [--no-count]

``--no-count`` runs the same script without ``count=`` (the per-sample weighting): the control
that must *not* be exact. Rank 0 writes ``{"equal": [...], "any": [...]}`` to OUT.json.
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


COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "scatter", "gather", "barrier")
"""Every Python-level collective of ``torch.distributed``: each call during a step is recorded."""


class Recorder:
    """The order of one rank's events in each optimizer step: ``S`` a one-element all-reduce (the
    step's count), ``X`` any other collective outside DDP's gradient hook, ``B`` a backward starts,
    ``G`` a gradient bucket all-reduce (DDP's comm hook). ``step()`` closes the current step."""

    def __init__(self) -> None:
        self.current: list[str] = []
        self.steps: list[str] = []
        self.originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def install(self) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, self._counting(name, original))

    def uninstall(self) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)

    def _counting(self, name, original):
        def call(*args, **kwargs):
            tensor = args[0] if args else kwargs.get("tensor")
            scalar = name == "all_reduce" and isinstance(tensor, torch.Tensor) and tensor.numel() == 1
            self.current.append("S" if scalar else "X")
            return original(*args, **kwargs)
        return call

    def grad_hook(self, state, bucket):
        self.current.append("G")
        fut = self.originals["all_reduce"](bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / dist.get_world_size())

    def step(self) -> None:
        self.steps.append("".join(self.current))
        self.current = []


def one_case(cfg: ab.BalanceConfig, data: torch.utils.data.TensorDataset, *, use_count: bool,
             lr: float = 0.05) -> dict:
    """A whole epoch: before every optimizer step the reference takes the model's current weights;
    the gradient the optimizer steps with (SGD: the update over ``-lr``) must equal the reference's
    gradient of the token-mean loss over exactly the samples the schedule gives that step (all
    ranks, all micro-steps)."""
    plan = ab.plan(config=cfg, device="cpu")
    torch.manual_seed(0)
    reference = TinyLM()
    torch.manual_seed(0)
    model = plan.wrap(TinyLM())
    recorder = Recorder()
    if plan.ddp is not None:
        plan.ddp.register_comm_hook(None, recorder.grad_hook)
    loader = plan.dataloader(data, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    stepped: list[torch.Tensor] = []  # the gradient the optimizer applies, read just before it steps
    params = list(model.parameters())
    opt.register_step_pre_hook(lambda *_: stepped.append(torch.cat([p.grad.flatten() for p in params])))
    schedule = epoch_schedule(num_samples=len(data), config=cfg, epoch=0, seed=7)
    errors: list[float] = []
    micro_steps: list[int] = []
    recorder.install()
    try:
        for i, micro_batches in enumerate(plan.steps(loader, count=real_tokens) if use_count else plan.steps(loader)):
            before = [p.detach().clone() for p in model.parameters()]
            micro_steps.append(len(micro_batches))
            for x, y in micro_batches:
                with plan.micro_step():
                    recorder.current.append("B")
                    plan.backward(token_mean_loss(model(x), y))
            plan.optimizer_step(opt)
            recorder.step()
            layout = schedule.steps[i]
            idx = [j for rank in layout.micro_batches for mb in rank for j in mb]
            with torch.no_grad():
                for r, b in zip(reference.parameters(), before, strict=True):
                    r.copy_(b)
            reference.zero_grad(set_to_none=True)
            token_mean_loss(reference(data.tensors[0][idx]), data.tensors[1][idx]).backward()
            ref_grad = torch.cat([p.grad.flatten() for p in reference.parameters()])
            got = stepped[-1]
            applied = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters(), strict=True)])
            assert torch.allclose(applied, lr * got, rtol=0, atol=1e-6), "the optimizer did not step with that gradient"
            errors.append(float((got - ref_grad).norm() / ref_grad.norm()))
    finally:
        recorder.uninstall()
    events: list = [None] * dist.get_world_size()
    dist.all_gather_object(events, {"events": recorder.steps, "micro_steps": micro_steps})
    result = {
        "config": cfg.to_dict(), "rel_errors": errors, "rel_error": max(errors), "steps": len(errors),
        "schedule_steps": len(schedule.steps), "last_step_samples": schedule.steps[-1].total,
        "unequal_micro_steps": any(len({len(mb) for mb in rank}) > 1 for step in schedule.steps
                                   for rank in step.micro_batches),
        "events": [e["events"] for e in events], "micro_steps": [e["micro_steps"] for e in events],
    }
    del model, plan, opt, loader
    gc.collect()
    return result


def equal_split(case: int, rng: random.Random, world: int) -> ab.BalanceConfig:
    acc = 1 + case % 4
    mbs = [rng.randint(1, 7) for _ in range(world)]
    ckpt = [sorted(rng.sample(range(DEPTH), rng.randint(0, DEPTH))) for _ in range(world)]
    return ab.BalanceConfig(micro_batches=mbs, accumulation=acc, global_batch=sum(mbs) * acc, checkpoint=ckpt,
                            bucket_cap_mb=1000.0)


def any_split(case: int, rng: random.Random, world: int) -> ab.BalanceConfig:
    """Random global batch split any way over the ranks, in 1-6 micro-steps whose sizes differ by one."""
    acc = 1 + case % 6
    global_batch = rng.randint(world * acc + 1, world * acc + 30)
    shares = [rng.uniform(0.05, 1.0) for _ in range(world)]
    ckpt = [sorted(rng.sample(range(DEPTH), rng.randint(0, DEPTH))) for _ in range(world)]
    return ab.BalanceConfig.any_split(rank_samples=split_at_least(global_batch, shares, acc), accumulation=acc,
                                      checkpoint=ckpt, bucket_cap_mb=1000.0)


def main() -> None:
    out = sys.argv[1]
    numbers = [int(a) for a in sys.argv[2:] if not a.startswith("--")]
    equal_cases, any_cases = [*numbers, 8, 6][:2]
    use_count = "--no-count" not in sys.argv
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    data = make_data(101)  # a prime: the last step of most configurations is short
    results: dict[str, list[dict]] = {"equal": [], "any": []}
    rng = random.Random(11)
    for case in range(equal_cases):
        results["equal"].append(one_case(equal_split(case, rng, world), data, use_count=use_count))
    rng = random.Random(13)
    for case in range(any_cases):
        results["any"].append(one_case(any_split(case, rng, world), data, use_count=use_count))
    write_and_exit(out, results)


if __name__ == "__main__":
    main()
