"""What ``--time-budget`` reserves: the predicted time of the verification that follows the study,
and of the next trial, priced from what the study itself measured.

After the study ``tune`` verifies its best trial (``autobalance.verify``): one-step runs of the
script, some shared by every candidate (``baseline``; ``baseline-fp32`` when the script's own dtype is
not fp32; the rounding ``floor``, :data:`FLOOR_RUNS`; ``baseline-<dtype>`` for a bf16/fp16 candidate),
the others per candidate (``tuned-fp32``, eager for a compiled bf16/fp16 candidate; ``tuned`` for a
bf16/fp16 one; with recomputation the two dropout runs, launched only for a model with dropout: the
trials report its dropout layers, :data:`TrialAttr.DROPOUT_MODULES`; a study whose trials did not
report them reserves the two runs). A run that takes the same step as an earlier one (the same
configuration, dropout and sample order: a candidate whose fp32 arrangement is the script's own) is
reused, not forecast. Each run is priced from the study's own launched trials (:func:`run_prices`):

- its start-up and hand-over in a running worker: the median of the warm trials' ``startup`` +
  ``other`` (a trial that started no pool; in a study of cold trials, every run's start is a cold
  trial's: the median over all);
- a fresh worker where verification will start one: the first run when the study's latest launched
  trial ended its pool (recycled after it, ``warm_recycled``, or failed), and a run after a compiled
  run in the share of the study's compiled warm trials that recycled their worker (none recycled on
  the 2026-12-03 H200 study ``h200c``; 2 of 4 in ``h200b``). It costs the slowest start-up of the
  study's trials that started a pool, less a warm trial's start-up (18.4 s in ``h200b``, whose first
  verification run after a recycled pool took 23.9 s where the next took 5.8 s). A fresh worker is
  priced once, not also inside every run's start-up (today's per-run start-up is the warm median);
- its one step, twice (a run has no warm-up step: :data:`FIRST_STEP_FACTOR`): the step time measured
  for that configuration, else the step-time models' prediction;
- its tensors' input and output, :data:`IO_S_PER_GB` per GB of parameters (``parameter_bytes``);
- for a compiled run, its compile: from the Inductor cache when the study compiled the same graphs
  (the candidate's own always are): the study's median cache hit, else :data:`FROM_CACHE_SHARE` of
  what those graphs took cold in the study; cold (the study's median cache miss) otherwise.

Besides the runs, each comparison of two runs' tensors (``floor``, ``equivalence``; ``noise`` and
``dtype`` for bf16/fp16; ``rng-replay`` with the dropout runs) costs :data:`COMPARE_S_PER_GB` per GB.

Only the best candidate's runs are reserved: a second candidate (the best failed verification) adds
its own runs after the budget. The reserve is the forecast times :data:`RESERVE_MARGIN`. The trial
loop starts a trial only while the time left holds the next trial (the median launched trial, its
compiling apart) plus that reserve (:meth:`TimeBudget.spent`); a proposal that compiles new graphs
needs the study's median compile on top (:attr:`TimeBudget.compile_left_s`).

Replayed on the recorded H200 studies (``tests/test_verify_reserve_replay.py``): ``h200c``'s
best at the stop (trial 10) was reserved 133.9 s (7 runs, two of them dropout runs verification did
not launch, three fresh workers none of which started, and every run's start-up averaged with the
first trial's pool start) where its verification took ~67 s; priced as above it is within the margin.
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
from autobalance.tuner.search._compile import compile_times
from autobalance.tuner.search._compiled_model import CompiledTimeModel
from autobalance.tuner.search._compiled_search import compiled_graphs, graph_keys
from autobalance.tuner.search._constants import (
    COMPARE_S_PER_GB,
    FIRST_STEP_FACTOR,
    FLOOR_RUNS,
    FROM_CACHE_SHARE,
    IO_S_PER_GB,
    RESERVE_MARGIN,
)
from autobalance.tuner.search._step_time import StepTimeModel
from autobalance.verify import run_key

__all__ = ["COMPARE_S_PER_GB", "FIRST_STEP_FACTOR", "FLOOR_RUNS", "FROM_CACHE_SHARE", "IO_S_PER_GB", "RESERVE_MARGIN",
           "RunPrices", "VerifyForecast", "forecast_verification", "has_dropout", "next_trial_s", "restarts",
           "run_prices", "trial_s", "verification_runs", "worker_start_s"]


@dataclass(kw_only=True)
class VerifyForecast:
    """The predicted time of verifying one candidate."""

    seconds: float
    """Predicted wall seconds of all its runs and comparisons."""
    runs: list[str] = field(default_factory=list)
    """The runs' names, in the order verification launches them."""
    trial: int | None = None
    """The candidate's trial number."""
    per_run: dict[str, float] = field(default_factory=dict)
    """Each run's predicted seconds (a fresh worker it starts included)."""
    compare_s: float = 0.0
    """The comparisons' predicted seconds."""

    @property
    def reserve_s(self) -> float:
        """What the time budget keeps free for it: the forecast times :data:`RESERVE_MARGIN`."""
        return self.seconds * RESERVE_MARGIN

    def to_dict(self) -> dict[str, object]:
        return {"seconds": round(self.seconds, 1), "reserve_s": round(self.reserve_s, 1), "runs": list(self.runs),
                "trial": self.trial, "per_run": {k: round(v, 1) for k, v in self.per_run.items()},
                "compare_s": round(self.compare_s, 1)}


def _recomputes(config: BalanceConfig) -> bool:
    return any(config.checkpoint) or (config.compile != "off"
                                      and any(b < 1.0 for b in (config.activation_budget or [])))


def _fp32(config: BalanceConfig) -> BalanceConfig:
    """``config`` in fp32 as verification runs it: a compiled bf16/fp16 one runs eager."""
    if config.dtype != "fp32" and config.compile != "off":
        return dataclasses.replace(config, dtype="fp32", compile="off", compile_scope="whole", activation_budget=None)
    return dataclasses.replace(config, dtype="fp32")


def verification_runs(baseline: BalanceConfig | None, tuned: BalanceConfig, *,
                      dropout: bool = True) -> list[tuple[str, BalanceConfig, bool]]:
    """The runs verifying ``tuned`` against the script's own ``baseline`` (None: unknown, taken as
    ``tuned`` in fp32): ``(name, configuration, dropout on)``; none when ``tuned`` is the baseline.
    ``dropout``: whether the model has dropout (else a recomputing candidate has no dropout runs)."""
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
    if dropout and _recomputes(tuned):
        plain = dataclasses.replace(tuned, checkpoint=[[] for _ in tuned.micro_batches], activation_budget=None)
        runs += [("tuned-dropout", tuned, True), ("tuned-dropout-no-recompute", plain, True)]
    # a run that takes the same step as an earlier one is reused, not launched (verify.SharedRuns)
    seen: set[str] = set()
    out: list[tuple[str, BalanceConfig, bool]] = []
    for name, config, with_dropout in runs:
        key = run_key(config, dropout="on" if with_dropout else "off", global_batch=config.global_batch,
                      reverse=name == "floor")
        if key not in seen:
            out.append((name, config, with_dropout))
        seen.add(key)
    return out


def _comparisons(tuned: BalanceConfig, runs: Sequence[tuple[str, BalanceConfig, bool]]) -> int:
    """The comparisons verification makes: floor and equivalence; noise and dtype for bf16/fp16;
    rng-replay with the dropout runs."""
    return 2 + 2 * (tuned.dtype != "fp32") + any(with_dropout for _, _, with_dropout in runs)


def has_dropout(trials: Sequence[FrozenTrial]) -> bool:
    """Whether the model has dropout as the study's trials reported it (any layer with ``p > 0``);
    True when none reported it (a study recorded before the trials did: the dropout runs reserved)."""
    counts = [n for t in trials if isinstance(n := t.user_attrs.get(TrialAttr.DROPOUT_MODULES), int)]
    return not counts or max(counts) > 0


def _pool_start(t: FrozenTrial) -> float:
    return float(t.user_attrs.get(TrialAttr.POOL_START_S) or 0.0)


def _warm(t: FrozenTrial) -> bool:
    """A trial in a warm pool (it started one, or ran in one)."""
    return _pool_start(t) > 0 or bool(t.user_attrs.get("warm_pool_trial"))


def _compiled(t: FrozenTrial) -> bool:
    return (t.user_attrs.get(TrialAttr.CONFIG) or {}).get("compile", "off") != "off"


@dataclass(frozen=True)
class RunPrices:
    """What a verification run costs besides its step and compile, from the study's launched trials
    (:func:`run_prices`)."""

    start_s: float
    """A run's start-up and hand-over in a running worker (a cold study: a cold trial's whole start)."""
    fresh_s: float
    """A fresh worker's start on top of :attr:`start_s` (0 in a cold study: each run starts anew)."""
    first_fresh: bool
    """Whether the first run starts a fresh worker (the study's latest launched trial ended its pool)."""
    recycle_share: float
    """The share of the study's compiled warm trials after which the worker was recycled (1 before any)."""


def worker_start_s(trials: Sequence[FrozenTrial]) -> float:
    """A fresh worker's start as the study's trials paid it: the slowest start-up of a trial that
    started a pool (the start after compiled trials is the slower one), less a warm trial's
    start-up; 0 before any started one."""
    ran = _launched(trials)
    fresh = [_part(t, "startup") for t in ran if _pool_start(t) > 0]
    if not fresh:
        return 0.0
    warm = [_part(t, "startup") for t in ran if _warm(t) and _pool_start(t) <= 0]
    return max(0.0, max(fresh) - (statistics.median(warm) if warm else 0.0))


def run_prices(trials: Sequence[FrozenTrial]) -> RunPrices:
    """A verification run's start-up, and the fresh workers verification starts (module doc)."""
    ran = _launched(trials)
    if not ran:
        return RunPrices(start_s=0.0, fresh_s=0.0, first_fresh=False, recycle_share=1.0)
    if not any(_warm(t) for t in ran):  # cold trials: every run pays a whole start-up
        return RunPrices(start_s=statistics.median(_part(t, "startup", "other") for t in ran), fresh_s=0.0,
                         first_fresh=False, recycle_share=0.0)
    warm = [t for t in ran if _warm(t) and _pool_start(t) <= 0]
    start = (statistics.median(_part(t, "startup", "other") for t in warm) if warm
             else statistics.median(_part(t, "startup", "other") - _pool_start(t) for t in ran))
    latest = max(_every_launched(trials), key=lambda t: t.number)
    first_fresh = (bool(latest.user_attrs.get(TrialAttr.WARM_RECYCLED))
                   or latest.user_attrs.get(TrialAttr.STATUS) != Status.OK)  # a failed trial ends its pool
    compiled = [t for t in ran if _compiled(t) and _warm(t)]
    share = (sum(1 for t in compiled if t.user_attrs.get(TrialAttr.WARM_RECYCLED)) / len(compiled) if compiled
             else 1.0)
    return RunPrices(start_s=start, fresh_s=worker_start_s(trials), first_fresh=first_fresh, recycle_share=share)


def restarts(trials: Sequence[FrozenTrial], runs: Sequence[tuple[str, BalanceConfig, bool]]) -> float:
    """Fresh workers the verification runs are expected to start: the first run's when the study's
    latest launched trial ended its pool, and after each compiled run but the last the share of the
    study's compiled trials that recycled their worker (``runtime._carryover``)."""
    prices = run_prices(trials)
    if prices.fresh_s <= 0 and not any(_warm(t) for t in _launched(trials)):
        return 0.0
    return int(prices.first_fresh) + prices.recycle_share * sum(1 for _, cfg, _ in runs[:-1] if cfg.compile != "off")


def _every_launched(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    return [t for t in trials if isinstance(t.user_attrs.get(TrialAttr.TIME_SPLIT), dict)
            and t.user_attrs.get(TrialAttr.REUSED_FROM) is None]


def _launched(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """Trials that ran (a time split, not reused), the baseline last-resort: the others first."""
    ran = _every_launched(trials)
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


def _from_cache_s(trials: Sequence[FrozenTrial], cfg: BalanceConfig, *, cold: float) -> float:
    """A compile of ``cfg``'s graphs from the study's Inductor cache: the study's median cache hit,
    else :data:`FROM_CACHE_SHARE` of what trials compiling the same graphs took cold."""
    hits, same = [], []
    keys = graph_keys(cfg.to_dict())
    for t in _every_launched(trials):
        seconds = t.user_attrs.get(TrialAttr.COMPILE_S)
        if not isinstance(seconds, (int, float)):
            continue
        cache = t.user_attrs.get(TrialAttr.COMPILE_CACHE) or {}
        if cache.get("fx_graph_hits", 0) > 0 and not cache.get("fx_graph_misses", 0):
            hits.append(float(seconds))
        elif graph_keys(t.user_attrs.get(TrialAttr.CONFIG) or {}) == keys:
            same.append(float(seconds))
    if hits:
        return statistics.median(hits)
    return FROM_CACHE_SHARE * (statistics.median(same) if same else cold)


def forecast_verification(trials: Sequence[FrozenTrial], *, baseline: BalanceConfig | None, best: FrozenTrial | None,
                          num_layers: int, device: str, eager: StepTimeModel | None = None,
                          compiled: CompiledTimeModel | None = None) -> VerifyForecast:
    """The predicted time of verifying ``best`` (module doc); 0 s without a candidate or when it is
    the script's own configuration. ``eager``, ``compiled``: the step-time models already fitted on
    ``trials`` (the decision's: ``search.Decision``); None: fitted here."""
    config = (best.user_attrs.get(TrialAttr.CONFIG) if best is not None else None)
    if best is None or not config:
        return VerifyForecast(seconds=0.0)
    tuned = BalanceConfig.from_dict(config)
    runs = verification_runs(baseline, tuned, dropout=has_dropout(trials))
    if not runs:
        return VerifyForecast(seconds=0.0, trial=best.number)
    prices = run_prices(trials)
    measured: dict[str, float] = {}
    for t in trials:
        cfg, ms = t.user_attrs.get(TrialAttr.CONFIG), t.user_attrs.get(TrialAttr.STEP_TIME_MS)
        if (t.state == TrialState.COMPLETE and t.user_attrs.get(TrialAttr.STATUS) == Status.OK and cfg
                and isinstance(ms, (int, float))):
            measured[json.dumps(cfg, sort_keys=True)] = float(ms)
    if eager is None:
        eager = StepTimeModel.fit(list(trials), num_layers=num_layers, device=device)
    if compiled is None:
        compiled = CompiledTimeModel.fit(list(trials), eager=eager, device=device)
    slowest = max(measured.values(), default=0.0)
    graphs = compiled_graphs([t for t in trials if t.user_attrs.get(TrialAttr.STATUS) in MEASURED_STATUSES])
    gb = max((float(b) for t in trials if isinstance(b := t.user_attrs.get(TrialAttr.PARAMETER_BYTES), (int, float))),
             default=0.0) / 1e9
    per_run: dict[str, float] = {}
    fresh_next = float(prices.first_fresh)  # the expected fresh workers the next run starts
    for name, cfg, _dropout in runs:
        ms = measured.get(json.dumps(cfg.to_dict(), sort_keys=True))
        if ms is None:
            ms = (eager if cfg.compile == "off" else compiled).predict(cfg)
        seconds = (prices.start_s + fresh_next * prices.fresh_s + IO_S_PER_GB * gb
                   + FIRST_STEP_FACTOR * (ms if ms is not None else slowest) / 1000.0)
        fresh_next = 0.0
        if cfg.compile != "off":
            _, cold = compile_times(trials, device=device, scope=cfg.compile_scope)
            seconds += _from_cache_s(trials, cfg, cold=cold) if graph_keys(cfg.to_dict()) <= graphs else cold
            fresh_next = prices.recycle_share
        per_run[name] = seconds
    compare_s = _comparisons(tuned, runs) * COMPARE_S_PER_GB * gb
    return VerifyForecast(seconds=sum(per_run.values()) + compare_s, runs=[name for name, _, _ in runs],
                          trial=best.number, per_run=per_run, compare_s=compare_s)


def trial_s(trials: Sequence[FrozenTrial], config: BalanceConfig, *, device: str) -> float:
    """The expected wall time of launching ``config`` next: the median launched trial without its
    compiling (:func:`next_trial_s`) plus, compiled, its compile: from the study's cache when the
    study compiled its graphs (:func:`_from_cache_s`), else the study's median cold compile in its
    scope (``compile_times``: a whole-model compile is not priced as a regional one)."""
    seconds = next_trial_s(trials)
    if config.compile == "off":
        return seconds
    _, cold = compile_times(trials, device=device, scope=config.compile_scope)
    graphs = compiled_graphs([t for t in trials if t.user_attrs.get(TrialAttr.STATUS) in MEASURED_STATUSES])
    return seconds + (_from_cache_s(trials, config, cold=cold) if graph_keys(config.to_dict()) <= graphs else cold)
