"""What ``--time-budget`` reserves: the predicted time of the verification that follows the study,
and of the next trial, from what the study itself measured.

After the study ``tune`` verifies its best trial (``autobalance.verify``): one-step runs of the
script, some shared by every candidate (``baseline``; ``baseline-fp32`` when the script's own dtype is
not fp32; the rounding ``floor``, :data:`FLOOR_RUNS`; ``baseline-<dtype>`` for a bf16/fp16 candidate),
the others per candidate (``tuned-fp32``, eager for a compiled bf16/fp16 candidate; ``tuned`` for a
bf16/fp16 one; with recomputation the two dropout runs, which verification skips for a model without
dropout: then the forecast is two runs long). A run that takes the same step as an earlier one (the
same configuration, dropout and sample order: a candidate whose fp32 arrangement is the script's own)
is reused, not forecast. Each run is predicted as

- its start-up and hand-over: the mean of the study's launched trials' (``startup`` + ``other`` of
  their time split, less the warm pool's start a trial paid);
- the fresh workers it starts (:func:`restarts`: after a compiled trial or run the worker is
  recycled), each the study's median pool start (``pool_start_s``; on one H200 18.7 s, and the first
  run after the GPT study's compiled trials took 23.9 s: ``benchmarks/2026-12-03-h200b/tune_gpt-1gpu.log``);
- its one step, twice (a run has no warm-up step: its first step pays the allocator's growth and
  the kernels' first launches): the step time measured for that configuration, else the step-time
  models' prediction (an fp32 run of a bf16 candidate from the study's fp32 trials or the dtype prior);
- its tensors' input and output: loading the starting weights, saving the step's gradients,
  parameters and buffers, and reading them back here, :data:`IO_S_PER_GB` seconds per GB of the
  model's parameters (the trials' ``parameter_bytes``; 0 before any reported them);
- for a compiled run, its compile: the study's median compile from the Inductor cache when the study
  compiled the same graphs (dtype, mode, buckets, micro-step sizes, budget; ``search.CACHE_HIT_PRIOR_S``
  before any cache hit), else its median compile with cache misses.

Only the best candidate's runs are reserved: a second candidate (the best failed verification) adds
its own runs after the budget. The trial loop stops starting trials once the time left is below
the next trial (the median launched trial, its compiling apart) plus this forecast
(:meth:`TimeBudget.spent`); a proposal that compiles new graphs needs the study's median compile on
top (the advisor's ``time_left_s``), and a sampled trial then runs eager.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance.protocol import MEASURED_STATUSES, Status, TrialAttr
from autobalance.tuner.search import (
    CompiledTimeModel,
    StepTimeModel,
    compile_times,
    compiled_graphs,
    graph_keys,
)
from autobalance.verify import run_key

__all__ = ["FIRST_STEP_FACTOR", "FLOOR_RUNS", "IO_S_PER_GB", "VerifyForecast", "forecast_verification", "next_trial_s",
           "restarts", "verification_runs", "worker_start_s"]

FLOOR_RUNS = 1
"""Shared fp32 runs of the script's own configuration besides ``baseline`` and ``baseline-fp32``:
the rounding floor (the same step with each micro-batch's samples reversed)."""
IO_S_PER_GB = 5.0
"""A verification run's tensor input and output per GB of parameters: one H200 machine, the ~270M GPT
(1.08 GB in fp32): starting weights 0.9-1.4 s, saving the step 2.1-3.4 s, reading it 1.6-2.6 s, 4.6-6.0 s
a run (``benchmarks/2026-12-03-h200b/tune_gpt-1gpu.log``)."""
FIRST_STEP_FACTOR = 2.0
"""A verification run's one step costs this many measured steps (no warm-up step before it)."""


@dataclass(kw_only=True)
class VerifyForecast:
    """The predicted time of verifying one candidate."""

    seconds: float
    """Predicted wall seconds of all its runs."""
    runs: list[str] = field(default_factory=list)
    """The runs' names, in the order verification launches them."""
    trial: int | None = None
    """The candidate's trial number."""

    def to_dict(self) -> dict[str, object]:
        return {"seconds": round(self.seconds, 1), "runs": list(self.runs), "trial": self.trial}


def _recomputes(config: BalanceConfig) -> bool:
    return any(config.checkpoint) or (config.compile != "off"
                                      and any(b < 1.0 for b in (config.activation_budget or [])))


def _fp32(config: BalanceConfig) -> BalanceConfig:
    """``config`` in fp32 as verification runs it: a compiled bf16/fp16 one runs eager."""
    if config.dtype != "fp32" and config.compile != "off":
        return dataclasses.replace(config, dtype="fp32", compile="off", compile_scope="whole", activation_budget=None)
    return dataclasses.replace(config, dtype="fp32")


def verification_runs(baseline: BalanceConfig | None, tuned: BalanceConfig) -> list[tuple[str, BalanceConfig, bool]]:
    """The runs verifying ``tuned`` against the script's own ``baseline`` (None: unknown, taken as
    ``tuned`` in fp32): ``(name, configuration, dropout on)``; none when ``tuned`` is the baseline."""
    if baseline is not None and baseline.to_dict() == tuned.to_dict():
        return []
    own = baseline if baseline is not None else _fp32(tuned)
    fp32 = _fp32(own)
    runs: list[tuple[str, BalanceConfig, bool]] = [("baseline", own, False)]
    if own.dtype != "fp32":
        runs.append(("baseline-fp32", fp32, False))
    runs += [("floor", fp32, False)] * FLOOR_RUNS
    runs.append(("tuned" if tuned.dtype == "fp32" else "tuned-fp32", _fp32(tuned), False))
    if tuned.dtype != "fp32":
        if own.dtype != tuned.dtype:
            runs.append((f"baseline-{tuned.dtype}", dataclasses.replace(own, dtype=tuned.dtype), False))
        runs.append(("tuned", tuned, False))
    if _recomputes(tuned):
        plain = dataclasses.replace(tuned, checkpoint=[[] for _ in tuned.micro_batches], activation_budget=None)
        runs += [("tuned-dropout", tuned, True), ("tuned-dropout-no-recompute", plain, True)]
    # a run that takes the same step as an earlier one is reused, not launched (verify.SharedRuns)
    seen: set[str] = set()
    out: list[tuple[str, BalanceConfig, bool]] = []
    for name, config, dropout in runs:
        key = run_key(config, dropout="on" if dropout else "off", global_batch=config.global_batch,
                      reverse=name == "floor")
        if key not in seen:
            out.append((name, config, dropout))
        seen.add(key)
    return out


def _pool_start(t: FrozenTrial) -> float:
    return float(t.user_attrs.get(TrialAttr.POOL_START_S) or 0.0)


def worker_start_s(trials: Sequence[FrozenTrial]) -> float:
    """The median start of a warm pool the study's trials paid (0 before any)."""
    starts = [s for t in trials if (s := _pool_start(t)) > 0]
    return statistics.median(starts) if starts else 0.0


def restarts(trials: Sequence[FrozenTrial], runs: Sequence[tuple[str, BalanceConfig, bool]]) -> int:
    """Fresh workers the verification runs will start: a worker that ran a compiled graph is recycled
    (it holds the graph's kernels: ``runtime._carryover``), so the first run pays one when the study's
    latest launched trial compiled, and every compiled run but the last makes the next run pay one."""
    latest = max(_launched(trials), key=lambda t: t.number, default=None)  # the baseline runs first
    first = latest is not None and (latest.user_attrs.get(TrialAttr.CONFIG) or {}).get("compile", "off") != "off"
    return int(first) + sum(1 for _, cfg, _ in runs[:-1] if cfg.compile != "off")


def _launched(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """Trials that ran (a time split, not reused), the baseline last-resort: the others first."""
    ran = [t for t in trials if isinstance(t.user_attrs.get(TrialAttr.TIME_SPLIT), dict)
           and t.user_attrs.get(TrialAttr.REUSED_FROM) is None]
    others = [t for t in ran if not t.user_attrs.get(TrialAttr.BASELINE)]
    return others or ran


def _part(t: FrozenTrial, *keys: str) -> float:
    split = t.user_attrs[TrialAttr.TIME_SPLIT]
    return sum(float(split.get(k) or 0.0) for k in keys)


def next_trial_s(trials: Sequence[FrozenTrial]) -> float:
    """The median wall time of the study's launched trials without their compiling (0 before any):
    near the end of a budget the advisor starts no compile that the time left cannot hold, so the
    next trial is a trial's start-up, steps and hand-over."""
    ran = _launched(trials)
    return statistics.median(_part(t, "startup", "steps", "remeasure", "other") for t in ran) if ran else 0.0


def forecast_verification(trials: Sequence[FrozenTrial], *, baseline: BalanceConfig | None, best: FrozenTrial | None,
                          num_layers: int, device: str) -> VerifyForecast:
    """The predicted time of verifying ``best`` (module doc); 0 s without a candidate or when it is
    the script's own configuration."""
    config = (best.user_attrs.get(TrialAttr.CONFIG) if best is not None else None)
    if best is None or not config:
        return VerifyForecast(seconds=0.0)
    tuned = BalanceConfig.from_dict(config)
    runs = verification_runs(baseline, tuned)
    if not runs:
        return VerifyForecast(seconds=0.0, trial=best.number)
    ran = _launched(trials)
    per_run = statistics.mean(_part(t, "startup", "other") - _pool_start(t) for t in ran) if ran else 0.0
    measured: dict[str, float] = {}
    for t in trials:
        cfg, ms = t.user_attrs.get(TrialAttr.CONFIG), t.user_attrs.get(TrialAttr.STEP_TIME_MS)
        if (t.state == TrialState.COMPLETE and t.user_attrs.get(TrialAttr.STATUS) == Status.OK and cfg
                and isinstance(ms, (int, float))):
            measured[json.dumps(cfg, sort_keys=True)] = float(ms)
    eager = StepTimeModel.fit(list(trials), num_layers=num_layers, device=device)
    compiled = CompiledTimeModel.fit(list(trials), eager=eager, device=device)
    slowest = max(measured.values(), default=0.0)
    graphs = compiled_graphs([t for t in trials if t.user_attrs.get(TrialAttr.STATUS) in MEASURED_STATUSES])
    warm, cold = compile_times(trials, device=device)
    gb = max((float(b) for t in trials if isinstance(b := t.user_attrs.get(TrialAttr.PARAMETER_BYTES), (int, float))),
             default=0.0) / 1e9
    per_run += IO_S_PER_GB * gb
    total = restarts(trials, runs) * worker_start_s(trials)
    for _, cfg, _dropout in runs:
        ms = measured.get(json.dumps(cfg.to_dict(), sort_keys=True))
        if ms is None:
            ms = (eager if cfg.compile == "off" else compiled).predict(cfg)
        total += per_run + FIRST_STEP_FACTOR * (ms if ms is not None else slowest) / 1000.0
        if cfg.compile != "off":
            total += warm if graph_keys(cfg.to_dict()) <= graphs else cold
    return VerifyForecast(seconds=total, runs=[name for name, _, _ in runs], trial=best.number)
