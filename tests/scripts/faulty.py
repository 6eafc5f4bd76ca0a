"""A tiny DDP training script with injectable faults, for the tuner's end-to-end and fault tests.

AB_FAULT selects the fault (default none); AB_FAULT_ON_LAUNCH=N injects it only on the N-th
launch (counted in AB_FAULT_COUNTER, a file; 1-based), so earlier trials succeed.
Faults: import_error, raise, oom_backward_rank1, sigkill_rank1, hang_rank1, exit0_rank1,
garbage_report_rank1, hang_all.
"""

from __future__ import annotations

import os
import signal
import sys
import time

FAULT = os.environ.get("AB_FAULT", "none")


def launch_number() -> int:
    counter = os.environ.get("AB_FAULT_COUNTER")
    if not counter:
        return 1
    if os.environ.get("RANK", "0") == "0":
        n = int(open(counter).read() or 0) + 1 if os.path.exists(counter) else 1
        with open(counter + ".tmp", "w") as fh:
            fh.write(str(n))
        os.replace(counter + ".tmp", counter)
        return n
    for _ in range(100):  # rank 1 reads what rank 0 wrote for this launch
        if os.path.exists(counter):
            break
        time.sleep(0.05)
    return int(open(counter).read() or 1)


ON = int(os.environ.get("AB_FAULT_ON_LAUNCH", "1"))
if FAULT == "import_error" and launch_number() >= ON:
    import this_module_does_not_exist  # noqa: F401

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import autobalance as ab  # noqa: E402


def main() -> None:
    plan = ab.plan(micro_batch=4)
    active = FAULT != "none" and launch_number() >= ON
    rank = plan.rank
    torch.manual_seed(0)
    model = plan.wrap(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    data = torch.utils.data.TensorDataset(torch.randn(400, 32), torch.randint(0, 4, (400,)))
    loader = plan.dataloader(data)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if active and FAULT == "raise":
        raise ValueError("injected failure in the training script")
    for step, micro_batches in enumerate(plan.steps(loader)):
        if active and step == 1 and rank == 1:
            if FAULT == "sigkill_rank1":
                os.kill(os.getpid(), signal.SIGKILL)
            if FAULT == "hang_rank1":
                time.sleep(3600)
            if FAULT == "exit0_rank1":
                os._exit(0)
            if FAULT == "garbage_report_rank1":
                with open(os.path.join(os.environ["AUTOBALANCE_TRIAL_DIR"], "rank1.json"), "w") as fh:
                    fh.write("{not json")
                os._exit(0)
        if active and step == 1 and FAULT == "hang_all":
            time.sleep(3600)
        for x, y in micro_batches:
            with plan.micro_step():
                loss = F.cross_entropy(model(x), y)
                if active and step == 1 and rank == 1 and FAULT == "oom_backward_rank1":
                    # rank 1 runs out of memory inside backward while rank 0 waits in the all-reduce
                    loss = loss * _OomInBackward.apply(torch.ones(()))
                plan.backward(loss)
        plan.optimizer_step(opt)


class _OomInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        raise torch.OutOfMemoryError("injected: out of memory in backward")


if __name__ == "__main__":
    sys.exit(main())
