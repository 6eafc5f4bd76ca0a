"""One CPU process: a ``BalanceTrainer`` over TrainingArguments with ``gradient_checkpointing=True`` and
no plan of the script's own; prints the plan's checkpointed blocks, whether transformers' own
checkpointing was on during the step, how many blocks autobalance wrapped, and whether the Trainer
would still compile (the arguments say ``torch_compile=True``; the configuration says no compile)."""

from __future__ import annotations

import tempfile

from hf_precision import Tokens  # tests/scripts/hf_precision.py, beside this script
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from autobalance.integrations.hf import BalanceTrainer


def main() -> None:
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=3, n_head=2))
    hf_own: list[bool] = []
    model.transformer.register_forward_pre_hook(lambda m, a: hf_own.append(bool(m.gradient_checkpointing)))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to="none", save_strategy="no", max_steps=1,
                                 disable_tqdm=True, per_device_train_batch_size=2, gradient_checkpointing=True,
                                 torch_compile=True)
        trainer = BalanceTrainer(model=model, args=args, train_dataset=Tokens())
        compiles = str(trainer.accelerator.state.dynamo_plugin.backend.value).lower() != "no"
        trainer.train()
    wrapped = sum(isinstance(b, CheckpointWrapper) for b in model.transformer.h)
    print("RESULT", ",".join(map(str, trainer.ab_plan.config.checkpoint[0])), any(hf_own), wrapped, compiles,
          flush=True)


if __name__ == "__main__":
    main()
