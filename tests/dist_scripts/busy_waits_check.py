"""Run by tests under torchrun (gloo, 2 ranks, rank 1 slowed by ``AUTOBALANCE_EMULATE_MS_PER_SAMPLE``):
each rank's busy time per step must leave out its waits for the other rank, also where the wait is
not the gradient all-reduce's (issue 33).

argv: output path, steps. Three cases, each a trial (the busy meter on) of ``tests/scripts/user_train.py``'s
model and loop, micro-batches of 8, one micro-step per step:

- ``second_forward``: LayerNorm, the model called once more per micro-step under ``no_grad`` (a
  teacher's target): DDP rebuilds its gradient buckets in the second step's first forward with
  gradients, a broadcast from rank 0 that waits for rank 1's sleep;
- ``batchnorm``: BatchNorm1d, whose running statistics DDP broadcasts from rank 0 before every
  step's forward (``broadcast_buffers``): a wait for rank 1's sleep at every step;
- ``batchnorm_zero1``: the same with ``optimizer_sharding='zero1'`` (Adam): the parameter broadcasts
  of the sharded optimizer's exchange are timed as wait too.

Rank 0 writes ``{case: {"busy": [[s per step] per rank], "wait": [...]}}``.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from _finish import write_and_exit
from user_train import Net

import autobalance as ab
from autobalance.runtime import _plan

CASES = {
    "second_forward": {"norm": "layer", "no_grad_forward": True, "sharding": "off"},
    "batchnorm": {"norm": "batch", "no_grad_forward": False, "sharding": "off"},
    "batchnorm_zero1": {"norm": "batch", "no_grad_forward": False, "sharding": "zero1"},
}


def run(case: dict, steps: int) -> dict:
    config = ab.BalanceConfig(micro_batches=[8, 8], accumulation=1, global_batch=16,
                              optimizer_sharding=case["sharding"])
    with tempfile.TemporaryDirectory() as trial_dir:
        # a trial (the busy meter on) that does not end inside these steps
        os.environ.update({"AUTOBALANCE_TRIAL_DIR": trial_dir, "AUTOBALANCE_CONFIG": config.to_json(),
                           "AUTOBALANCE_STEPS": "1000", "AUTOBALANCE_WARMUP": "0"})
        plan = ab.plan(micro_batch=8)
        torch.manual_seed(0)
        model = plan.wrap(Net(norm=case["norm"], body="sequential"))
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(16 * steps, 16, generator=g),
                                              torch.randint(0, 4, (16 * steps,), generator=g))
        opt = plan.optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
        for micro_batches in plan.steps(plan.dataloader(data)):
            for x, y in micro_batches:
                with plan.micro_step():
                    if case["no_grad_forward"]:
                        with torch.no_grad():
                            model(x)
                    logits, _ = model(x)
                    plan.backward(F.cross_entropy(logits, y))
            plan.optimizer_step(opt)
        meter = _plan.CURRENT_PLAN.busy if _plan.CURRENT_PLAN is not None else None
        gathered: list = [None, None]
        dist.all_gather_object(gathered, {"busy": list(meter.busy_s) if meter else None,
                                          "wait": list(meter.wait_s) if meter else None})
        for key in ("AUTOBALANCE_TRIAL_DIR", "AUTOBALANCE_CONFIG", "AUTOBALANCE_STEPS", "AUTOBALANCE_WARMUP"):
            os.environ.pop(key)
    return {"busy": [g["busy"] for g in gathered], "wait": [g["wait"] for g in gathered]}


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    result = {name: run(case, steps) for name, case in CASES.items()}
    write_and_exit(out, result)


if __name__ == "__main__":
    main()
