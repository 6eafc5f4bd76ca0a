"""Run by tests under torchrun (gloo, 2 ranks): a rank emulated slower (``AUTOBALANCE_EMULATE_MS_PER_SAMPLE``)
measured by the busy meter inside a trial must leave every update exact, and the busy times must say
which rank is slow.

argv: output path. Rank 0 writes ``{"cases": [...], "busy": [[...] per rank], "wait": [[...] per rank]}``:
each case is grad_check's ``one_case`` (a whole epoch, every step against one process's update) of
a split that gives the slow rank fewer samples, run as a trial (``AUTOBALANCE_TRIAL_DIR`` set, so the
busy meter's gradient hooks are on) with the emulation set by the test.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _finish import write_and_exit
from grad_check import one_case

import autobalance as ab
from autobalance.runtime import _plan


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(3)
    full = torch.utils.data.TensorDataset(torch.randn(400, 16, generator=g), torch.randint(0, 5, (400,), generator=g))
    configs = [
        ab.BalanceConfig(micro_batches=[12, 6], accumulation=2, global_batch=36, checkpoint=[[], [1, 2]],
                         bucket_cap_mb=1000.0),
        ab.BalanceConfig.any_split(rank_samples=[23, 8], accumulation=3, checkpoint=[[0], []],
                                   bucket_cap_mb=1000.0, gradient_as_bucket_view=True),
    ]
    cases, busy, wait = [], [], []
    for cfg in configs:
        with tempfile.TemporaryDirectory() as trial_dir:
            # a trial (the busy meter on) that does not end inside the epoch
            os.environ.update({"AUTOBALANCE_TRIAL_DIR": trial_dir, "AUTOBALANCE_CONFIG": cfg.to_json(),
                               "AUTOBALANCE_STEPS": "1000", "AUTOBALANCE_WARMUP": "0"})
            n = cfg.global_batch * 2 + 5
            cases.append(one_case(cfg, torch.utils.data.TensorDataset(full.tensors[0][:n], full.tensors[1][:n])))
            meter = _plan.CURRENT_PLAN.busy if _plan.CURRENT_PLAN is not None else None
            gathered: list = [None, None]
            dist.all_gather_object(gathered, {"busy": list(meter.busy_s) if meter else None,
                                              "wait": list(meter.wait_s) if meter else None})
            busy.append([g["busy"] for g in gathered])
            wait.append([g["wait"] for g in gathered])
    write_and_exit(out, {"cases": cases, "busy": busy, "wait": wait})


if __name__ == "__main__":
    main()
