"""Per-rank trial reports: what one rank measured, as one JSON file per rank, written atomically.

:func:`build_report` is the one place that fills the typed report (:class:`autobalance.protocol.RankReport`,
which owns the format and its validator) from a plan: its
configuration, step times, memory peaks, and the figures of its optional parts (``compile``,
``verify``, ``breakdown``; ``None`` or ``{"mode": "off"}`` when the part is off).
:func:`setup_failure_report` is the short report of a rank whose configuration was rejected
before a plan existed.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import time
import traceback
from typing import TYPE_CHECKING, Any

from autobalance._files import write_json_atomic
from autobalance.protocol import (
    RankDevice,
    RankMemory,
    RankReport,
    RankTiming,
    Status,
    cpu_model_name,
    report_path,
)
from autobalance.runtime._emulate import device_identity

if TYPE_CHECKING:
    from autobalance.runtime._memory import MemorySnapshot
    from autobalance.runtime._plan import Plan

__all__ = ["build_report", "report_path", "setup_failure_report", "step_time_iqr", "write_report"]


def write_report(trial_dir: str, rank: int, report: dict[str, Any]) -> str:
    """Write to a temporary file in the same directory, fsync, then rename into place."""
    return write_json_atomic(report_path(trial_dir, rank), report, indent=1)


def step_time_iqr(times: list[float]) -> float | None:
    """Interquartile range of the measured step times (how much they spread); None below 2 steps."""
    if len(times) < 2:
        return None
    q = statistics.quantiles(times, n=4, method="inclusive")
    return q[2] - q[0]


def _peaks(snap: MemorySnapshot | None) -> dict[str, Any] | None:
    if snap is None:
        return None
    return {"peak_allocated": snap.peak_allocated, "peak_reserved": snap.peak_reserved,
            "outside_pytorch": snap.outside_pytorch, "peak_device": snap.peak_device}


def build_report(plan: Plan, *, status: Status = Status.OK, error: str | None = None,
                 tb: str | None = None) -> dict[str, Any]:
    """This rank's figures as a JSON-ready dict (what a trial writes to ``rank<R>.json``)."""
    import torch

    clock, meter = plan.clock, plan.meter
    measured = clock.measured()
    step_time, samples_per_step, partial = clock.step_figures(plan.config.global_batch)
    mem = plan.memory()
    compile_step, steady = meter.compile_step, meter.steady()
    compiled, verify, breakdown = plan.compile_state, plan.verify, plan.breakdown
    busy, wait = plan.busy.figures(len(measured)) if plan.busy is not None else (None, None)
    return RankReport(
        status=status,
        error=error,
        traceback=tb,
        rank=plan.rank,
        local_rank=plan.local_rank,
        world_size=plan.world_size,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        trial_id=plan.trial_id,
        device=_device_info(plan),
        config=plan.config.to_dict(),
        source=plan.source,
        defaults=plan.defaults.to_dict(),
        model=plan.model_info,
        steps_done=plan.steps_done,
        warmup_steps=clock.warmup_steps,
        step_times_s=measured,
        step_time_s=step_time,
        measured_steps=len(measured),
        step_time_iqr_s=step_time_iqr(clock.timed(plan.config.global_batch)[0]),  # of the steps step_time_s stands for
        step_samples=clock.measured_samples(plan.config.global_batch),
        partial_steps=partial,
        samples_per_step=samples_per_step,
        samples_per_s=(samples_per_step / step_time) if step_time and samples_per_step else None,
        busy_time_s=busy,
        allreduce_wait_s=wait,
        data=plan.data_info,
        memory=RankMemory(
            peak_allocated=mem.peak_allocated,
            peak_reserved=mem.peak_reserved,
            outside_pytorch=mem.outside_pytorch,
            nvml_used_peak=mem.nvml_used_peak,
            nvml_scope=meter.nvml_scope,
            peak_device=mem.peak_device,
            before_training=meter.before_training,
            # compiled trials: the compiling step's peaks and the steady state's (the peaks above are
            # the larger of the two)
            compile_step=_peaks(compile_step),
            steady=_peaks(steady),
        ),
        timing=RankTiming(
            startup_s=(clock.first_step_at - clock.started_at) if clock.first_step_at else None,
            compile_s=compiled.compile_s if compiled is not None else None,
            steps_s=sum(clock.step_times),
            measure_s=clock.measure_s,
            wall_s=time.time() - clock.started_at,
        ),
        compile=compiled.to_dict(device_type=plan.device.type) if compiled is not None else {"mode": "off"},
        activation_budget=compiled.budget_used if compiled is not None else None,
        verify=({"dropout": verify.dropout, "loss_weighting": True, "train_mode": verify.train_mode,
                 "overflow_skips": verify.overflow_skips} if verify is not None else None),
        breakdown=breakdown.to_dict() if breakdown is not None else None,
        optimizer=plan.optimizer_info.to_dict(),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        written_at=datetime.datetime.now(datetime.UTC).isoformat(),
    ).to_dict()


def _device_info(plan: Plan) -> RankDevice:
    import torch

    from autobalance.runtime._memory import cpu_capacity_bytes

    if plan.device.type == "cuda":
        props = torch.cuda.get_device_properties(plan.device)
        nvml = plan.meter.nvml
        # fp32 matmuls in TF32 (the script set allow_tf32, or a float32 matmul precision below
        # "highest"): the search then need not hold fp32 back (tuner/search/_models.py)
        return RankDevice(type="cuda", name=props.name, capacity_bytes=int(props.total_memory),
                          cap_bytes=plan.cap_bytes, uuid=nvml.uuid if nvml else None,
                          identity=device_identity(plan.device, plan.rank, plan.trial),
                          extra={"tf32": torch.get_float32_matmul_precision() != "highest"})
    return RankDevice(type="cpu", name=cpu_model_name(), capacity_bytes=cpu_capacity_bytes(), cap_bytes=plan.cap_bytes,
                      identity=device_identity(plan.device, plan.rank, plan.trial))


def setup_failure_report(exc: BaseException, *, trial_id: str = "") -> dict[str, Any]:
    """The report of a rank whose configuration was rejected before its plan was built (``trial_id``:
    the trial's ``TrialEnv.trial_id``)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0") or 0)
    return RankReport(
        status=Status.ERROR,
        error=f"{type(exc).__name__}: {exc}"[:2000],
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-20000:],
        rank=rank,
        world_size=dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1") or 1),
        hostname=socket.gethostname(),
        pid=os.getpid(),
        trial_id=trial_id,
        written_at=datetime.datetime.now(datetime.UTC).isoformat(),
    ).to_dict()
