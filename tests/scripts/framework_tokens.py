"""A Lightning, Accelerate or Hugging Face ``Trainer`` script whose loss is the mean over the real tokens
of padded variable-length sequences (``ignore_index``): the script a user writes with an integration.
By default it hands each micro-batch's token count (Lightning's and Accelerate's count line; for the
``Trainer``, a model that takes transformers' ``num_items_in_batch``); ``--no-count`` leaves that out
(the integration then weights micro-batches by samples).

    torchrun --nproc-per-node 2 tests/scripts/framework_tokens.py --framework accelerate [--no-count]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH, IGNORE, SAMPLES = 13, 16, 16, -100, 64


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                      for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(x)))


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (SAMPLES,), generator=g)
    y[torch.arange(SEQ)[None, :] >= lengths[:, None]] = IGNORE
    return torch.utils.data.TensorDataset(x, y)


def token_mean(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=IGNORE)


def run_lightning(count: bool) -> None:
    import lightning.pytorch as pl

    from autobalance.integrations.lightning import BalanceStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = TinyLM()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = token_mean(self.net(x), y)
            return {"loss": loss, "count": (y != IGNORE).sum()} if count else loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    strategy = BalanceStrategy(micro_batch=8)
    trainer = pl.Trainer(accelerator="cpu", devices=strategy.devices, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), train_dataloaders=torch.utils.data.DataLoader(dataset(), batch_size=8))


def run_accelerate(count: bool) -> None:
    from accelerate import Accelerator

    from autobalance.integrations.accelerate import AccelerateBalance

    balance = AccelerateBalance(micro_batch=8)
    accelerator = Accelerator(**balance.accelerator_kwargs())
    torch.manual_seed(0)
    net = TinyLM()
    model, optimizer, loader = balance.prepare(accelerator, net, torch.optim.SGD(net.parameters(), lr=0.1), dataset())
    for x, y in loader:
        with accelerator.accumulate(model), balance.micro_step():
            loss = token_mean(model(x), y)
            balance.backward(loss, count=(y != IGNORE).sum() if count else None)
            optimizer.step()
            optimizer.zero_grad()


class HFNet(nn.Module):
    """The model as a ``Trainer`` wants it: ``forward(input_ids, labels)`` returns the loss. With
    ``accepts_loss_kwargs`` (transformers' test) the loss is the label sum over ``num_items_in_batch``
    (the step's tokens on every rank), as transformers' own models compute it; else each micro-batch's
    own token mean."""

    def __init__(self, accepts_loss_kwargs: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyLM()
        self.accepts_loss_kwargs = accepts_loss_kwargs

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None,
                **kwargs: Any) -> dict[str, torch.Tensor]:
        logits = self.net(input_ids)
        if num_items_in_batch is None:
            return {"loss": token_mean(logits, labels), "logits": logits}
        total = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
        return {"loss": total / num_items_in_batch, "logits": logits}


class _Dicts(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.data = dataset()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.data[i]
        return {"input_ids": x, "labels": y}


def run_hf(count: bool) -> None:
    import tempfile

    from transformers import TrainingArguments

    from autobalance.integrations.hf import BalanceTrainer

    model = HFNet(accepts_loss_kwargs=count)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, num_train_epochs=1, learning_rate=0.1,
                                 optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
                                 report_to="none", save_strategy="no", logging_strategy="no", use_cpu=True, seed=0,
                                 disable_tqdm=True)
        BalanceTrainer(model=model, args=args, train_dataset=_Dicts()).train()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=["lightning", "accelerate", "hf"], required=True)
    p.add_argument("--no-count", action="store_true", help="leave the count line out")
    args = p.parse_args()
    {"lightning": run_lightning, "accelerate": run_accelerate, "hf": run_hf}[args.framework](not args.no_count)


if __name__ == "__main__":
    main()
