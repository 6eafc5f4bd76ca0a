"""Run by ``tests/test_integrations.py`` under torchrun (gloo, CPU): each named integration trains a
tiny model 3 optimizer steps with an uneven split, accumulation and checkpointing, and rank 0 writes
how far its parameters are from one process's full-batch SGD over the same global batches.

    torchrun --nproc-per-node 2 tests/integrations_exact.py OUT.json lightning,hf,accelerate

Per framework the JSON holds ``rel_error`` (the integration vs the full-batch update), ``rel_error_unweighted``
(what DDP's plain average would give: the split's own effect, so the check can fail) and
``hook_calls`` (buckets the rank weighting hook all-reduced).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autobalance as ab
from autobalance._config import BalanceConfig
from autobalance.runtime import epoch_schedule

STEPS = 3
LR = 0.5
DIM = 6


def config_for(world: int) -> BalanceConfig:
    """Uneven ranks, two micro-steps of unequal sizes on some ranks, different checkpointed blocks."""
    if world == 2:
        return BalanceConfig.any_split(rank_samples=[7, 4], accumulation=2, checkpoint=[[0, 1], [1]])
    if world == 3:
        return BalanceConfig.any_split(rank_samples=[6, 3, 2], accumulation=2, checkpoint=[[0], [1, 2], []])
    raise SystemExit(f"world size {world} is not one this check knows")


def blocks_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(3)], nn.Linear(DIM, 3))


def dataset(n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, DIM, generator=g), torch.randint(0, 3, (n,), generator=g))


def reference(config: BalanceConfig, data: torch.utils.data.TensorDataset, seed: int, *, weighted: bool) -> list[torch.Tensor]:
    """One process's SGD on each step's whole global batch (``weighted``), or DDP's plain average of
    the ranks' mean-loss gradients (not weighted: what an uneven split gives without the hook)."""
    model = blocks_model().double()
    x_all, y_all = data.tensors
    schedule = epoch_schedule(num_samples=len(data), config=config, epoch=0, seed=seed)
    for layout in schedule.steps[:STEPS]:
        model.zero_grad()
        if weighted:
            idx = [i for rank in layout.micro_batches for mb in rank for i in mb]
            F.cross_entropy(model(x_all[idx].double()), y_all[idx]).backward()
        else:
            for rank in layout.micro_batches:
                idx = [i for mb in rank for i in mb]
                (F.cross_entropy(model(x_all[idx].double()), y_all[idx]) / len(layout.micro_batches)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad  # type: ignore[operator]
    return [p.detach().float() for p in model.parameters()]


def rel_error(params: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    diff = torch.cat([(a.detach().float().cpu() - b).flatten() for a, b in zip(params, ref, strict=True)])
    return float(diff.norm() / torch.cat([b.flatten() for b in ref]).norm())


def hook_calls(loop: Any) -> int:
    """Buckets the rank weighting hook all-reduced (0: no hook registered)."""
    return loop.weighting.calls if loop.weighting is not None else 0


def run_lightning(config: BalanceConfig, data: Any, world: int) -> tuple[list[torch.Tensor], int]:
    import lightning.pytorch as pl

    from autobalance.integrations.lightning import BalanceStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = blocks_model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    strategy = BalanceStrategy(ab.plan(config=config))
    module = Module()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=4))
    return list(module.net.parameters()), hook_calls(strategy.ab_loop)


class _DictData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, data: torch.utils.data.TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.data[i]
        return {"x": x, "labels": y}


class _LossNet(nn.Module):
    """The blocks model as a Trainer wants it: ``forward(x, labels)`` returns the mean loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = blocks_model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def run_hf(config: BalanceConfig, data: Any, world: int) -> tuple[list[torch.Tensor], int]:
    import tempfile

    from transformers import TrainingArguments

    from autobalance.integrations.hf import BalanceTrainer

    model = _LossNet()
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=4, max_steps=STEPS, learning_rate=LR,
                                 lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, report_to="none",
                                 save_strategy="no", logging_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
        trainer = BalanceTrainer(model=model, args=args, train_dataset=_DictData(data),
                                 optimizers=(torch.optim.SGD(model.parameters(), lr=LR), None),
                                 plan=ab.plan(config=config))
        trainer.train()
    return list(model.net.parameters()), hook_calls(trainer.ab_loop)


def run_accelerate(config: BalanceConfig, data: Any, world: int) -> tuple[list[torch.Tensor], int]:
    from accelerate import Accelerator

    from autobalance.integrations.accelerate import AccelerateBalance

    balance = AccelerateBalance(ab.plan(config=config))
    accelerator = Accelerator(**balance.accelerator_kwargs())
    net = blocks_model()
    model, optimizer, loader = balance.prepare(accelerator, net, torch.optim.SGD(net.parameters(), lr=LR), data)
    steps = 0
    for x, y in loader:
        with accelerator.accumulate(model), balance.micro_step():
            balance.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        steps += accelerator.sync_gradients
        if steps == STEPS:
            break
    return list(net.parameters()), hook_calls(balance.loop)


RUNNERS = {"lightning": run_lightning, "hf": run_hf, "accelerate": run_accelerate}


def main() -> None:
    out, names = sys.argv[1], sys.argv[2].split(",")
    world = int(os.environ["WORLD_SIZE"])
    config = config_for(world)
    data = dataset(config.global_batch * STEPS)
    results: dict[str, Any] = {}
    for name in names:
        params, calls = RUNNERS[name](config, data, world)
        results[name] = {
            "rel_error": rel_error(params, reference(config, data, 0, weighted=True)),
            "rel_error_unweighted": rel_error(params, reference(config, data, 0, weighted=False)),
            "hook_calls": calls,
        }
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    main()
