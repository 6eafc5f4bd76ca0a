"""One CPU process: ``AccelerateBalance.prepare`` with an Accelerator built against the configuration
(``argv[1]``: ``dtype``, another mixed precision; ``dynamo``, its own compile backend; ``ok``, from
``balance.accelerator_kwargs()``); prints ``RESULT`` and the error's first words, or ``ok``."""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator

import autobalance as ab
from autobalance._errors import UsageError
from autobalance.integrations.accelerate import AccelerateBalance


def main() -> None:
    balance = AccelerateBalance(plan=ab.plan(micro_batch=2, dtype="bf16"))
    kwargs = balance.accelerator_kwargs()
    if sys.argv[1] == "dtype":
        kwargs["mixed_precision"] = "no"
    elif sys.argv[1] == "dynamo":
        kwargs["dynamo_backend"] = "inductor"
    accelerator = Accelerator(**kwargs)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
    try:
        balance.prepare(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    except UsageError as exc:
        print("RESULT", str(exc)[:40], flush=True)
        return
    print("RESULT ok", flush=True)


if __name__ == "__main__":
    main()
