"""From a trial's per-rank reports to the objective values, the OOM constraint and the
attributes shown in the dashboard."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from autobalance._files import is_int
from autobalance.launcher import TrialOutcome
from autobalance.protocol import (
    GIB,
    RankDevice,
    RankMemory,
    RankReport,
    RankTiming,
    Status,
    StudyAttr,
    TrialAttr,
    memory_text,
    objective_value,
)
from autobalance.tuner.search._constants import INFEASIBLE_TIME


@dataclass(kw_only=True)
class TrialFigures:
    """Per-rank measurements of one trial and what the study derives from them."""

    status: str
    """ok, oom, timeout, predicted_oom (see the launcher's statuses)."""
    peak_device: list[float | None]
    """Per rank: allocator peak reserved + memory outside PyTorch (NVML), bytes."""
    peak_allocated: list[float | None]
    peak_reserved: list[float | None]
    outside_pytorch: list[float | None]
    capacity: list[float]
    """Per rank: the emulated cap, else the device's capacity, bytes."""
    step_time_s: float | None
    """Slowest rank's median step time (DDP steps are synchronous)."""
    samples_per_s: float | None
    startup_s: float | None
    """Start of the rank to its first step (torchrun + import + init + model build)."""
    time_in_steps_s: float | None = None
    """Slowest rank's time in warm-up and measured steps (compilation excluded)."""
    measured_steps: int | None = None
    """Measured steps (more than ``--steps`` when ``--measure-s`` lengthened the measurement)."""
    busy_s: list[float | None] = field(default_factory=list)
    """Per rank: its own work per step, without its wait at the all-reduce (``busy_time_s``)."""
    wait_s: list[float | None] = field(default_factory=list)
    """Per rank: its wait at the step's gradient all-reduce (``allreduce_wait_s``)."""
    optimizer_state: list[float | None] = field(default_factory=list)
    """Per rank: its measured optimizer-state bytes (``RankReport.optimizer``; None: not measured)."""
    optimizer_wrapped: bool = False
    """Every rank's script passed its optimizer through ``plan.optimizer``."""
    parameter_bytes: int | None = None
    """The model's parameter bytes (``RankReport.model``; None: not reported)."""
    held: list[float | None] = field(default_factory=list)
    """Per rank: the bytes that do not scale with the micro-batch, the report's ``breakdown`` bytes
    ``live_after_step`` (gradients set to None) plus ``gradients`` plus ``outside_pytorch``; None: not measured.
    With the peak, one eager trial gives the per-sample activations. GPU only: on CPU (the live-tensor tracker)
    studies fitted with it chose worse (tests/test_zero.py)."""
    compile: dict[str, Any] = field(default_factory=dict)
    """Compiled trials' :func:`compile_figures`."""

    def usable(self, headroom: float) -> list[float]:
        return [c * (1.0 - headroom) for c in self.capacity]

    @property
    def measured(self) -> bool:
        return self.status == Status.OK and None not in self.peak_device and self.step_time_s is not None

    def spread_bytes(self) -> float | None:
        peaks = [p for p in self.peak_device if p is not None]
        return (max(peaks) - min(peaks)) if len(peaks) == len(self.peak_device) and peaks else None

    def spread_fraction(self) -> float | None:
        """max - min over ranks of peak / capacity (heterogeneous caps compare fairly)."""
        if None in self.peak_device:
            return None
        return spread_fraction([float(p) for p in self.peak_device if p is not None], self.capacity)

    def memory_constraint(self, headroom: float) -> float:
        """<= 0 when every rank's peak fits in capacity x (1 - headroom); > 0 otherwise (OOM: >= 1)."""
        ratios = [float(p) / u for p, u in zip(self.peak_device, self.usable(headroom), strict=True) if p is not None]
        worst = (max(ratios) - 1.0) if ratios else 0.0
        if self.status in (Status.OOM, Status.TIMEOUT, Status.PREDICTED_OOM):
            return max(1.0, worst)
        return worst

    def values(self, *, reference_step_s: float | None, weight_spread: float, weight_time: float,
               multi_objective: bool) -> list[float]:
        spread = self.spread_fraction() if self.measured else None
        step = self.step_time_s if self.measured else None
        time_norm = INFEASIBLE_TIME if step is None or not reference_step_s else float(step) / reference_step_s
        values = [1.0 if spread is None else spread, time_norm]
        if multi_objective:
            return values
        return [objective_value(*values, weight_spread=weight_spread, weight_time=weight_time)]

    def user_attrs(self, headroom: float) -> dict[str, Any]:
        """The trial's user attributes. Scalars a user may plot in the dashboard (``step_time_ms``, ``peak_max_gib``,
        ``peak_rank<r>_gib``, ``compile_s``, ...) are numbers or absent, never None (a None makes optuna-dashboard
        treat the attribute as text): a trial without a measurement leaves them out; its per-rank lists keep None
        where a rank reported nothing."""
        def gib(values: list[float | None]) -> list[float | None]:
            return [None if v is None else round(v / GIB, 4) for v in values]

        def listed(values: list[float | None], unit: Callable[[float], Any]) -> list[Any] | None:
            """Per rank, absent when no rank reported one."""
            if all(v is None for v in values):
                return None
            return [None if v is None else unit(v) for v in values]

        def ms(seconds: float) -> float:
            return round(1000 * seconds, 3)

        spread_b = self.spread_bytes() if self.measured else None  # lower bounds or predictions: no spread
        spread_f = self.spread_fraction() if self.measured else None
        per_rank = {f"rank{r}": f"no measurement (cap {memory_text(c / GIB)})" if p is None else
                    f"peak {memory_text(p / GIB)} of {memory_text(c / GIB)} ({100 * p / c:.1f}%)"
                    for r, (p, c) in enumerate(zip(self.peak_device, self.capacity, strict=True))}
        plottable: dict[str, Any] = {}
        if self.measured:  # an OOM rank's peak is a lower bound, a predicted one a prediction: not plotted
            peaks = [float(p) for p in self.peak_device if p is not None]
            plottable["peak_max_gib"] = round(max(peaks) / GIB, 4)
            plottable.update({f"peak_rank{r}_gib": round(float(p) / GIB, 4)
                              for r, p in enumerate(self.peak_device) if p is not None})
        attrs = {
            "status": self.status,
            "peak_device_gib": gib(self.peak_device),
            "peak_allocated_gib": gib(self.peak_allocated),
            "peak_reserved_gib": gib(self.peak_reserved),
            "outside_pytorch_gib": gib(self.outside_pytorch),
            "capacity_gib": gib(list(self.capacity)),
            "usable_gib": gib(list(self.usable(headroom))),
            "spread_gib": None if spread_b is None else round(spread_b / GIB, 4),
            "spread_pct_of_capacity": None if spread_f is None else round(100 * spread_f, 3),
            "step_time_ms": None if self.step_time_s is None else ms(self.step_time_s),
            "samples_per_s": None if self.samples_per_s is None else round(self.samples_per_s, 2),
            "startup_s": None if self.startup_s is None else round(self.startup_s, 2),
            TrialAttr.TIME_IN_STEPS_S: None if self.time_in_steps_s is None
            else round(self.time_in_steps_s, 4),
            "measured_steps": self.measured_steps,
            TrialAttr.BUSY_MS: listed(self.busy_s, ms),
            TrialAttr.WAIT_MS: listed(self.wait_s, ms),
            TrialAttr.OPTIMIZER_STATE_BYTES: listed(self.optimizer_state, int),
            TrialAttr.OPTIMIZER_WRAPPED: True if self.optimizer_wrapped else None,
            TrialAttr.PARAMETER_BYTES: self.parameter_bytes or None,
            TrialAttr.HELD_GIB: listed(self.held, lambda v: round(v / GIB, 4)),
            "memory_constraint": round(self.memory_constraint(headroom), 5),
            **self.compile,
            **per_rank,
            **plottable,
        }
        return {k: v for k, v in attrs.items() if v is not None}


def rate_source(attrs: Mapping[str, Any]) -> str:
    """Where a trial that fixes the reference step stands (``StudyAttr.EXCHANGE_RATE["source"]``):
    the baseline, a reference run (``TrialAttr.REFERENCE_RUN``), else the first trial that gave a step."""
    if attrs.get(TrialAttr.BASELINE):
        return "baseline"
    return "reference" if attrs.get(TrialAttr.REFERENCE_RUN) else "first-measured"


def fix_exchange_rate(study: Any, *, reference_step_s: float | None, source: str, trial: int | None,
                      weight_spread: float, weight_time: float, world_size: int,
                      capacity_bytes: list[float] | None = None) -> None:
    """Store the objective's exchange rate with the study (``StudyAttr.EXCHANGE_RATE``, the
    reference step as ``StudyAttr.REFERENCE``) once, before the search's first trial, so every
    trial's step time is divided by one ``reference_step_s`` (None: the first trial's fixes it)."""
    if reference_step_s is not None:
        study.set_user_attr(StudyAttr.REFERENCE, float(reference_step_s))
    study.set_user_attr(StudyAttr.EXCHANGE_RATE, {
        "reference_step_s": None if reference_step_s is None else float(reference_step_s), "source": source,
        "trial": trial, "weight_spread": float(weight_spread), "weight_time": float(weight_time),
        "world_size": int(world_size),
        "capacity_bytes": None if capacity_bytes is None else [float(c) for c in capacity_bytes]})


def rate_fixed(user_attrs: Mapping[str, Any]) -> bool:
    """Whether the study's exchange rate was settled before the search (or the study, stored before
    the rate was recorded, has its reference step)."""
    return StudyAttr.EXCHANGE_RATE in user_attrs or user_attrs.get(StudyAttr.REFERENCE) is not None


def penalised(values: list[float], constraints: list[float], *, feasible: bool, weight_spread: float,
              weight_time: float, multi_objective: bool) -> list[float]:
    """The objective values Optuna stores: an infeasible trial's are at least those of a trial with no measurement
    (spread 1, step time ``INFEASIBLE_TIME`` x the reference) plus its violation. So no infeasible trial beats a
    feasible one in a view that ranks by value alone (optuna-dashboard's best trial and Pareto front), and a
    sampler ignoring constraints learns that less over is better."""
    if feasible:
        return list(values)
    violation = sum(max(0.0, float(c)) for c in constraints)
    if multi_objective:
        return [max(float(values[0]), 1.0) + violation, max(float(values[1]), INFEASIBLE_TIME) + violation]
    floor = objective_value(1.0, INFEASIBLE_TIME, weight_spread=weight_spread, weight_time=weight_time)
    return [max(float(values[0]), floor) + violation]


def spread_fraction(peaks: list[float], capacity: list[float]) -> float:
    """max - min over ranks of peak / capacity: the memory spread the objective minimises."""
    fracs = [p / c for p, c in zip(peaks, capacity, strict=True)]
    return max(fracs) - min(fracs)


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)


def figures_from_outcome(outcome: TrialOutcome, *, world_size: int, caps: list[int] | None,
                         fallback_capacity: list[float] | None = None) -> TrialFigures:
    """A trial's figures from its ranks' reports."""
    reports = [outcome.reports.get(r) for r in range(world_size)]
    good = [rep if rep is not None and rep.status == Status.OK else None for rep in reports]
    # an OOM rank's peak is a lower bound: for display and the memory model, not as a measurement
    mems = [(rep.memory if rep is not None else None) or RankMemory() for rep in reports]
    devs = [(rep.device if rep is not None else None) or RankDevice() for rep in reports]
    times = [(rep.timing if rep is not None else None) or RankTiming() for rep in reports]
    opts = [(rep.optimizer if rep is not None else None) or {} for rep in reports]
    capacity = [float((caps[r] if caps else None) or dev.cap_bytes or dev.capacity_bytes
                      or (fallback_capacity[r] if fallback_capacity else None) or 2**40)
                for r, dev in enumerate(devs)]
    steps = [float(r.step_time_s) for r in good if r is not None and r.step_time_s is not None]
    startup = [float(t.startup_s) for t in times if t.startup_s is not None]
    in_steps = [float(t.steps_s) for t, rep in zip(times, good, strict=True)
                if rep is not None and t.steps_s is not None]
    counts = [int(r.measured_steps) for r in good if r is not None and r.measured_steps is not None]
    held: list[float | None] = []
    for rep, mem, dev in zip(good, mems, devs, strict=True):
        parts = ((rep.breakdown if rep is not None else None) or {}).get("bytes") or {}
        after, grads = parts.get("live_after_step"), parts.get("gradients")
        if rep is None or dev.type != "cuda" or not isinstance(after, (int, float)):
            held.append(None)  # on CPU the live-tensor tracker's peaks include the optimizer step's
            continue  # transients: not a fixed part
        held.append(float(after) + float(grads if isinstance(grads, (int, float)) else 0)
                    + float(mem.outside_pytorch or 0))
    step = max(steps) if len(steps) == world_size else None
    first = next(iter(outcome.reports.values()), None)
    gb = ((first.config if first is not None else None) or {}).get("global_batch")
    if first is not None and first.samples_per_step:
        gb = first.samples_per_step  # partial steps count the samples they really used
    sizes: list[Any] = [(r.model or {}).get("parameter_bytes") for r in outcome.reports.values()]
    wrapped = [bool(opt.get("wrapped")) for opt in opts]
    return TrialFigures(
        status=outcome.status, peak_device=[_float(m.peak_device) for m in mems], capacity=capacity,
        peak_allocated=[_float(m.peak_allocated) for m in mems], step_time_s=step,
        peak_reserved=[_float(m.peak_reserved) for m in mems], startup_s=max(startup) if startup else None,
        outside_pytorch=[_float(m.outside_pytorch) for m in mems],
        samples_per_s=(gb / step) if (gb and step) else None,
        time_in_steps_s=max(in_steps) if len(in_steps) == world_size else None,
        measured_steps=min(counts) if len(counts) == world_size else None,
        busy_s=[None if rep is None else _float(rep.busy_time_s) for rep in good],
        wait_s=[None if rep is None else _float(rep.allreduce_wait_s) for rep in good],
        optimizer_state=[None if rep is None else _float(opt.get("state_bytes"))
                         for rep, opt in zip(good, opts, strict=True)],
        optimizer_wrapped=bool(wrapped) and all(wrapped),
        parameter_bytes=max((int(b) for b in sizes if is_int(b)), default=None),
        compile=compile_figures(outcome.reports), held=held,
    )


def compile_figures(reports: dict[int, RankReport]) -> dict[str, Any]:
    """Trial attributes from the ranks' reports: the slowest rank's compile time, each rank's
    budget as it reported it, and the Inductor cache hits and misses summed over ranks."""
    compiled = [r for r in reports.values() if (r.compile or {}).get("mode", "off") != "off"]
    if not compiled:
        return {}
    times = [float(r.timing.compile_s) for r in compiled if r.timing is not None and r.timing.compile_s is not None]
    cache: dict[str, int] = {}
    for r in compiled:
        for key, value in ((r.compile or {}).get("cache") or {}).items():
            if is_int(value):
                cache[key] = cache.get(key, 0) + value
    return {
        "compile_s": round(max(times), 3) if times else None,
        "activation_budget_used": [reports[r].activation_budget for r in sorted(reports)],
        "compile_cache": cache,
    }
