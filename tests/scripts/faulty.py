"""A tiny DDP training script with injectable faults, for the tuner's end-to-end and fault tests.

AB_FAULT selects the fault (default none); AB_FAULT_ON_LAUNCH=N injects it from the N-th launch
on (counted in AB_FAULT_COUNTER, a file; 1-based), so earlier trials succeed; AB_FAULT_ONCE=1
injects it on the N-th launch only. AB_HOLD_FIRST_LAUNCH holds the first launch (see
hold_first_launch); a hold that gives up fails the trial loudly (see hold_timed_out).

Faults: import_error, raise, oom_backward_rank1, sigkill_rank1, hang_rank1, exit0_rank1,
garbage_report_rank1 (writes non-JSON in place of its report, exits 0 at step 1), hang_all,
and, at the very end of a successful trial, on rank 1 only: report_enospc_rank1 (the disk is full
when the report is written), report_eacces_rank1 (the report directory is not writable),
report_garbage_rank1 / report_truncated_rank1 (the written report is not JSON / cut short).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

from _hold import hold_timed_out  # tests/scripts/_hold.py, beside this script

FAULT = os.environ.get("AB_FAULT", "none")
ON = int(os.environ.get("AB_FAULT_ON_LAUNCH", "1"))
ONCE = os.environ.get("AB_FAULT_ONCE") == "1"


def launch_number() -> int:
    """1-based launch count; rank 0 increments it, the other ranks read the value of this launch."""
    counter = os.environ.get("AB_FAULT_COUNTER")
    if not counter:
        return 1
    trial = os.environ.get("AUTOBALANCE_TRIAL_DIR", "")  # unique per trial, cold or warm
    if os.environ.get("RANK", "0") == "0":
        n = 1
        if os.path.exists(counter):
            with open(counter) as fh:
                n = int(fh.read().split()[0]) + 1
        with open(counter + ".tmp", "w") as fh:
            fh.write(f"{n} {trial}")
        os.replace(counter + ".tmp", counter)
        return n
    for _ in range(600):  # the other ranks wait until rank 0 has counted this very launch
        if os.path.exists(counter):
            with open(counter) as fh:
                parts = fh.read().split()
            if len(parts) == 2 and parts[1] == trial:
                return int(parts[0])
        time.sleep(0.05)
    raise RuntimeError("faulty.py: rank 0 did not count this launch")


def fault_active() -> bool:
    if FAULT == "none":
        return False
    n = launch_number()
    return n == ON if ONCE else n >= ON


if FAULT == "import_error" and fault_active():
    import this_module_does_not_exist  # noqa: F401

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import autobalance as ab  # noqa: E402


def _break_report_writing(kind: str) -> None:
    """Rank 1's final report write fails (or writes garbage), as on a full disk or a bad mount."""
    import autobalance.runtime._exit as plan_module
    import autobalance.runtime._report as report_module

    original = report_module.write_report

    def broken(trial_dir: str, rank: int, report: dict) -> str:  # type: ignore[type-arg]
        if kind == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(trial_dir, f"rank{rank}.json"))
        if kind == "eacces":
            raise PermissionError(errno.EACCES, "Permission denied", trial_dir)
        path = report_module.report_path(trial_dir, rank)
        with open(path, "w") as fh:
            fh.write("\x00\x17garbage, not json" if kind == "garbage" else '{"schema": 1, "status": "ok", "rank": 1, "memo')
        return path

    plan_module.write_report = broken  # type: ignore[assignment]
    # a warm worker writes the trial's 'ok' report itself once it has cleaned up after the trial
    report_module.write_report = broken  # type: ignore[assignment]
    _ = original


def hold_first_launch() -> None:
    """AB_HOLD_FIRST_LAUNCH="GLOB|TEXT|N": rank 0 of the first launch (the baseline, which runs
    alone) waits, up to 45 s (under the process group's 60 s start-up timeout; AB_HOLD_TIMEOUT_S
    to change it), until N files matching GLOB contain TEXT: e.g. until the other tuners say they
    wait for this baseline. Fails the trial (hold_timed_out) if they never do."""
    spec = os.environ.get("AB_HOLD_FIRST_LAUNCH")
    if not spec or os.environ.get("RANK", "0") != "0" or launch_number() != 1:
        return
    import glob

    pattern, text, count = spec.split("|")

    def seen() -> int:
        n = 0
        for path in glob.glob(pattern):
            try:
                with open(path, errors="replace") as fh:
                    n += text in fh.read()
            except OSError:
                pass
        return n

    timeout = float(os.environ.get("AB_HOLD_TIMEOUT_S", "45"))
    deadline = time.monotonic() + timeout
    while (n := seen()) < int(count):
        if time.monotonic() >= deadline:
            hold_timed_out("faulty.py", f"AB_HOLD_FIRST_LAUNCH: after {timeout:g} s, {n} of the {count} files "
                                        f"matching {pattern} contain {text!r}")
        time.sleep(0.1)


def main() -> None:
    hold_first_launch()
    plan = ab.plan(micro_batch=4)
    active = fault_active()
    rank = plan.rank
    if active and rank == 1 and FAULT.startswith("report_") and FAULT.endswith("_rank1"):
        _break_report_writing(FAULT[len("report_"):-len("_rank1")])
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
            # a marker tests wait for: this rank hangs from now on (not merely slow to start)
            with open(os.path.join(os.environ["AUTOBALANCE_TRIAL_DIR"], f"hanging-rank{rank}"), "w"):
                pass
            time.sleep(3600)
        for x, y in micro_batches:
            with plan.micro_step():
                loss = F.cross_entropy(model(x), y)
                if active and step == 1 and rank == 1 and FAULT == "oom_backward_rank1":
                    # rank 1 runs out of memory inside backward while rank 0 waits in the all-reduce
                    loss = loss * _OomInBackward.apply(torch.ones((), requires_grad=True))
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
