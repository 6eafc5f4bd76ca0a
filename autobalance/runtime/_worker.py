"""The warm worker: one per rank, started once by torchrun, runs the user's script once per trial.

    torchrun ... -m autobalance.runtime._worker SCRIPT [ARGS...]

It keeps the process group, the CUDA context and the imported modules between trials. Requests
come from the launcher as ``request-<N>.json`` files in ``AUTOBALANCE_POOL_DIR`` (``stop`` ends the
worker). After each trial it cleans away what the trial left and reads what remains
(:mod:`autobalance.runtime._carryover`: why a warm trial's figures are a cold one's); only then is
the trial's ``ok`` report written, with a ``warm`` section: what the trial inherited from the
worker and, under ``recycle``, why the worker must not run another trial (the launcher then
restarts the pool). A trial that fails poisons the process group: the worker writes its report and
exits, and the launcher restarts the pool.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import json
import os
import runpy
import sys
import time
import traceback
from typing import Any

from autobalance import _env
from autobalance.protocol import Status
from autobalance.runtime._carryover import CarryoverLedger, clean_between_trials

_POLL_S = 0.01


def _patch_process_group_lifecycle() -> None:
    """The script's own ``init_process_group``/``destroy_process_group`` become safe to repeat."""
    import torch.distributed as dist

    original_init = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            original_init(*args, **kwargs)

    def destroy_process_group(*args: Any, **kwargs: Any) -> None:
        return None

    dist.init_process_group = init_process_group  # type: ignore[assignment]
    dist.destroy_process_group = destroy_process_group  # type: ignore[assignment]


def _init(device: str) -> None:
    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # a one-rank job needs no process group, and a cold one-rank run of the plan creates none:
        # NCCL's communicator would hold ~0.55 GiB on the device (measured on an H200) that every
        # warm trial would be charged and a cold run never has
        return
    timeout = datetime.timedelta(seconds=int(os.environ.get(_env.PG_TIMEOUT_S, "60")))
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo", timeout=timeout)


def _prepare_trial(device: str, budget: float | None) -> None:
    """What every trial starts from: the default activation budget, the seed, the whole device (a
    fresh process's memory fraction: a capped trial's cap must not stay on for one without, such as a
    verification run after the study's trials), fresh peak statistics (the previous trial's leftovers
    were cleaned when it ended)."""
    import torch

    if budget is not None:
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = budget
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.reset_peak_memory_stats()


def _ledger(device: str) -> CarryoverLedger:
    import torch

    from autobalance.runtime._memory import device_probe

    try:
        probe = device_probe(torch.device(device, torch.cuda.current_device()) if device == "cuda"
                             else torch.device(device))
    except Exception:  # no NVML: the allocator's figures are still cleaned and reported
        probe = None
    return CarryoverLedger(probe=probe)


def _write_ok(report: dict[str, Any] | None, trial_dir: str | None, rank: int, warm: dict[str, Any]) -> None:
    from autobalance.protocol import Status
    from autobalance.runtime._exit import report_not_written
    from autobalance.runtime._report import write_report

    if report is not None and trial_dir is not None:
        report["warm"] = warm
        try:
            write_report(trial_dir, rank, report)
        except Exception as exc:  # disk full, directory gone: said as a cold rank says it, then exit
            report_not_written(rank, trial_dir, Status.OK, exc)


def _wait_for_request(pool_dir: str, seq: int) -> dict[str, Any] | None:
    path = os.path.join(pool_dir, f"request-{seq}.json")
    stop = os.path.join(pool_dir, "stop")
    while True:
        if os.path.exists(path):
            with open(path) as fh:
                request: dict[str, Any] = json.load(fh)
            return request
        if os.path.exists(stop):
            return None
        time.sleep(_POLL_S)


def _apply_environment(request: dict[str, Any], base_env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(base_env)
    os.environ.update(request["env"])


class ScriptEnd(enum.Enum):
    """How one run of the script in a warm worker ended (not a :class:`Status`: nothing records it)."""

    FINISHED = "finished"
    """The trial's steps ran to the end (``TrialComplete``)."""
    EXITED = "exited"
    """The script ended (returned or ``sys.exit``) without finishing the trial."""
    RAISED = "raised"
    """The script raised."""


def _run_script(script: str, args: list[str]) -> tuple[ScriptEnd, BaseException | None, str]:
    from autobalance.runtime._exit import TrialComplete

    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except TrialComplete:
        return ScriptEnd.FINISHED, None, ""
    except SystemExit as exc:
        return ScriptEnd.EXITED, exc, ""
    except BaseException as exc:
        return ScriptEnd.RAISED, exc, traceback.format_exc()
    return ScriptEnd.EXITED, None, ""


def _report_failure(exc: BaseException, text: str) -> int:
    from autobalance.runtime import _plan
    from autobalance.runtime._exit import classify_exception

    status = classify_exception(exc)
    sys.stderr.write(text)
    plan = _plan.CURRENT_PLAN
    if plan is not None:
        with contextlib.suppress(Exception):
            plan.ending.write(status, error=f"{type(exc).__name__}: {exc}"[:2000], tb=text[-20000:])
    return _env.OOM_EXIT_CODE if status == Status.OOM else _env.ERROR_EXIT_CODE


def main(argv: list[str]) -> None:
    if not argv:
        sys.stderr.write("usage: python -m autobalance.runtime._worker SCRIPT [ARGS...]\n")
        os._exit(2)
    script, args = argv[0], argv[1:]
    job = _env.TrialEnv.read_job(os.environ)  # the pool's variables (restored before each trial: they stay)
    if job.pool_dir is None:
        raise KeyError(_env.POOL_DIR)
    pool_dir = job.pool_dir
    device = "cpu" if job.device is None else job.device
    from autobalance.runtime._exit import set_parent_death_signal

    set_parent_death_signal(job.trial_id)
    _init(device)
    ledger = _ledger(device)
    ledger.pool_started()  # a fresh worker: the reference for what later trials inherit
    with open(os.path.join(pool_dir, f"ready-{os.environ.get('LOCAL_RANK', '0')}"), "w"):
        pass  # the launcher starts the first trial's clock once every worker is here
    _patch_process_group_lifecycle()
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    base_env = dict(os.environ)
    import torch._functorch.config as functorch_config

    from autobalance.runtime._verify import precision_flags, restore_precision_flags

    budget = float(functorch_config.activation_memory_budget)  # restored before each trial
    flags = precision_flags()  # so are these
    seq = 0
    while True:
        request = _wait_for_request(pool_dir, seq)
        if request is None:
            break
        _apply_environment(request, base_env)
        _prepare_trial(device, budget)
        restore_precision_flags(flags)
        from autobalance.runtime import _plan

        _plan.CURRENT_PLAN = None
        warm = ledger.trial_starting()
        outcome, exc, text = _run_script(script, args)
        plan = _plan.CURRENT_PLAN
        if outcome is ScriptEnd.RAISED and exc is not None:
            code = _report_failure(exc, text)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        # the script ended without finishing the trial's steps: report it; unless that still made a
        # measurement (its data ran out during a longer --measure-s one), leave the pool
        if outcome is ScriptEnd.EXITED and (plan is None or plan.ending.on_exit() != Status.OK):
            normal = exc is None or getattr(exc, "code", 1) in (None, 0)
            if plan is None and normal:  # it never asked for its configuration: nothing was measured
                sys.stderr.write("autobalance: the script finished without calling autobalance.plan(); a trial "
                                 "measures the steps of plan.steps().\n")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(_env.NO_PLAN_EXIT_CODE if plan is None and normal else _env.ERROR_EXIT_CODE)
        report: dict[str, Any] | None = None
        trial_dir, rank, compiled = None, 0, False
        if plan is not None:
            plan.meter.close()
            report = plan.ending.take_deferred()
            trial_dir, rank, compiled = plan.trial_dir, plan.rank, plan.compile_state is not None
        # nothing may keep the trial's model alive while the worker cleans: its segments would stay
        # reserved and shape the next trial's allocator
        _plan.CURRENT_PLAN = None
        del plan, exc  # (a SystemExit's traceback holds the script's frames)
        clean_between_trials(device)
        warm.update(ledger.trial_finished(compiled=compiled))
        _write_ok(report, trial_dir, rank, warm)
        seq += 1
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
