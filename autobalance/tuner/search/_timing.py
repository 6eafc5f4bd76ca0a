"""The timing model, fitted from the study's own trials once per decision (``search.Decision``): step time eager
(:class:`StepTimeModel`) and compiled (:class:`CompiledTimeModel`), compile time and the study's Inductor cache, a
trial's time, verification's price, and the time budget (:class:`TimeBudget`, ``--time-budget``): the one place a
stop for time is decided.

**Verification's price** (:func:`forecast_verification`), what the budget reserves: the one-step runs verifying the
best trial (:func:`verification_runs`; a run taking an earlier run's step is reused; the dropout runs only for a
model whose trials reported dropout, or did not report it), each priced from the study's launched trials
(:func:`run_prices`):

- its start-up and hand-over in a running worker: the median warm trial's ``startup + other`` (a study of cold
  trials: the median over all);
- a fresh worker: for the first run when the study's latest trial ended its pool (recycled or failed), after a
  compiled run in the share of compiled warm trials that recycled theirs (none in the 2026-12-03 H200 study
  ``h200c``, 2 of 4 in ``h200b``); it costs the slowest start-up of a trial that started a pool less a warm trial's
  (18.4 s in ``h200b``, whose first run after a recycled pool took 23.9 s, the next 5.8 s);
- its step, :data:`FIRST_STEP_FACTOR` times the measured (else predicted) one;
- its tensors' input and output, :data:`IO_S_PER_GB` per GB of parameters;
- compiled, its compile: from the Inductor cache when the study compiled the same graphs (its median cache hit,
  else :data:`FROM_CACHE_SHARE` of their cold compile), else its median miss.

Each comparison of two runs' tensors costs :data:`COMPARE_S_PER_GB` per GB; only the best candidate's runs are
reserved, times :data:`RESERVE_MARGIN`. On ``h200c`` (``tests/test_verify_reserve_replay.py``) the best at the stop
was reserved 133.9 s (two dropout runs not launched, three fresh workers never started) where its verification took
~67 s; priced as above it is within the margin.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance.protocol import (
    MEASURED_STATUSES,
    Status,
    StudyAttr,
    TrialAttr,
    best_trial,
    time_in_steps_s,
)
from autobalance.tuner.search._compiled_model import Pair
from autobalance.tuner.search._constants import (
    BETA_GRID,
    CACHE_HIT_PRIOR_S,
    COMPARE_S_PER_GB,
    COMPILE_PRIOR_S,
    COMPILE_SPEED_PRIOR,
    DTYPE_SPEED_PRIOR,
    DYNAMIC,
    EQUAL_SPEED_BAND,
    FIRST_STEP_FACTOR,
    FLOOR_RUNS,
    FROM_CACHE_SHARE,
    IO_S_PER_GB,
    MICRO_STEP_PRIOR,
    RECOMPUTE_PRIOR,
    RECOMPUTE_PRIOR_COMPILED,
    REGIONAL_COMPILE_SHARE,
    RESERVE_MARGIN,
    RHO_GRID,
    SHARDING_TIME_PRIOR,
)
from autobalance.tuner.search._model_errors import ModelErrors, attempt
from autobalance.tuner.search._space import REGIONAL_KEY, config_compile_key
from autobalance.verify import run_key

if TYPE_CHECKING:
    import optuna

    from autobalance.tuner._settings import TuneSettings

__all__ = ["COMPARE_S_PER_GB", "DYNAMIC", "FIRST_STEP_FACTOR", "FROM_CACHE_SHARE", "IO_S_PER_GB", "MICRO_STEP_PRIOR",
           "RECOMPUTE_PRIOR", "RESERVE_MARGIN", "CompiledTimeModel", "StepTimeModel", "TimeBudget", "cache_dir",
           "compile_env", "compile_notes", "compile_times", "compiled_graphs", "forecast_verification", "from_cache_s",
           "graph_keys", "next_trial_s", "per_trial_overhead_s", "trial_s", "typical_compile_s", "verification_runs",
           "worker_start_s"]


def _measured(t: FrozenTrial, *, compiled: bool) -> bool:
    """A trial of its own (not reused) that measured an eager (``compiled``: compiled) config."""
    a = t.user_attrs
    return (a.get(TrialAttr.STATUS) == Status.OK and bool(a.get(TrialAttr.CONFIG))
            and (a[TrialAttr.CONFIG].get("compile", "off") != "off") == compiled
            and a.get(TrialAttr.REUSED_FROM) is None)


# -------------------------------------------------------------------------------- eager step time
@dataclass(kw_only=True)
class StepTimeModel:
    """``t = a + s * max_r(acc * (b + g * c_r / L) + k[dtype] * n_r)`` milliseconds per optimizer step, ``n_r`` the
    samples rank ``r`` takes per step (``acc * m_r`` with equal micro-batches).

    ``a``: once per optimizer step (the optimizer, the last all-reduce); ``b``: once per micro-step whatever its
    size (kernel launches); ``k``: per sample, per dtype; ``g``: recomputing all ``L`` blocks once per micro-step;
    ``s``: 1 for a measured dtype, else the prior speed ratio. On the H200 grid of the GPT scenario the fixed terms
    dominate (b ~ 30 ms, k ~ 1.3 ms per sample): a model proportional to the micro-batch had 33 % median error
    there, this one 7.5 % (``benchmarks/RESULTS.md``). Mixed devices: ``speeds[r]`` multiplies rank ``r``'s ``k``
    and ``g`` terms, fitted from the ranks' busy times.

    Fitted by bounded least squares on relative errors; with fewer distinct configurations than parameters, the
    proportional form (``a = b = 0``); while checkpointing has not varied, ``g`` is :data:`RECOMPUTE_PRIOR`
    micro-steps. Parameter sharding (FSDP2) multiplies the step by ``sharding[param_sharding]``: the median of
    measured / predicted-unsharded over the study's trials of that sharding, else :data:`SHARDING_TIME_PRIOR`;
    sharded trials stay out of the fit.
    """

    a: float
    b: float
    g: float
    k: dict[str, float]
    num_layers: int
    prior: dict[str, float]
    """Relative speed priors per dtype, for dtypes without a measurement."""
    typical_micro_batch: float = 1.0
    """Mean micro-batch of the fitted trials (converts ``g`` into the solver's :attr:`rho`)."""
    speeds: list[float] | None = None
    """Each rank's relative cost per sample (1.0: the slowest rank); None: equally fast ranks
    (within :data:`EQUAL_SPEED_BAND`) or no busy times measured."""
    sharding: dict[str, float] = field(default_factory=lambda: dict(SHARDING_TIME_PRIOR))

    @property
    def rho(self) -> float:
        """The solver's proxy: recomputing all blocks costs ``rho`` typical micro-steps' ``k``."""
        k = min(self.k.values()) if self.k else 1.0
        return self.g / max(k * self.typical_micro_batch, 1e-9)

    def _scale(self, dtype: str) -> tuple[float, str] | None:
        if dtype in self.k:
            return 1.0, dtype
        if not self.k:
            return None
        known = min(self.k, key=lambda d: self.k[d] / self.prior.get(d, 1.0))
        return self.prior.get(dtype, 1.0) / self.prior.get(known, 1.0), known

    def predict(self, cfg: BalanceConfig | dict[str, Any]) -> float | None:
        parts = self.rank_ms(cfg)
        return None if parts is None else parts[0] + max(parts[1])

    def rank_ms(self, cfg: BalanceConfig | dict[str, Any]) -> tuple[float, list[float]] | None:
        """``a`` and each rank's micro-steps (the slowest is the step); None before any trial."""
        c = cfg.to_dict() if isinstance(cfg, BalanceConfig) else cfg
        scaled = self._scale(c["dtype"])
        if scaled is None:
            return None
        ratio, dtype = scaled
        mode = c.get("param_sharding", "off")
        f = 1.0 if mode == "off" else self.sharding.get(mode, max(self.sharding.values(), default=1.0))
        ranks = _rank_ms(c, b=self.b, k=self.k[dtype], g=self.g, layers=self.num_layers, speeds=self.speeds)
        return f * self.a, [f * ratio * ms for ms in ranks]

    def sample_costs(self, checkpointed: list[int], *, layers: int) -> list[float]:
        """Each rank's relative cost per sample, ``(1 + rho * c_r / L) * speeds[r]`` (the balanced split's weights)."""
        speeds = self.speeds or [1.0] * len(checkpointed)
        return [(1.0 + self.rho * c / layers) * s for c, s in zip(checkpointed, speeds, strict=True)]

    @classmethod
    def fit(cls, trials: list[FrozenTrial], *, num_layers: int, device: str,
            errors: ModelErrors | None = None) -> StepTimeModel:
        """Fitted on the measured eager trials; a least-squares fit that fails keeps its start (the
        proportional fit) or no per-rank speeds, noted in ``errors``."""
        prior = DTYPE_SPEED_PRIOR.get(device, DTYPE_SPEED_PRIOR["cpu"])
        measured = [(t.user_attrs[TrialAttr.CONFIG], float(t.user_attrs[TrialAttr.STEP_TIME_MS]))
                    for t in trials
                    if _measured(t, compiled=False) and t.user_attrs.get(TrialAttr.STEP_TIME_MS)]
        rows = [(cfg, ms) for cfg, ms in measured if cfg.get("param_sharding", "off") == "off"]
        sharded = [(cfg, ms) for cfg, ms in measured if cfg.get("param_sharding", "off") != "off"]
        if not rows:  # only sharded trials measured: their unsharded twins at the prior's ratio
            rows = [({**cfg, "param_sharding": "off"}, ms / SHARDING_TIME_PRIOR.get(cfg["param_sharding"], 1.0))
                    for cfg, ms in sharded]
            sharded = []
        typical = sum(sum(c["micro_batches"]) / len(c["micro_batches"]) for c, _ in rows) / len(rows) if rows else 1.0
        model = cls(a=0.0, b=0.0, g=0.0, k={}, num_layers=num_layers, prior=prior, typical_micro_batch=typical)
        if not rows:
            return model
        dtypes = sorted({cfg["dtype"] for cfg, _ in rows})
        any_ckpt = any(any(ck for ck in cfg["checkpoint"]) for cfg, _ in rows)
        distinct = len({json.dumps(cfg, sort_keys=True) for cfg, _ in rows})
        full = distinct >= 3 + len(dtypes) + 1  # a, b, g and one k per dtype, with one to spare
        # start: the proportional fit (k from the mean time per sample-step), g a prior share of it
        k0 = {d: float(np.mean([t / max(_samples_per_rank(c)) for c, t in rows if c["dtype"] == d])) for d in dtypes}
        g0 = RECOMPUTE_PRIOR * min(k0.values()) * typical
        x0 = ([0.0, 0.0, g0] if full else [g0]) + [k0[d] for d in dtypes]
        g_at = 2 if full else 0
        if not any_ckpt:  # the data cannot see g (every c_r is 0): held at 0, the prior set below
            x0[g_at] = 0.0
        n, layers = len(x0), max(1, num_layers)

        def solve(busy: list[tuple[dict[str, Any], list[float]]], world: int) -> Any:
            """Bounded least squares on relative errors of the step times and, with ``world`` speeds (rank 0's
            fixes the scale: ``k * speed`` is what is seen), of every rank's busy time (``a`` + its micro-steps)."""
            from scipy.optimize import least_squares

            def residuals(x: Any) -> list[float]:
                (a, b, g, k), w = _unpack(x[:n], dtypes, full), [float(v) for v in x[n:]] or None
                out = [(a + max(_rank_ms(c, b=b, k=k[c["dtype"]], g=g, layers=layers, speeds=w)))
                       / t - 1.0 for c, t in rows]
                for c, times in busy:
                    if c["dtype"] in k:
                        own = _rank_ms(c, b=b, k=k[c["dtype"]], g=g, layers=layers, speeds=w)
                        out += [(a + o) / t - 1.0 for o, t in zip(own, times, strict=True)]
                return out

            start = x0 + [1.0] * world
            lower, upper = [0.0] * n + [1e-3] * world, [np.inf] * (n + world)
            if world:
                lower[n], upper[n] = 1.0, 1.0 + 1e-12
            if not any_ckpt:
                upper[g_at] = 1e-12
            return least_squares(residuals, np.clip(start, lower, upper), bounds=(lower, upper)).x

        fitted = attempt(errors, "step time", solve, [], 0)
        model.a, model.b, model.g, model.k = _unpack(np.asarray(x0) if fitted is None else fitted, dtypes, full)
        # (configuration, each rank's busy ms) of the measured eager trials whose every rank reported one
        busy = [(t.user_attrs[TrialAttr.CONFIG], [float(v) for v in ms]) for t in trials
                if _measured(t, compiled=False) and isinstance(ms := t.user_attrs.get(TrialAttr.BUSY_MS), list)
                and len(ms) == len(t.user_attrs[TrialAttr.CONFIG]["micro_batches"])
                and all(isinstance(v, (int, float)) and v > 0 for v in ms)]
        x: Any = attempt(errors, "step time (per-rank speeds)", solve, busy, len(busy[0][1])) if busy else None
        w = [] if x is None else [float(v) for v in x[n:]]
        # speeds scaled so the slowest rank is 1.0 (g and k the other way); none if equally fast
        if w and not (max(w) <= 0 or max(w) / max(min(w), 1e-12) < EQUAL_SPEED_BAND):
            packed = [float(v) for v in x[:n]]
            packed[g_at:] = [v * max(w) for v in packed[g_at:]]
            model.a, model.b, model.g, model.k = _unpack(packed, dtypes, full)
            model.speeds = [max(v / max(w), 1e-3) for v in w]
        if not any_ckpt:
            model.g = RECOMPUTE_PRIOR * (model.b + min(model.k.values()) * typical)
        ratios: dict[str, list[float]] = {}  # per measured sharding: measured / predicted unsharded
        for cfg, ms in sharded:
            base = model.predict({**cfg, "param_sharding": "off"})
            if base is not None and base > 0:
                ratios.setdefault(cfg["param_sharding"], []).append(ms / base)
        for mode, values in sorted(ratios.items()):
            model.sharding[mode] = float(np.median(values))
        return model


def _unpack(x: Any, dtypes: list[str], full: bool) -> tuple[float, float, float, dict[str, float]]:
    """``(a, b, g, k)`` from the packed terms ``[a, b, g, *k]``, or ``[g, *k]`` (``a = b = 0``)."""
    a, b, g = (float(x[0]), float(x[1]), float(x[2])) if full else (0.0, 0.0, float(x[0]))
    return a, b, g, {d: float(v) for d, v in zip(dtypes, x[3:] if full else x[1:], strict=True)}


def _samples_per_rank(cfg: dict[str, Any]) -> list[int]:
    """Samples each rank takes per optimizer step (stored configurations of either form)."""
    if cfg.get("rank_samples"):
        return [int(n) for n in cfg["rank_samples"]]
    return [int(m) * int(cfg["accumulation"]) for m in cfg["micro_batches"]]


def _rank_ms(cfg: dict[str, Any], *, b: float, k: float, g: float, layers: int,
             speeds: list[float] | None) -> list[float]:
    """Each rank's micro-steps of one step, ``acc * (b + s_r * g * c_r / L) + s_r * k * n_r`` (``s_r``:
    ``speeds[r]``, else 1): no rank waits for another before the step's last all-reduce."""
    acc = int(cfg["accumulation"])
    samples = _samples_per_rank(cfg)
    if speeds is None or len(speeds) != len(samples):
        speeds = [1.0] * len(samples)
    return [acc * (b + s * g * len(ck) / max(1, layers)) + s * k * n
            for n, ck, s in zip(samples, cfg["checkpoint"], speeds, strict=True)]


# ----------------------------------------------------------------------------- compiled step time
@dataclass(kw_only=True)
class CompiledTimeModel:
    """``t = a + s * max_r (e_r + (beta - 1) * acc * b) * (1 + rho * (1 - b_r))`` per (dtype, mode).

    ``a`` and ``e_r = acc * b + k[dtype] * n_r`` (rank ``r``'s micro-steps without checkpointing) come from the
    eager :class:`StepTimeModel`. ``s`` is the pair's compiled-versus-eager speed, ``beta`` a compiled micro-step's
    fixed cost relative to an eager one (CUDA graphs replay a micro-step's kernels with one launch:
    ``reduce-overhead`` starts at :data:`MICRO_STEP_PRIOR`), ``rho * (1 - b_r)`` the recomputation at budget
    ``b_r``. ``rho`` and ``beta`` are chosen on grids, ``s`` in closed form; each stays at its prior
    (:data:`RECOMPUTE_PRIOR_COMPILED`, the mode's) while the pair's trials have not varied budgets / micro-steps. A
    pair without trials borrows another's ``s`` and ``rho`` within its scope (the same mode first, then the same
    dtype), never another mode's ``beta``; without any, :data:`COMPILE_SPEED_PRIOR`.
    """

    eager: StepTimeModel
    speed: dict[Pair, float] = field(default_factory=dict)
    """``s`` of the pairs with measured compiled trials."""
    recompute: dict[Pair, float] = field(default_factory=dict)
    """``rho`` of those pairs."""
    micro_step: dict[Pair, float] = field(default_factory=dict)
    """``beta`` of those pairs."""
    prior_speed: float = 1.0

    def params(self, dtype: str, mode: str) -> tuple[float, float, bool]:
        """``(s, rho, own)``: the pair's own fit, else a borrowed one, else the prior."""
        pair = (dtype, mode)
        if pair in self.speed:
            return self.speed[pair], self.recompute[pair], True
        scope = mode.endswith(REGIONAL_KEY)
        for other in sorted((p for p in self.speed if p[1].endswith(REGIONAL_KEY) == scope),
                            key=lambda p: (p[1] != mode, p[0] != dtype, p)):
            return self.speed[other], self.recompute[other], False
        return self.prior_speed, RECOMPUTE_PRIOR_COMPILED, False

    def beta(self, dtype: str, mode: str) -> float:
        """``beta``: the pair's own fit, else the same mode's with another dtype, else its prior."""
        if (dtype, mode) in self.micro_step:
            return self.micro_step[(dtype, mode)]
        for other in sorted(p for p in self.micro_step if p[1] == mode):
            return self.micro_step[other]
        return MICRO_STEP_PRIOR.get(mode.removesuffix(REGIONAL_KEY), 1.0)

    def recompute_factor(self, dtype: str, mode: str, budget: float) -> float:
        """``1 + rho * (1 - budget)``: a compiled micro-step's cost at ``budget`` relative to 1."""
        return 1.0 + self.params(dtype, mode)[1] * (1.0 - budget)

    def rank_ms(self, config: BalanceConfig | dict[str, Any]) -> tuple[float, list[float]] | None:
        """``a`` and each rank's compiled micro-steps; None before any eager measurement."""
        c = config.to_dict() if isinstance(config, BalanceConfig) else config
        parts = _eager_parts(self.eager, c)
        if parts is None:
            return None
        a, ranks, budgets, micro_steps = parts
        mode = config_compile_key(c)
        s, rho, _ = self.params(c["dtype"], mode)
        fixed = (self.beta(c["dtype"], mode) - 1.0) * micro_steps
        return a, [s * max(0.0, e + fixed) * (1.0 + rho * (1.0 - b))
                   for e, b in zip(ranks, budgets, strict=True)]

    def predict(self, config: BalanceConfig | dict[str, Any]) -> float | None:
        """Predicted milliseconds per optimizer step."""
        parts = self.rank_ms(config)
        return None if parts is None else parts[0] + max(parts[1])

    @classmethod
    def fit(cls, trials: Sequence[FrozenTrial], *, eager: StepTimeModel, device: str) -> CompiledTimeModel:
        model = cls(eager=eager, prior_speed=COMPILE_SPEED_PRIOR.get(device, 1.0))
        rows: dict[Pair, list[tuple[dict[str, Any], float]]] = {}
        for t in trials:
            if _measured(t, compiled=True) and t.user_attrs.get(TrialAttr.STEP_TIME_MS):
                cfg = t.user_attrs[TrialAttr.CONFIG]
                rows.setdefault((cfg["dtype"], config_compile_key(cfg)), []).append(
                    (cfg, float(t.user_attrs[TrialAttr.STEP_TIME_MS])))
        for pair, group in rows.items():
            fitted = _fit_pair(eager, group, beta_prior=MICRO_STEP_PRIOR.get(pair[1].removesuffix(REGIONAL_KEY), 1.0))
            if fitted is not None:
                model.speed[pair], model.recompute[pair], model.micro_step[pair] = fitted
        return model


def _eager_parts(eager: StepTimeModel, cfg: dict[str, Any]) -> tuple[float, list[float], list[float], float] | None:
    """``a``, each rank's ``e_r`` and budget ``b_r``, and ``acc * b``; None before any eager trial."""
    parts, scaled = eager.rank_ms({**cfg, "checkpoint": [[] for _ in cfg["micro_batches"]]}), eager._scale(cfg["dtype"])
    if parts is None or scaled is None:
        return None
    budgets = cfg.get("activation_budget") or [1.0] * len(parts[1])
    return parts[0], parts[1], [float(b) for b in budgets], scaled[0] * int(cfg["accumulation"]) * eager.b


def _fit_pair(eager: StepTimeModel, rows: list[tuple[dict[str, Any], float]], *,
              beta_prior: float = 1.0) -> tuple[float, float, float] | None:
    """``(s, rho, beta)`` minimising the squared relative errors; among equal errors the one nearest the priors."""
    parts = []
    for cfg, ms in rows:
        eager_parts = _eager_parts(eager, cfg)
        if eager_parts is None or ms <= 0:
            return None
        parts.append((*eager_parts, ms))
    varied = len({tuple(b) for _, _, b, _, _ in parts}) > 1
    steps_varied = len({round(m, 9) for _, _, _, m, _ in parts}) > 1
    q = [1.0 - a / ms for a, _, _, _, ms in parts]
    best: tuple[float, float, float, float, float] | None = None  # (error, distance from the priors, s, rho, beta)
    for beta in (BETA_GRID if steps_varied else [beta_prior]):
        for rho in (RHO_GRID if varied else [RECOMPUTE_PRIOR_COMPILED]):
            p = [max(max(0.0, e + (beta - 1.0) * m) * (1.0 + rho * (1.0 - b)) for e, b in zip(ranks, budgets, strict=True))
                 / ms for _, ranks, budgets, m, ms in parts]
            denominator = sum(x * x for x in p)
            if denominator <= 0:
                continue
            s = max(1e-3, sum(x * y for x, y in zip(p, q, strict=True)) / denominator)
            error = round(sum((s * x - y) ** 2 for x, y in zip(p, q, strict=True)), 12)
            candidate = (error, abs(rho - RECOMPUTE_PRIOR_COMPILED) + abs(beta - beta_prior), s, rho, beta)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
    return None if best is None else (best[2], best[3], best[4])


# ------------------------------------------------------------ compile time and the Inductor cache
Graph = tuple[str, str, float, int, float]
"""(dtype, mode, bucket MB, micro-batch size or :data:`DYNAMIC`, budget): what a rank compiles."""


def graph_keys(cfg: dict[str, Any]) -> set[Graph]:
    """The graphs a compiled configuration compiles, one per rank: static at its micro-step size, or
    dynamic (:data:`DYNAMIC`) when its micro-steps differ in size (``runtime._compile``)."""
    if cfg.get("compile", "off") == "off":
        return set()
    config = BalanceConfig.from_dict(cfg)
    budgets = config.activation_budget or [1.0] * config.world_size
    sizes = [set(config.micro_step_sizes(r)) for r in range(config.world_size)]
    return {(config.dtype, config_compile_key(config), float(config.bucket_cap_mb),
             next(iter(s)) if len(s) == 1 else DYNAMIC, round(float(budgets[r]), 3))
            for r, s in enumerate(sizes)}


def compiled_graphs(trials: Sequence[FrozenTrial]) -> set[Graph]:
    """Graphs the study's launched trials compiled (what the per-study Inductor cache holds)."""
    return {graph for t in trials
            if t.state == TrialState.COMPLETE and (cfg := t.user_attrs.get(TrialAttr.CONFIG))
            and t.user_attrs.get(TrialAttr.STATUS) in MEASURED_STATUSES
            and t.user_attrs.get(TrialAttr.REUSED_FROM) is None for graph in graph_keys(cfg)}


def _compile_s(t: FrozenTrial) -> float | None:
    seconds = t.user_attrs.get(TrialAttr.COMPILE_S)
    return float(seconds) if isinstance(seconds, (int, float)) else None


def _cache(t: FrozenTrial) -> tuple[int, int]:
    """(FX graph cache hits, misses) of a trial's compile."""
    cache = t.user_attrs.get(TrialAttr.COMPILE_CACHE) or {}
    return cache.get("fx_graph_hits", 0), cache.get("fx_graph_misses", 0)


def compile_times(trials: Sequence[FrozenTrial], *, device: str, scope: str | None = None) -> tuple[float, float]:
    """(median compile from the Inductor cache, median compile with cache misses) of the study's launched compiled
    trials; where it measured none, :data:`COMPILE_PRIOR_S` cold and from the cache :data:`FROM_CACHE_SHARE` of it,
    at least :data:`CACHE_HIT_PRIOR_S`. ``scope`` (``whole`` / ``regional``): that scope's trials only; a scope the
    study has not compiled is priced from the other's (:data:`REGIONAL_COMPILE_SHARE`)."""
    if scope is not None:
        own = [t for t in trials if _scope(t) == scope]
        others = [t for t in trials if _scope(t) not in (None, scope)]
        low, high = REGIONAL_COMPILE_SHARE
        for group, factor in ((own, 1.0), (others, high if scope == "regional" else 1.0 / low)):
            if any(_compile_s(t) is not None for t in group):
                warm, cold = compile_times(group, device=device)
                return warm * factor, cold * factor
    timed = [(s, *_cache(t)) for t in trials
             if (s := _compile_s(t)) is not None and t.user_attrs.get(TrialAttr.REUSED_FROM) is None]
    every = [s for s, _, _ in timed]
    miss = [s for s, _, misses in timed if misses > 0]
    hit = [s for s, hits, misses in timed if not misses > 0 and hits > 0]
    if not every:
        cold = COMPILE_PRIOR_S.get(device, COMPILE_PRIOR_S["cpu"])
        return max(CACHE_HIT_PRIOR_S, FROM_CACHE_SHARE * cold), cold
    cold = statistics.median(miss) if miss else statistics.median(every)
    warm = statistics.median(hit) if hit else min(min(every), max(CACHE_HIT_PRIOR_S, FROM_CACHE_SHARE * cold))
    return warm, cold


def typical_compile_s(trials: Sequence[FrozenTrial]) -> float | None:
    """The median of the compile times the study's trials recorded (the upper one of an even count: a
    measured time), what a compile the study did not run is priced at in its summary; None before any."""
    times = sorted(float(t.user_attrs[TrialAttr.COMPILE_S]) for t in trials if t.user_attrs.get(TrialAttr.COMPILE_S))
    return times[len(times) // 2] if times else None


def _scope(trial: FrozenTrial) -> str | None:
    """A compiled trial's compile scope (None: eager or no configuration)."""
    cfg = trial.user_attrs.get(TrialAttr.CONFIG) or {}
    if not isinstance(cfg, dict) or cfg.get("compile", "off") == "off":
        return None
    return str(cfg.get("compile_scope", "whole"))


def cache_dir(runs_dir: str, study_name: str) -> str:
    """``<runs_dir>/<study>/inductor-cache``: one persistent Inductor cache per study."""
    return os.path.abspath(os.path.join(runs_dir, study_name, "inductor-cache"))


def compile_env(settings: TuneSettings) -> dict[str, str]:
    """Environment for the study's trials: a per-study Inductor cache with the FX graph and
    AOTAutograd caches on (a cache directory the user set is kept). Empty when nothing compiles."""
    if settings.compile_modes() == ["off"]:
        return {}
    env = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir(settings.runs_dir, settings.study_name)
        # made here: a backend that writes nothing (aot_eager) still gets it, and no two trials race
        os.makedirs(env["TORCHINDUCTOR_CACHE_DIR"], exist_ok=True)
    return env


def compile_notes(trials: list[FrozenTrial]) -> tuple[list[str], float]:
    """Summary lines on compile time (total, and per trial with a cold or warm cache), and the total."""
    launched = [t for t in trials if t.user_attrs.get(TrialAttr.COMPILE_S) is not None
                and t.user_attrs.get(TrialAttr.REUSED_FROM) is None]
    if not launched:
        return [], 0.0
    times = [float(t.user_attrs[TrialAttr.COMPILE_S]) for t in launched]
    total = sum(times)
    lines = [f"Compile: {len(launched)} compiled trial(s) spent {total:.1f} s compiling in total "
             f"(median {statistics.median(times):.1f} s); the objective uses step time only, production runs "
             "compile once."]
    if proposed := sum(t.user_attrs.get("proposed_by") == "compiled-model" for t in launched):
        lines.append(f"The compiled model proposed {proposed} of them (each rank's largest budget predicted to fit).")
    caches = [_cache(t) for t in launched]
    warm = [s for s, (hits, misses) in zip(times, caches, strict=True) if hits > 0 and misses == 0]
    cold = [s for s, (_, misses) in zip(times, caches, strict=True) if misses > 0]
    hits, misses = sum(h for h, _ in caches), sum(m for _, m in caches)
    if hits or misses:
        text = f"Inductor FX graph cache: {hits} hit(s), {misses} miss(es)"
        if warm and cold:
            saved = statistics.median(cold) - statistics.median(warm)
            text += (f"; median compile {statistics.median(cold):.1f} s with misses vs {statistics.median(warm):.1f} s "
                     f"from the cache (about {saved * len(warm):.0f} s saved over {len(warm)} cached trial(s))")
        lines.append(text + ".")
    return lines, total


# --------------------------------------------------------------------------------- a trial's time
def per_trial_overhead_s(trials: list[FrozenTrial], *, last: int = 5) -> float | None:
    """Median over the last ``last`` launched ok trials of the wall time outside warm-up and measured steps, compile
    and a warm pool's start (a cold trial's start-up, the script's set-up, the hand-over); None before any."""
    recent = [max(0.0, float(a[TrialAttr.WALL_S]) - in_steps
                  - float(a.get(TrialAttr.COMPILE_S) or 0.0) - float(a.get(TrialAttr.POOL_START_S) or 0.0))
              for t in trials
              if t.state == TrialState.COMPLETE and (a := t.user_attrs).get(TrialAttr.STATUS) == Status.OK
              and a.get(TrialAttr.REUSED_FROM) is None and a.get(TrialAttr.WALL_S) is not None
              and (in_steps := time_in_steps_s(a)) is not None][-last:]
    return statistics.median(recent) if recent else None


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
    """The median wall time of the study's launched trials without their compiling (0 before any)."""
    ran = _launched(trials)
    return statistics.median(_part(t, "startup", "steps", "remeasure", "other") for t in ran) if ran else 0.0


def from_cache_s(trials: Sequence[FrozenTrial], cfg: BalanceConfig, *, cold: float) -> float:
    """A compile of ``cfg``'s graphs from the study's Inductor cache: the study's median cache hit,
    else :data:`FROM_CACHE_SHARE` of what trials compiling the same graphs took cold."""
    timed = [(s, t) for t in _every_launched(trials) if (s := _compile_s(t)) is not None]
    if hits := [s for s, t in timed if _cache(t)[0] > 0 and not _cache(t)[1]]:
        return statistics.median(hits)
    keys = graph_keys(cfg.to_dict())
    same = [s for s, t in timed if graph_keys(t.user_attrs.get(TrialAttr.CONFIG) or {}) == keys]
    return FROM_CACHE_SHARE * (statistics.median(same) if same else cold)


def _compile_price(trials: Sequence[FrozenTrial], config: BalanceConfig, *, device: str, graphs: set[Graph]) -> float:
    """``config``'s compile: from the study's cache when the study compiled its graphs
    (:func:`from_cache_s`), else the study's median cold compile in its scope."""
    _, cold = compile_times(trials, device=device, scope=config.compile_scope)
    cached = graph_keys(config.to_dict()) <= graphs
    return from_cache_s(trials, config, cold=cold) if cached else cold


def trial_s(trials: Sequence[FrozenTrial], config: BalanceConfig, *, device: str) -> float:
    """The expected wall time of launching ``config`` next: :func:`next_trial_s` plus its compile."""
    if config.compile == "off":
        return next_trial_s(trials)
    return next_trial_s(trials) + _compile_price(trials, config, device=device, graphs=compiled_graphs(trials))


# --------------------------------------------------------------------------- verification's price
@dataclass(kw_only=True)
class VerifyForecast:
    """The predicted time of verifying one candidate."""

    seconds: float
    """Its runs' (in launch order) and comparisons' predicted wall seconds."""
    runs: list[str] = field(default_factory=list)
    trial: int | None = None
    per_run: dict[str, float] = field(default_factory=dict)
    compare_s: float = 0.0

    @property
    def reserve_s(self) -> float:
        """What the time budget keeps free for it: the forecast times :data:`RESERVE_MARGIN`."""
        return self.seconds * RESERVE_MARGIN


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
    recomputes = tuned.compile != "off" and any(b < 1.0 for b in tuned.activation_budget or [])
    if dropout and (any(tuned.checkpoint) or recomputes):
        plain = dataclasses.replace(tuned, checkpoint=[[] for _ in tuned.micro_batches], activation_budget=None)
        runs += [("tuned-dropout", tuned, True), ("tuned-dropout-no-recompute", plain, True)]
    # a run that takes the same step as an earlier one is reused, not launched (verify.SharedRuns)
    unique: dict[str, tuple[str, BalanceConfig, bool]] = {}
    for name, config, with_dropout in runs:
        key = run_key(config, dropout="on" if with_dropout else "off", global_batch=config.global_batch,
                      reverse=name == "floor")
        unique.setdefault(key, (name, config, with_dropout))
    return list(unique.values())


def _pool_start(t: FrozenTrial) -> float:
    return float(t.user_attrs.get(TrialAttr.POOL_START_S) or 0.0)


def _warm(t: FrozenTrial) -> bool:
    """A trial in a warm pool (it started one, or ran in one)."""
    return _pool_start(t) > 0 or bool(t.user_attrs.get("warm_pool_trial"))


@dataclass(frozen=True)
class RunPrices:
    """A verification run's costs besides its step and compile (module doc): its start-up in a running worker, a
    fresh worker's start on top (0 in a cold study), whether the first run starts one, the recycling share."""

    start_s: float
    fresh_s: float
    first_fresh: bool
    recycle_share: float


def worker_start_s(trials: Sequence[FrozenTrial]) -> float:
    """A fresh worker's start: the slowest start-up of a trial that started a pool, less a warm
    trial's start-up; 0 before any started one."""
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
    compiled = [t for t in ran
                if _warm(t) and (t.user_attrs.get(TrialAttr.CONFIG) or {}).get("compile", "off") != "off"]
    share = (sum(1 for t in compiled if t.user_attrs.get(TrialAttr.WARM_RECYCLED)) / len(compiled) if compiled
             else 1.0)
    return RunPrices(start_s=start, fresh_s=worker_start_s(trials), first_fresh=first_fresh, recycle_share=share)


def forecast_verification(trials: Sequence[FrozenTrial], *, baseline: BalanceConfig | None, best: FrozenTrial | None,
                          num_layers: int, device: str, eager: StepTimeModel | None = None,
                          compiled: CompiledTimeModel | None = None) -> VerifyForecast:
    """The predicted time of verifying ``best`` (module doc); 0 s without a candidate or when it is the script's own
    configuration. ``eager``, ``compiled``: the step-time models already fitted on ``trials`` (None: fitted here)."""
    if best is None or not (config := best.user_attrs.get(TrialAttr.CONFIG)):
        return VerifyForecast(seconds=0.0)
    tuned = BalanceConfig.from_dict(config)
    # dropout as the trials reported it; none reported it: a study recorded before they did
    counts = [n for t in trials if isinstance(n := t.user_attrs.get(TrialAttr.DROPOUT_MODULES), int)]
    runs = verification_runs(baseline, tuned, dropout=not counts or max(counts) > 0)
    if not runs:
        return VerifyForecast(seconds=0.0, trial=best.number)
    prices = run_prices(trials)
    measured = {json.dumps(cfg, sort_keys=True): float(ms) for t in trials
                if t.state == TrialState.COMPLETE and t.user_attrs.get(TrialAttr.STATUS) == Status.OK
                and (cfg := t.user_attrs.get(TrialAttr.CONFIG))
                and isinstance(ms := t.user_attrs.get(TrialAttr.STEP_TIME_MS), (int, float))}
    eager = eager or StepTimeModel.fit(list(trials), num_layers=num_layers, device=device)
    compiled = compiled or CompiledTimeModel.fit(list(trials), eager=eager, device=device)
    graphs = compiled_graphs(trials)
    gb = max((float(b) for t in trials if isinstance(b := t.user_attrs.get(TrialAttr.PARAMETER_BYTES), (int, float))),
             default=0.0) / 1e9
    per_run: dict[str, float] = {}
    fresh_next = float(prices.first_fresh)  # the expected fresh workers the next run starts
    for name, cfg, _dropout in runs:
        ms = measured.get(json.dumps(cfg.to_dict(), sort_keys=True))
        if ms is None:
            ms = (eager if cfg.compile == "off" else compiled).predict(cfg)
        seconds = (prices.start_s + fresh_next * prices.fresh_s + IO_S_PER_GB * gb
                   + FIRST_STEP_FACTOR * (ms if ms is not None else max(measured.values(), default=0.0)) / 1000.0)
        fresh_next = 0.0
        if cfg.compile != "off":
            seconds += _compile_price(trials, cfg, device=device, graphs=graphs)
            fresh_next = prices.recycle_share
        per_run[name] = seconds
    # floor and equivalence; noise and dtype for bf16/fp16; rng-replay with the dropout runs
    comparisons = 2 + 2 * (tuned.dtype != "fp32") + any(with_dropout for _, _, with_dropout in runs)
    compare_s = comparisons * COMPARE_S_PER_GB * gb
    return VerifyForecast(seconds=sum(per_run.values()) + compare_s, runs=[name for name, _, _ in runs],
                          trial=best.number, per_run=per_run, compare_s=compare_s)


# ------------------------------------------------------------------------------- the time budget
class DecisionView(Protocol):
    """What the budget reads of one decision (``_models.Decision``, which imports this module)."""

    study: optuna.Study
    trials: list[FrozenTrial]
    num_layers: int
    device: str
    clock: Callable[[], float]

    @property
    def step_time(self) -> StepTimeModel: ...
    @property
    def compiled_time(self) -> CompiledTimeModel: ...


@dataclass(kw_only=True)
class TimeBudget:
    """``--time-budget`` of one run: the run, verification included, ends by ``deadline`` (``time.monotonic()``):
    no trial starts once the time left is below the next trial's expected time plus verification's predicted time
    (:meth:`spent`, the loop's stop rule; :meth:`unaffordable`, a proposal's; :meth:`holds_compile`)."""

    budget_s: float | None
    started: float
    stopped: bool = False
    """Whether the budget, not ``--trials``, ended the trial loop."""
    reserve_s: float = 0.0
    """What is kept free at the end for verification (:attr:`VerifyForecast.reserve_s`)."""
    reserve_runs: int = 0
    next_trial_s: float = 0.0
    left_at_stop: float | None = None
    verify: bool = True
    """Whether the study's best is verified after the loop (``tune --no-verify``, several nodes: not)."""
    leaders: Callable[..., tuple[list[FrozenTrial], float]] | None = None
    """The leaders' least plan when they are re-measured before saving (``_remeasure.least_plan``;
    None: they are not): its time, :attr:`leaders_s`, is kept free too (0: none within the noise)."""
    leaders_s: float = 0.0
    compile_left_s: float | None = None
    """Seconds left for a compile once verification's reserve and a usual trial are kept (None: no budget, or
    nothing verified): a proposal compiling new graphs is made only when the study's median compile fits."""

    @property
    def deadline(self) -> float | None:
        return None if self.budget_s is None else self.started + self.budget_s

    def spent(self, now: float) -> bool:
        """Whether no further trial may start: the time left does not hold the next trial and
        verification, or a proposal found it so (:attr:`stopped`)."""
        return self.deadline is not None and (self.stopped or not self.holds(now, self.next_trial_s,
                                                                            self.reserve_s + self.leaders_s))

    def holds(self, now: float, trial_s: float, reserve_s: float) -> bool:
        """Whether a trial of ``trial_s`` started ``now`` leaves ``reserve_s`` before the deadline."""
        return self.deadline is None or now + trial_s + reserve_s < self.deadline

    def refresh(self, decision: DecisionView, now: float) -> None:
        """What is kept free, as predicted from ``decision``'s trials: the next trial, and the best
        trial's verification (:attr:`reserve_s`); nothing without a budget."""
        if self.budget_s is None:
            return
        self.next_trial_s = next_trial_s(decision.trials)
        leaders: list[FrozenTrial] = []
        if self.leaders is not None:
            leaders, self.leaders_s = self.leaders(decision.study, decision.trials, device=decision.device)
        # a leader may become the best: the larger verification is kept
        forecast = self.largest_forecast(decision, [best_trial(decision.study), *leaders[1:]])
        if forecast is None:  # nothing is verified after the study
            return
        self.reserve_s, self.reserve_runs = forecast.reserve_s, len(forecast.runs)
        self.compile_left_s = self.started + self.budget_s - now - self.reserve_s - self.leaders_s - self.next_trial_s

    def largest_forecast(self, decision: DecisionView,
                         candidates: Sequence[FrozenTrial | None]) -> VerifyForecast | None:
        """The largest of verification's forecasts for ``candidates`` (any may become the best),
        with ``decision``'s models; the first among equals; None when nothing is verified."""
        if not self.verify:
            return None
        base_no = decision.study.user_attrs.get(StudyAttr.BASELINE)
        own = next((t.user_attrs.get(TrialAttr.CONFIG) for t in decision.trials if t.number == base_no), None)
        baseline = BalanceConfig.from_dict(own) if own else None
        forecasts = [forecast_verification(decision.trials, baseline=baseline, best=best,
                                           num_layers=decision.num_layers, device=decision.device,
                                           eager=decision.step_time, compiled=decision.compiled_time)
                     for best in candidates]
        return max(forecasts, key=lambda f: f.reserve_s, default=None)

    def unaffordable(self, decision: DecisionView, config: BalanceConfig) -> str | None:
        """Why ``config`` is not launched under the time budget (None: it is): its expected time (a
        compile included) plus verification's reserve after it - of the best so far, or of ``config``
        should it become the best - no longer fits in the time left (``decision.clock``)."""
        if self.deadline is None:
            return None
        trials = decision.trials
        took = trial_s(trials, config, device=decision.device)
        candidate = FrozenTrial(number=len(trials), state=TrialState.COMPLETE, value=None, values=None,
                                datetime_start=None, datetime_complete=None, params={}, distributions={},
                                user_attrs={TrialAttr.CONFIG: config.to_dict()}, system_attrs={},
                                intermediate_values={}, trial_id=-1)
        forecast = self.largest_forecast(decision, [candidate])
        reserve = max(self.reserve_s, forecast.reserve_s if forecast is not None else 0.0) + self.leaders_s
        now = decision.clock()
        if self.holds(now, took, reserve):
            return None
        leaders = f" (re-measuring the leaders {self.leaders_s:.0f} s of it)" if self.leaders_s > 0 else ""
        return (f"the time budget no longer holds it: {max(0.0, self.deadline - now):.0f} s left, it would take "
                f"about {took:.0f} s and verification after it {reserve:.0f} s{leaders}; nothing was launched")

    def holds_compile(self, decision: DecisionView, scope: str | None = None) -> bool:
        """Whether :attr:`compile_left_s` (None: no limit) holds the study's median compile of ``scope``."""
        return (self.compile_left_s is None
                or compile_times(decision.trials, device=decision.device, scope=scope)[1] <= self.compile_left_s)

    def record(self) -> dict[str, Any]:
        """What the run's time accounting keeps about the reservation."""
        return {"verify_reserved": round(self.reserve_s, 1), "verify_reserved_runs": self.reserve_runs,
                "next_trial_s": round(self.next_trial_s, 1), "leaders_reserved": round(self.leaders_s, 1),
                "left_at_stop": None if self.left_at_stop is None else round(self.left_at_stop, 1)}
