"""One CPU process: a ``BalanceTrainer`` whose plan says ``argv[1]`` (fp32 / bf16) over TrainingArguments
built without ``bf16=``; prints the Accelerator's mixed precision and the dtype a block's matmul ran in."""

from __future__ import annotations

import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import autobalance as ab
from autobalance.integrations.hf import BalanceTrainer


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(8) + i) % 64
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    plan = ab.plan(micro_batch=2, dtype=sys.argv[1])
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=2))
    seen: list[torch.dtype] = []
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to="none", save_strategy="no", max_steps=1,
                                 disable_tqdm=True)
        trainer = BalanceTrainer(model=model, args=args, train_dataset=Tokens(), plan=plan)
        trainer.train()
    print("RESULT", trainer.accelerator.mixed_precision, str(seen[0]).removeprefix("torch."), flush=True)


if __name__ == "__main__":
    main()
