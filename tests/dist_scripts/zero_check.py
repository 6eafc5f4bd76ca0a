"""Run by tests under torchrun (gloo, 2 or 3 ranks): uneven ZeRO-1 against the plain optimizer.

For each case the same model, data and configuration (an uneven any split, accumulation 2,
checkpointing on one rank) trains 3 optimizer steps twice: with the plain optimizer
(``optimizer_sharding='off'``) and through ``plan.optimizer`` with ``zero1`` and uneven shares. Rank 0
writes, per case: whether every parameter is bitwise equal after each step, whether the gathered
``state_dict`` equals the plain one bitwise, the round trips (sharded state into a plain optimizer,
plain state into a sharded one: one more step each, bitwise equal), and per rank the measured
optimizer-state bytes, the ideal ``share * total`` and the largest parameter's state size.

argv: output path.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _finish import write_and_exit
from grad_check import Block
from torch import nn

import autobalance as ab
from autobalance.runtime._zero import ShardedOptimizer, state_bytes


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if kind == "adamw-fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    if kind == "adamw-groups":  # two groups: decay on matrices only (nanoGPT's recipe)
        params = list(model.parameters())
        return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                 lr=1e-2, foreach=False)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    raise ValueError(kind)


def train(cfg: ab.BalanceConfig, kind: str, data: torch.utils.data.TensorDataset, *, clip: float | None,
          poison_step: int | None) -> tuple[nn.Module, torch.optim.Optimizer, list[list[torch.Tensor]], Any]:
    plan = ab.plan(config=cfg, device="cpu")
    torch.manual_seed(0)
    model = plan.wrap(Net())
    opt = plan.optimizer(make_optimizer(kind, model))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = plan.dataloader(data, seed=3)
    after: list[list[torch.Tensor]] = []
    for i, micro_batches in enumerate(plan.steps(loader)):
        if i == 3:
            break
        for x, y in micro_batches:
            with plan.micro_step():
                loss = F.cross_entropy(model(x), y)
                if i == poison_step:
                    loss = loss * float("inf")  # every rank's gradients overflow: the scaler skips this step
                plan.backward(loss)
        plan.optimizer_step(opt, clip_grad_norm=clip)
        scheduler.step()
        after.append([p.detach().clone() for p in model.parameters()])
    return model, opt, after, plan


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if sorted(a["state"]) != sorted(b["state"]):
        return False
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        if sorted(sa) != sorted(sb):
            return False
        for key in sa:
            va, vb = sa[key], sb[key]
            if isinstance(va, torch.Tensor):
                if not (isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and torch.equal(va, vb)):
                    return False
            elif va != vb:
                return False
    strip = [{k: v for k, v in g.items()} for g in a["param_groups"]]
    return strip == [{k: v for k, v in g.items()} for g in b["param_groups"]]


def one_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """A plain step on the local model (no DDP, same batch on every rank): for the round trips."""
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def case(world: int, *, kind: str, shares: list[float], clip: float | None, dtype: str = "fp32",
         poison_step: int | None = None) -> dict[str, Any]:
    samples = [5, 3, 4][:world]
    base = dict(rank_samples=samples, accumulation=2, dtype=dtype, bucket_cap_mb=1000.0,
                checkpoint=[[0, 1]] + [[] for _ in range(world - 1)])
    plain_cfg = ab.BalanceConfig.any_split(**base)
    zero_cfg = ab.BalanceConfig.any_split(**base, optimizer_sharding="zero1", optimizer_shares=shares)
    g = torch.Generator().manual_seed(11)
    data = torch.utils.data.TensorDataset(torch.randn(200, 8, generator=g), torch.randint(0, 5, (200,), generator=g))
    plain_model, plain_opt, plain_after, _ = train(plain_cfg, kind, data, clip=clip, poison_step=poison_step)
    zero_model, zero_opt, zero_after, zero_plan = train(zero_cfg, kind, data, clip=clip, poison_step=poison_step)
    assert isinstance(zero_opt, ShardedOptimizer)
    equal_steps = [all(torch.equal(a, b) for a, b in zip(pa, za, strict=True))
                   for pa, za in zip(plain_after, zero_after, strict=True)]
    moved = [not torch.equal(a, b) for a, b in zip(plain_after[0], plain_after[-1], strict=True)]
    full = zero_opt.state_dict()  # a collective: every rank
    state_equal = same_state(full, plain_opt.state_dict())
    # round trips on a local copy of the model (same start on every rank, no collective in a plain step)
    x, y = data.tensors[0][:6], data.tensors[1][:6]
    inner_model = zero_model.module if hasattr(zero_model, "module") else zero_model
    start = {k: v.clone() for k, v in inner_model.state_dict().items()}
    torch.manual_seed(0)
    a_model = Net()
    a_model.load_state_dict(start)
    a_opt = make_optimizer(kind, a_model)
    a_opt.load_state_dict(full)  # the sharded optimizer's gathered state into a plain optimizer
    b_model = Net()
    b_model.load_state_dict(start)
    b_opt = make_optimizer(kind, b_model)
    b_opt.load_state_dict(plain_opt.state_dict())
    into_plain = all(torch.equal(a, b) for a, b in zip(one_step(a_model, a_opt, x, y), one_step(b_model, b_opt, x, y),
                                                       strict=True))
    # the plain state into a fresh sharded optimizer, then its gathered state again
    c_model = Net()
    c_model.load_state_dict(start)
    c_opt = ShardedOptimizer(make_optimizer(kind, c_model), shares=shares)
    c_opt.load_state_dict(plain_opt.state_dict())
    into_sharded = same_state(c_opt.state_dict(), plain_opt.state_dict())
    params = list(plain_model.parameters())
    per_param_state = [sum(v.numel() * v.element_size() for v in plain_opt.state[p].values()
                           if isinstance(v, torch.Tensor)) for p in params]
    total_state = state_bytes(plain_opt)
    mine = state_bytes(zero_opt)
    info = zero_plan.optimizer_info.to_dict()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"state_bytes": mine, "reported": info["state_bytes"],
                                      "param_bytes": info["param_bytes"]})
    return {"kind": kind, "shares": shares, "clip": clip, "dtype": dtype, "poison_step": poison_step,
            "equal_steps": equal_steps,
            "skipped": [all(torch.equal(a, b) for a, b in zip(plain_after[i - 1], plain_after[i], strict=True))
                        for i in range(1, len(plain_after))],
            "moved": sum(moved), "params": len(moved), "state_equal": state_equal,
            "into_plain": into_plain, "into_sharded": into_sharded,
            "counts": zero_opt.counts, "total_state": total_state, "largest_param_state": max(per_param_state),
            "ranks": gathered, "lr_after": zero_opt.param_groups[0]["lr"],
            "plain_lr_after": plain_opt.param_groups[0]["lr"]}


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    uneven = [0.15, 0.85] if world == 2 else [0.1, 0.5, 0.4]
    results = [
        case(world, kind="adamw", shares=uneven, clip=0.05),
        case(world, kind="sgd", shares=uneven, clip=0.05),
        case(world, kind="adamw-groups", shares=[1.0 / world] * world, clip=None),
    ]
    if world == 2:
        results += [
            case(world, kind="adamw-fused", shares=uneven, clip=0.05),
            case(world, kind="adamw", shares=[0.0, 1.0], clip=None),
            case(world, kind="adamw", shares=uneven, clip=0.05, dtype="fp16", poison_step=1),
        ]
    write_and_exit(out, results)


if __name__ == "__main__":
    main()
