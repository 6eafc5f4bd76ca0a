"""Run by tests under torchrun (gloo, 2 or 3 ranks): parameter sharding (FSDP2) against one process.

A token model with a large vocabulary (an embedding, repeated blocks, an untied head). For each case
(a sharding choice, a split, a loss, checkpointing, clipping) the plan trains 3 AdamW steps; every
rank also trains a plain copy of the model, in-process, on each step's global batch concatenated
(the mean loss over its samples, or over its real tokens with ``count=``), with
``torch.nn.utils.clip_grad_norm_``. Rank 0 writes, per case, the largest difference between the
gathered fp32 parameters and the reference's after each step, and the largest update (the scale).
A control case weights every micro-batch alike (the weighting an uneven split must not have).

``resume``: 2 steps, the full state saved (``plan.full_state_dict``), a fresh model loaded
(``plan.load_full_state_dict``) sharded or not, step 3; against the unbroken run's step 3.

``memory``: live CPU tensor peaks per rank (a step's, once the optimizer state exists) under DDP and
each sharding, with the bytes the sharding splits and its largest unit; steps 2-6 measured, 3 times,
the lowest kept per rank (gloo frees a collective's buffers when its own thread is done: late, on a
loaded machine).

argv: output path.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _finish import write_and_exit
from torch import nn

import autobalance as ab
from autobalance._config import describe_config
from autobalance.runtime import CpuMemoryTracker, epoch_schedule
from autobalance.runtime._fsdp import full_tensor
from autobalance.runtime._zero import state_bytes

VOCAB, WIDTH, T = 96, 16, 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TokenNet(nn.Module):
    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = 3) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(T, width)  # small: not embedding-like (stays with the root)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make_data(n: int, *, ignore: bool) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (n, T), generator=g)
    y = torch.randint(0, VOCAB, (n, T), generator=g)
    if ignore:  # padding: a varying number of real tokens per sample, some samples with one only
        keep = torch.rand(n, T, generator=g) < 0.6
        keep[:, 0] = True
        y = torch.where(keep, y, torch.full_like(y, -100))
    return torch.utils.data.TensorDataset(x, y)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (sharded ones gathered: a collective), by the plain model's names."""
    return {n.replace("_checkpoint_wrapped_module.", "").removeprefix("module."): full_tensor(p.detach()).clone()
            for n, p in model.named_parameters()}


def train(cfg: ab.BalanceConfig, data: torch.utils.data.TensorDataset, *, tokens: bool, clip: float | None,
          steps: int = 3, seed: int = 0, wrong_weights: bool = False, start: dict[str, Any] | None = None,
          skip: int = 0, save_after: int | None = None) -> dict[str, Any]:
    plan = ab.plan(config=cfg, device="cpu", seed=0)
    torch.manual_seed(seed + plan.rank)  # each rank its own init: the plan must give every rank rank 0's
    model = plan.wrap(TokenNet())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if start is not None:
        plan.load_full_state_dict(model, opt, start if plan.rank == 0 else {})
    if wrong_weights:  # every micro-batch alike: right for equal micro-batches only
        plan._weights.weight = lambda i: plan.world_size / (cfg.accumulation * plan.world_size)  # type: ignore[method-assign]
    loader = plan.dataloader(data, seed=3)
    count = (lambda batch: (batch[1] != -100).sum()) if tokens else None
    after: list[dict[str, torch.Tensor]] = []
    saved: dict[str, Any] | None = None
    for i, micro_batches in enumerate(plan.steps(loader, count=count)):
        if i == steps:
            break
        if i < skip:
            continue
        for x, y in micro_batches:
            with plan.micro_step():
                plan.backward(loss_of(model, x, y))
        plan.optimizer_step(opt, clip_grad_norm=clip)
        after.append(params_of(model))
        if save_after is not None and i + 1 == save_after:
            saved = plan.full_state_dict(model, opt)
    return {"after": after, "saved": saved, "plan": plan, "model": model}


def reference(cfg: ab.BalanceConfig, data: torch.utils.data.TensorDataset, *, clip: float | None,
              steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """One process: each step's samples (the schedule's) as one batch, the mean loss over them."""
    torch.manual_seed(0)  # rank 0's initialisation, which the plan broadcasts
    model = TokenNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    schedule = epoch_schedule(num_samples=len(data), config=cfg, epoch=0, seed=3)
    out = []
    for step in schedule.steps[:steps]:
        idx = [j for rank in step.micro_batches for mb in rank for j in mb]
        opt.zero_grad(set_to_none=True)
        loss_of(model, data.tensors[0][idx], data.tensors[1][idx]).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def difference(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> list[float]:
    return [max(float((x[n] - y[n]).abs().max()) for n in y) for x, y in zip(a, b, strict=True)]


def case(name: str, cfg: ab.BalanceConfig, *, tokens: bool = False, clip: float | None = None,
         wrong_weights: bool = False, samples: int = 120) -> dict[str, Any]:
    data = make_data(samples, ignore=tokens)
    ref = reference(cfg, data, clip=clip)
    run = train(cfg, data, tokens=tokens, clip=clip, wrong_weights=wrong_weights)
    torch.manual_seed(0)
    start = {n: p.detach().clone() for n, p in TokenNet().named_parameters()}
    scale = [max(float((r[n] - start[n]).abs().max()) for n in r) for r in ref]
    info = run["plan"].model_info.get("param_sharding")
    steps = epoch_schedule(num_samples=samples, config=cfg, epoch=0, seed=3).steps[:3]
    result = {"steps_micro": [[len(r) for r in step.micro_batches] for step in steps],
              "steps_total": [step.total for step in steps], "name": name, "config": cfg.to_dict(), "describe": describe_config(cfg), "tokens": tokens,
              "clip": clip, "wrong_weights": wrong_weights, "max_abs": difference(run["after"], ref), "scale": scale,
              "sharding": info, "ddp": run["plan"].ddp is not None,
              "compiled_blocks": (run["plan"].compile_state.regions or {}).get("blocks", 0)
              if run["plan"].compile_state is not None else 0}
    del run
    gc.collect()
    return result


def resume_case(name: str, first: ab.BalanceConfig, second: ab.BalanceConfig) -> dict[str, Any]:
    """2 steps under ``first``, saved; a fresh model under ``second`` (another init) loads it and takes
    step 3; against ``first`` unbroken (and ``second`` unbroken, the same update by another route)."""
    data = make_data(120, ignore=False)
    unbroken = train(first, data, tokens=False, clip=0.5)["after"]
    part = train(first, data, tokens=False, clip=0.5, steps=2, save_after=2)
    saved = part["saved"]
    keys = sorted(saved["model"]) if dist.get_rank() == 0 else []
    del part
    resumed = train(second, data, tokens=False, clip=0.5, seed=99, start=saved, skip=2)["after"]
    return {"name": name, "first": describe_config(first), "second": describe_config(second),
            "step3_max_abs": difference(resumed, unbroken[2:])[0], "saved_keys": keys,
            "plain_keys": sorted(n for n, _ in TokenNet().named_parameters())}


def memory_case(cfg: ab.BalanceConfig) -> dict[str, Any]:
    data = make_data(60, ignore=False)
    tracker = CpuMemoryTracker()
    gc.collect()
    with tracker:
        plan = ab.plan(config=cfg, device="cpu", seed=0)
        torch.manual_seed(0)
        model = plan.wrap(TokenNet(vocab=4096, width=32, depth=2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        loader = plan.dataloader(data, seed=3)
        peaks = []
        for i, micro_batches in enumerate(plan.steps(loader)):
            if i == 6:
                break
            tracker.start_window()  # each step's own peak; from step 2 on, the optimizer state exists
            for x, y in micro_batches:
                with plan.micro_step():
                    plan.backward(loss_of(model, x, y))
            plan.optimizer_step(opt)
            peaks.append(tracker.window_peak)
        peak = min(peaks[1:])  # the same step each time: the lowest is the one no late free inflated
        state = state_bytes(opt)
        info = plan.model_info.get("param_sharding")
        facts = {k: v for k, v in plan.model_info.items() if k != "param_sharding"}
        params = sum(full_tensor(p.detach()).numel() * 4 for p in model.parameters())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"peak": peak, "state_bytes": state})
    del model, opt, plan
    gc.collect()
    return {"describe": describe_config(cfg), "config": cfg.to_dict(), "sharding": info, "param_bytes": params,
            "model": facts, "ranks": gathered}


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    uneven = [5, 2, 4][:world]
    ckpt = [[0, 2]] + [[] for _ in range(world - 1)]

    def even(**kw: Any) -> ab.BalanceConfig:
        return ab.BalanceConfig(micro_batches=[3] * world, accumulation=2, global_batch=6 * world, **kw)

    def any_split(**kw: Any) -> ab.BalanceConfig:
        return ab.BalanceConfig.any_split(rank_samples=uneven, accumulation=2, **kw)

    results: dict[str, Any] = {"cases": [], "resume": [], "memory": []}
    for mode in ("embeddings", "blocks"):
        results["cases"] += [
            case(f"{mode} even", even(param_sharding=mode)),
            case(f"{mode} uneven ckpt clip", any_split(param_sharding=mode, checkpoint=ckpt), clip=0.05),
            case(f"{mode} uneven tokens keep", any_split(param_sharding=mode, keep_gathered=[mode]), tokens=True),
        ]
    results["cases"].append(case("control: equal weights on an uneven split", any_split(param_sharding="blocks"),
                                 wrong_weights=True))
    if world == 2:
        results["cases"] += [
            case("blocks uneven tokens ckpt clip keep both",
                 any_split(param_sharding="blocks", checkpoint=[[1], [0, 1, 2]], keep_gathered=["embeddings", "blocks"]),
                 tokens=True, clip=0.05),
            case("embeddings micro-batches 1,3 accumulation 3",
                 ab.BalanceConfig.any_split(rank_samples=[3, 9], accumulation=3, param_sharding="embeddings"),
                 clip=0.05),
        ]
        results["cases"].append(case("embeddings uneven regional compile", any_split(
            param_sharding="embeddings", compile="default", compile_scope="regional"), clip=0.05))
        # 19 samples: 2 full steps, then 5 (DDP's tail: 4 samples in 2 micro-steps on rank 0, 1 in 1 on rank 1)
        results["cases"].append(case("blocks epoch tail", any_split(param_sharding="blocks"), samples=19, clip=0.05))
    base = dict(rank_samples=uneven, accumulation=2, checkpoint=ckpt)
    results["resume"] = [
        resume_case("sharded into sharded", ab.BalanceConfig.any_split(**base, param_sharding="blocks"),
                    ab.BalanceConfig.any_split(**base, param_sharding="blocks")),
        resume_case("sharded into DDP", ab.BalanceConfig.any_split(**base, param_sharding="embeddings"),
                    ab.BalanceConfig.any_split(**base)),
        resume_case("DDP into sharded", ab.BalanceConfig.any_split(**base),
                    ab.BalanceConfig.any_split(**base, param_sharding="blocks")),
    ]
    mem = dict(micro_batches=[2] * world, accumulation=1, global_batch=2 * world)
    for cfg in (ab.BalanceConfig(**mem, gradient_as_bucket_view=True),
                ab.BalanceConfig(**mem, param_sharding="embeddings"), ab.BalanceConfig(**mem, param_sharding="blocks")):
        runs = [memory_case(cfg) for _ in range(3)]  # gloo frees a collective's buffers when its thread is done
        runs[0]["ranks"] = [min(pair, key=lambda r: r["peak"]) for pair in zip(*(run["ranks"] for run in runs), strict=True)]
        results["memory"].append(runs[0])
    write_and_exit(out, results)


if __name__ == "__main__":
    main()
