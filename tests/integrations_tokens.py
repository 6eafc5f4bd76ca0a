"""Run by ``tests/test_integrations_tokens.py`` under torchrun (gloo, CPU): token-mean losses on padded
variable-length sequences (issue 42). Every run trains 3 full-batch AdamW steps (the dataset is one
global batch, one step per epoch: every arrangement sees the same samples per step), and rank 0
writes how far each run's parameters are from its reference.

    torchrun --nproc-per-node 2 tests/integrations_tokens.py OUT.json hf,lightning,accelerate

- ``hf``: transformers' own ``Trainer`` (its DDP, its sampler, the script's own split) is the
  reference; ``BalanceTrainer`` runs the script's own configuration and uneven ones (accumulation 1-3,
  micro-steps of unequal sizes, checkpointed blocks). ``per_sample`` is the control: the same uneven
  split with transformers' token normalisation off (the weighting before issue 42), which the check
  must see.
- ``lightning``, ``accelerate``: the reference is one process's AdamW on the whole batch's token mean
  (float64); each integration runs the configurations with the count line, and once without it
  (``no_count``, the control).
- ``sgd_update``: one uneven split (accumulation 3) with SGD and no clipping, the update (parameters
  less the starting ones) against the reference's: AdamW and clipping are blind to a loss scaled by a
  constant (a world size too many), SGD's update is not.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autobalance as ab
from autobalance._config import BalanceConfig

STEPS = 3
LR = 3e-3
SGD_LR = 0.5
"""SGD's rate: its update is proportional to the gradient, so a loss scaled wrong by any factor shows
(AdamW's first steps and clipping hide a constant factor)."""
VOCAB = 48
MAX_LEN = 24


def script_config(world: int) -> BalanceConfig:
    """The script's own split: micro-batch 4 (world 2) or 3 (world 3), accumulation 2."""
    micro = 4 if world == 2 else 3
    return BalanceConfig(micro_batches=[micro] * world, accumulation=2, global_batch=micro * 2 * world)


def uneven_configs(world: int) -> dict[str, BalanceConfig]:
    """Uneven ranks, accumulation 1 to 3, micro-steps of unequal sizes, checkpointed blocks."""
    if world == 2:  # global batch 16
        return {"acc1": BalanceConfig.any_split(rank_samples=[11, 5], accumulation=1, checkpoint=[[0], []]),
                "acc2": BalanceConfig.any_split(rank_samples=[5, 11], accumulation=2, checkpoint=[[0], [1]]),
                "acc3": BalanceConfig.any_split(rank_samples=[7, 9], accumulation=3, checkpoint=[[0, 1], []])}
    if world == 3:  # global batch 18
        return {"acc1": BalanceConfig.any_split(rank_samples=[9, 5, 4], accumulation=1, checkpoint=[[], [0], []]),
                "acc2": BalanceConfig.any_split(rank_samples=[3, 8, 7], accumulation=2, checkpoint=[[0], [], [1]]),
                "acc3": BalanceConfig.any_split(rank_samples=[3, 10, 5], accumulation=3, checkpoint=[[0, 1], [1], []])}
    raise SystemExit(f"world size {world} is not one this check knows")


class Sequences(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``n`` token sequences of 3 to ``MAX_LEN`` tokens (labels = inputs, as a causal LM trains)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(3, MAX_LEN + 1, (n,), generator=g)
        self.seqs = [torch.randint(1, VOCAB, (int(k),), generator=g) for k in lengths]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.seqs[i], "labels": self.seqs[i]}


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right padding to the micro-batch's longest: pad id 0, attention mask, labels -100 on padding."""
    longest = max(len(it["input_ids"]) for it in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    labels = torch.full((len(items), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for row, it in enumerate(items):
        n = len(it["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = it["input_ids"], it["labels"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters by their names in the model as built (a checkpointed block's wrapper left out)."""
    return {n.replace("._checkpoint_wrapped_module", ""): p.detach().clone() for n, p in model.named_parameters()}


def update(params: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the steps changed: ``params - start``."""
    return {k: params[k].double() - start[k].double() for k in start}


def rel_error(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert params.keys() == ref.keys(), sorted(set(params) ^ set(ref))
    diff = torch.cat([(params[k].double() - ref[k].double()).flatten() for k in ref])
    return float(diff.norm() / torch.cat([ref[k].double().flatten() for k in ref]).norm())


# ---------------------------------------------------------------------------------------------- HF
def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=MAX_LEN, n_embd=16, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def hf_params(world: int, data: Sequences, config: BalanceConfig | None, *, per_sample: bool = False,
              sgd: bool = False) -> dict[str, torch.Tensor]:
    """3 steps of transformers' ``Trainer`` (``config`` None) or of ``BalanceTrainer`` with ``config``: AdamW,
    cosine schedule, clipping at 1.0; ``sgd``: SGD at ``SGD_LR``, constant, no clipping (scale-sensitive)."""
    from transformers import Trainer, TrainingArguments

    from autobalance.integrations.hf import BalanceTrainer

    model = gpt2()
    micro = script_config(world).micro_batches[0]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=2,
                                 num_train_epochs=STEPS, learning_rate=SGD_LR if sgd else LR,
                                 lr_scheduler_type="constant" if sgd else "cosine", optim="sgd" if sgd else "adamw_torch",
                                 weight_decay=0.0, max_grad_norm=0.0 if sgd else 1.0, report_to="none", save_strategy="no", logging_strategy="no",
                                 use_cpu=True, seed=0, disable_tqdm=True, dataloader_drop_last=True)
        if config is None:
            trainer: Any = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
        else:
            trainer = BalanceTrainer(model=model, args=args, train_dataset=data, data_collator=collate,
                                     plan=ab.plan(config=config))
            if per_sample:  # the weighting before issue 42: each micro-batch's token mean weighted by samples
                trainer.model_accepts_loss_kwargs = False
        trainer.train()
        assert trainer.state.global_step == STEPS, trainer.state.global_step
    return params_of(model)


def run_hf(world: int) -> dict[str, Any]:
    data = Sequences(script_config(world).global_batch)
    reference = hf_params(world, data, None)
    results: dict[str, Any] = {"own": rel_error(hf_params(world, data, script_config(world)), reference)}
    uneven = uneven_configs(world)
    for name, config in uneven.items():
        results[name] = rel_error(hf_params(world, data, config), reference)
    results["per_sample"] = rel_error(hf_params(world, data, uneven["acc2"], per_sample=True), reference)
    start = params_of(gpt2())
    results["sgd_update"] = rel_error(update(hf_params(world, data, uneven["acc3"], sgd=True), start),
                                      update(hf_params(world, data, None, sgd=True), start))
    results["refused"] = hf_refusal(data)
    return results


def hf_refusal(data: Sequences) -> str:
    """What ``BalanceTrainer`` says of ``average_tokens_across_devices=False`` (each rank's own token mean)."""
    from transformers import TrainingArguments

    from autobalance._errors import UsageError
    from autobalance.integrations.hf import BalanceTrainer

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, average_tokens_across_devices=False,
                                 report_to="none", use_cpu=True, disable_tqdm=True)
        try:
            BalanceTrainer(model=gpt2(), args=args, train_dataset=data, data_collator=collate,
                           plan=ab.plan(config=script_config(int(os.environ["WORLD_SIZE"]))))
        except UsageError as exc:
            return str(exc)
    return "not refused"


# ------------------------------------------------------------------------------- Lightning, Accelerate
class TokenNet(nn.Module):
    """Embedding, three residual blocks, a head: logits per token."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 12)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(12, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def token_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over the real tokens (``ignore_index=-100``: padding left out)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def count_of(labels: torch.Tensor) -> torch.Tensor:
    return (labels != -100).sum()


def optimizer_for(params: Any, sgd: bool) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=SGD_LR) if sgd else torch.optim.AdamW(params, lr=LR)


def whole_batch_reference(data: Sequences, *, sgd: bool = False) -> dict[str, torch.Tensor]:
    """One process, float64: AdamW (or SGD) on the token mean over the whole batch, 3 steps."""
    net = TokenNet().double()
    opt = optimizer_for(net.parameters(), sgd)
    batch = collate([data[i] for i in range(len(data))])
    for _ in range(STEPS):
        opt.zero_grad()
        token_mean(net(batch["input_ids"]), batch["labels"]).backward()
        opt.step()
    return params_of(net)


def lightning_params(config: BalanceConfig, data: Sequences, world: int, *, with_count: bool,
                     sgd: bool = False) -> dict[str, torch.Tensor]:
    import lightning.pytorch as pl

    from autobalance.integrations.lightning import BalanceStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TokenNet()

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            loss = token_mean(self.net(batch["input_ids"]), batch["labels"])
            if with_count:
                return {"loss": loss, "count": count_of(batch["labels"])}  # the count line
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer_for(self.parameters(), sgd)

    strategy = BalanceStrategy(ab.plan(config=config), blocks="net.blocks")
    module = Module()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=4, collate_fn=collate))
    assert trainer.global_step == STEPS, trainer.global_step
    return params_of(module.net)


def accelerate_params(config: BalanceConfig, data: Sequences, world: int, *, with_count: bool,
                      sgd: bool = False) -> dict[str, torch.Tensor]:
    from accelerate import Accelerator

    from autobalance.integrations.accelerate import AccelerateBalance

    balance = AccelerateBalance(ab.plan(config=config))
    accelerator = Accelerator(**balance.accelerator_kwargs())
    net = TokenNet()
    model, optimizer, loader = balance.prepare(accelerator, net, optimizer_for(net.parameters(), sgd), data,
                                               blocks="blocks", collate_fn=collate)
    steps = 0
    while steps < STEPS:
        for batch in loader:
            with accelerator.accumulate(model), balance.micro_step():
                loss = token_mean(model(batch["input_ids"]), batch["labels"])
                if with_count:
                    balance.backward(loss, count=count_of(batch["labels"]))  # the count line
                else:
                    balance.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            steps += accelerator.sync_gradients
    assert steps == STEPS, steps
    return params_of(net)


def run_counted(runner: Callable[..., dict[str, torch.Tensor]], world: int) -> dict[str, Any]:
    data = Sequences(script_config(world).global_batch)
    reference = whole_batch_reference(data)
    results: dict[str, Any] = {"own": rel_error(runner(script_config(world), data, world, with_count=True), reference)}
    uneven = uneven_configs(world)
    for name, config in uneven.items():
        results[name] = rel_error(runner(config, data, world, with_count=True), reference)
    results["no_count"] = rel_error(runner(uneven["acc2"], data, world, with_count=False), reference)
    start = params_of(TokenNet())
    results["sgd_update"] = rel_error(update(runner(uneven["acc3"], data, world, with_count=True, sgd=True), start),
                                      update(whole_batch_reference(data, sgd=True), start))
    return results


RUNNERS: dict[str, Callable[[int], dict[str, Any]]] = {
    "hf": run_hf,
    "lightning": lambda world: run_counted(lightning_params, world),
    "accelerate": lambda world: run_counted(accelerate_params, world),
}


def main() -> None:
    out, names = sys.argv[1], sys.argv[2].split(",")
    world = int(os.environ["WORLD_SIZE"])
    results = {name: RUNNERS[name](world) for name in names}
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    main()
