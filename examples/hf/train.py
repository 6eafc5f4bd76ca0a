"""A Hugging Face ``Trainer`` script that adopts autobalance with two lines (``BalanceTrainer``).

    torchrun --nproc-per-node 2 examples/hf/train.py
    autobalance tune examples/hf/train.py --trials 10 --nproc-per-node 2 --device cpu

A small GPT-2 built from its config (no download) on random token sequences of one length, or with
``--variable-length`` of 4 to ``--length`` tokens, padded per micro-batch (labels -100 on the padding).
The loss is transformers' mean over the step's label tokens on every rank (``num_items_in_batch``),
which ``BalanceTrainer`` keeps for any split. It takes its defaults from the ``TrainingArguments`` and
applies the configuration.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from autobalance.integrations.hf import BalanceTrainer  # ab


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, length: int, vocab: int, *, variable: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)
        self.lengths = torch.randint(4, length + 1, (n,), generator=g) if variable else torch.full((n,), length)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i, : int(self.lengths[i])]
        return {"input_ids": ids, "labels": ids}


def pad(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right padding to the micro-batch's longest sequence: labels -100 and attention mask 0 on the padding."""
    longest = max(len(it["input_ids"]) for it in items)
    batch = {"input_ids": torch.zeros(len(items), longest, dtype=torch.long),
             "attention_mask": torch.zeros(len(items), longest, dtype=torch.long),
             "labels": torch.full((len(items), longest), -100, dtype=torch.long)}
    for row, it in enumerate(items):
        n = len(it["input_ids"])
        batch["input_ids"][row, :n], batch["attention_mask"][row, :n], batch["labels"][row, :n] = \
            it["input_ids"], 1, it["labels"]
    return batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--variable-length", action="store_true",
                        help="sequences of 4 to --length tokens, padded per micro-batch (labels -100 there)")
    parser.add_argument("--rank0-extra-mib", type=float, default=0.0,
                        help="memory only rank 0 holds (a cached validation batch): what makes an uneven split pay")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=args.length, n_embd=args.width, n_layer=args.layers,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        # the Trainer sizes its learning-rate schedule (lr_scheduler_type, warm-up) in optimizer steps of the
        # loader BalanceTrainer builds: the configuration's accumulation is counted, nothing to size by hand
        training = TrainingArguments(output_dir=out, per_device_train_batch_size=args.micro_batch, num_train_epochs=1,
                                     learning_rate=1e-3, report_to="none", save_strategy="no", logging_strategy="no",
                                     use_cpu=not torch.cuda.is_available(), disable_tqdm=True, seed=0)
        trainer = BalanceTrainer(model=model, args=training,  # ab: was Trainer(...)
                                 train_dataset=Tokens(args.samples, args.length, config.vocab_size,
                                                      variable=args.variable_length),
                                 data_collator=pad if args.variable_length else None)
        rank0 = trainer.ab_plan.rank == 0
        cache = torch.randn(int(args.rank0_extra_mib * 2**20) // 4) if rank0 else None
        trainer.train()
        del cache
    if trainer.is_world_process_zero():
        print("done", flush=True)


if __name__ == "__main__":
    main()
