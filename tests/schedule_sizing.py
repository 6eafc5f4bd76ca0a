"""Run by ``tests/test_schedule_sizing.py`` under torchrun (gloo, CPU, 2 ranks): a cosine learning-rate
schedule stepped once per optimizer step, sized as the README and docs/frameworks.md say, over exactly
one epoch; rank 0 writes what every rank saw.

    torchrun --nproc-per-node 2 tests/schedule_sizing.py OUT.json

Cases (each a JSON entry, with every rank's figures):

- ``plan/<configuration>/<sizing>``: ``plan.steps`` with ``T_max = plan.steps_per_epoch(loader)``
  (``documented``) or the natural ``T_max = len(loader)`` (``natural``: what the check must catch),
  for the script's own configuration, an accumulation-2 one and an uneven any-split one whose partial
  last step has a different number of micro-batches on each rank;
- ``lightning``: ``T_max = self.trainer.estimated_stepping_batches`` in ``configure_optimizers``;
- ``hf``: the Trainer's own ``lr_scheduler_type="cosine"`` over ``num_train_epochs=1``;
- ``accelerate``: ``T_max = balance.steps_per_epoch()``, stepped when ``accelerator.sync_gradients``.

Each entry per rank: ``steps`` (optimizer steps taken in the epoch), ``t_max`` (what the schedule was
sized by), ``lrs`` (the rate each step used), ``final_lr`` (after the epoch's last step) and
``len_loader`` / ``micro_batches`` where they apply.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autobalance as ab
from autobalance._config import BalanceConfig

LR = 0.1
DIM = 4


def configs() -> dict[str, BalanceConfig | None]:
    """None: the script's own defaults (micro-batch 4, accumulation 1)."""
    return {
        "script": None,
        "accumulation-2": BalanceConfig(micro_batches=[4, 4], accumulation=2, global_batch=16),
        "uneven": BalanceConfig.any_split(rank_samples=[7, 4], accumulation=2),
    }


SAMPLES = {"script": 32, "accumulation-2": 64, "uneven": 3 * 11 + 7}
"""The dataset of each case: whole steps only for the first two; the uneven one has a partial last
step of 7 samples, 4 + 3: one micro-batch on rank 0 (micro-batches of up to 4), two on rank 1 (up to 2)."""


def dataset(n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, DIM, generator=g), torch.randint(0, 2, (n,), generator=g))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 2))


def run_plan(config: BalanceConfig | None, n: int, sizing: str) -> dict[str, Any]:
    plan = ab.plan(micro_batch=4) if config is None else ab.plan(config=config)
    net = plan.wrap(model())
    loader = plan.dataloader(dataset(n))
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    t_max = plan.steps_per_epoch(loader) if sizing == "documented" else len(loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t_max)
    lrs, micro = [], 0
    for micro_batches in plan.steps(loader):
        lrs.append(optimizer.param_groups[0]["lr"])
        for x, y in micro_batches:
            micro += 1
            with plan.micro_step():
                plan.backward(F.cross_entropy(net(x), y))
        plan.optimizer_step(optimizer)
        scheduler.step()
    return {"steps": len(lrs), "t_max": t_max, "lrs": lrs, "final_lr": optimizer.param_groups[0]["lr"],
            "len_loader": len(loader), "micro_batches": micro}


def run_lightning(config: BalanceConfig, n: int) -> dict[str, Any]:
    import lightning.pytorch as pl

    from autobalance.integrations.lightning import BalanceStrategy

    seen: dict[str, Any] = {"lrs": []}

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=LR)
            seen["t_max"] = int(self.trainer.estimated_stepping_batches)  # optimizer steps, accumulation counted
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=seen["t_max"])
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            seen["lrs"].append(optimizer.param_groups[0]["lr"])

    strategy = BalanceStrategy(ab.plan(config=config))
    module = Module()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(dataset(n), batch_size=4))
    return {"steps": trainer.global_step, "t_max": seen["t_max"], "lrs": seen["lrs"],
            "final_lr": trainer.optimizers[0].param_groups[0]["lr"],
            "plan_steps_per_epoch": strategy.ab_plan.steps_per_epoch()}


class _DictData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, data: torch.utils.data.TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.data[i]
        return {"x": x, "labels": y}


class _LossNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def run_hf(config: BalanceConfig, n: int) -> dict[str, Any]:
    from transformers import TrainerCallback, TrainingArguments

    from autobalance.integrations.hf import BalanceTrainer

    lrs: list[float] = []

    class Rates(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            lrs.append(kwargs["optimizer"].param_groups[0]["lr"])

    net = _LossNet()
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=4, num_train_epochs=1, learning_rate=LR,
                                 lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
                                 report_to="none", save_strategy="no", logging_strategy="no", use_cpu=True, seed=0,
                                 disable_tqdm=True)
        optimizer = torch.optim.SGD(net.parameters(), lr=LR)
        trainer = BalanceTrainer(model=net, args=args, train_dataset=_DictData(dataset(n)),
                                 optimizers=(optimizer, None), plan=ab.plan(config=config), callbacks=[Rates()])
        trainer.train()
    return {"steps": trainer.state.global_step, "t_max": trainer.state.max_steps, "lrs": lrs,
            "final_lr": optimizer.param_groups[0]["lr"], "plan_steps_per_epoch": trainer.ab_plan.steps_per_epoch()}


def run_accelerate(config: BalanceConfig, n: int) -> dict[str, Any]:
    from accelerate import Accelerator

    from autobalance.integrations.accelerate import AccelerateBalance

    balance = AccelerateBalance(ab.plan(config=config))
    accelerator = Accelerator(**balance.accelerator_kwargs())
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    wrapped, prepared, loader = balance.prepare(accelerator, net, optimizer, dataset(n))
    t_max = balance.steps_per_epoch()
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t_max)
    lrs: list[float] = []
    for x, y in loader:
        with accelerator.accumulate(wrapped), balance.micro_step():
            balance.backward(F.cross_entropy(wrapped(x), y))
            if accelerator.sync_gradients:
                lrs.append(optimizer.param_groups[0]["lr"])
            prepared.step()
            prepared.zero_grad()
        if accelerator.sync_gradients:
            scheduler.step()
    return {"steps": len(lrs), "t_max": t_max, "lrs": lrs, "final_lr": optimizer.param_groups[0]["lr"],
            "len_loader": len(loader)}


def main() -> None:
    out = sys.argv[1]
    frameworks = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else []
    results: dict[str, Any] = {}
    for name, config in configs().items():
        for sizing in ("documented", "natural"):
            results[f"plan/{name}/{sizing}"] = run_plan(config, SAMPLES[name], sizing)
    uneven = configs()["uneven"]
    assert uneven is not None
    runners = {"lightning": run_lightning, "hf": run_hf, "accelerate": run_accelerate}
    for name in frameworks:
        results[name] = runners[name](uneven, SAMPLES["uneven"])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if int(os.environ["RANK"]) == 0:
        merged = {key: [ranks[key] for ranks in gathered] for key in results}
        with open(out, "w") as fh:
            json.dump(merged, fh)


if __name__ == "__main__":
    main()
