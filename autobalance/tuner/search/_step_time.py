"""The step-time model: milliseconds per optimizer step from the configuration, fitted to the
study's measured trials (fixed per-step, per-micro-step and recompute costs, per-dtype speed)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from optuna.trial import FrozenTrial

from autobalance._config import BalanceConfig
from autobalance.protocol import Status, TrialAttr
from autobalance.tuner.search._constants import (
    DTYPE_SPEED_PRIOR,
    EQUAL_SPEED_BAND,
    RECOMPUTE_PRIOR,
    SHARDING_TIME_PRIOR,
)
from autobalance.tuner.search._model_errors import FIT_ERRORS, ModelErrors, caught

__all__ = ["EQUAL_SPEED_BAND", "RECOMPUTE_PRIOR", "StepTimeModel"]

# Step-time priors per dtype before any measurement (relative to fp32); replaced by measurements.


@dataclass(kw_only=True)
class StepTimeModel:
    """``t = a + s * max_r(acc * (b + g * c_r / L) + k[dtype] * n_r)`` milliseconds per optimizer
    step, ``n_r`` the samples rank ``r`` takes per step (``acc * m_r`` with equal micro-batches, so
    ``a + acc * s * max_r(b + k * m_r + g * c_r / L)``; with any split, micro-steps of different
    sizes cost their own samples).

    Mixed devices: ``speeds[r]`` multiplies rank ``r``'s per-sample and recompute terms
    (``acc * (b + speeds_r * g * c_r / L) + speeds_r * k * n_r``), fitted from the ranks' busy times
    (:func:`rank_speeds`; the slowest rank is 1.0); ``None`` when the ranks are equally fast.

    ``a``: once per optimizer step (the optimizer, the last all-reduce); ``b``: once per micro-step
    whatever its size (kernel launches: a GPU is far from saturated at small micro-batches); ``k``:
    per sample, per dtype; ``g``: recomputing all ``L`` blocks once per micro-step; ``s`` is 1 for a
    measured dtype and the prior speed ratio for one not measured yet. On the H200 grid of the GPT
    scenario the fixed terms dominate (b ~ 30 ms, k ~ 1.3 ms per sample), which a model
    proportional to the micro-batch (the earlier form) cannot express: 33 % median error there
    against 7.5 % for this one (``benchmarks/RESULTS.md``).

    Fitted to the study's measured eager trials by bounded least squares on relative errors. With
    fewer distinct configurations than parameters it falls back to the proportional form
    (``a = b = 0``); while checkpointing has not varied, ``g`` is ``RECOMPUTE_PRIOR`` micro-steps.

    Parameter sharding (FSDP2) multiplies the whole step by ``f[param_sharding]``: the median of
    measured / predicted-unsharded over the study's trials of that sharding, else
    :data:`SHARDING_TIME_PRIOR` (measured on an H200); sharded trials stay out of the fit of the
    unsharded terms.
    """

    a: float
    """Milliseconds per optimizer step."""
    b: float
    """Milliseconds per micro-step."""
    g: float
    """Milliseconds to recompute all blocks once in a micro-step."""
    k: dict[str, float]
    """Milliseconds per sample, per measured dtype."""
    num_layers: int
    """Blocks of the model."""
    prior: dict[str, float]
    """Relative speed priors per dtype, for dtypes without a measurement."""
    typical_micro_batch: float = 1.0
    """Mean micro-batch of the fitted trials (converts ``g`` into the solver's recompute fraction)."""
    speeds: list[float] | None = None
    """Each rank's relative cost per sample (1.0: the slowest rank), from the ranks' busy times;
    None: equally fast ranks (within :data:`EQUAL_SPEED_BAND`) or no busy times measured."""
    sharding: dict[str, float] = dataclasses.field(default_factory=lambda: dict(SHARDING_TIME_PRIOR))
    """Step time of each ``param_sharding`` relative to unsharded: measured, else the prior."""
    sharding_measured: list[str] = dataclasses.field(default_factory=list)
    """The shardings whose factor comes from the study's own trials (the others: the prior)."""

    @property
    def rho(self) -> float:
        """The solver's proxy: recomputing all blocks costs ``rho`` times a typical micro-step's
        per-sample compute."""
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
        """``a`` and each rank's micro-steps ``s * (acc * (b + g * c_r / L) + k * n_r)`` (the slowest
        one is the step: :meth:`predict`); None before any measurement."""
        c = cfg.to_dict() if isinstance(cfg, BalanceConfig) else cfg
        scaled = self._scale(c["dtype"])
        if scaled is None:
            return None
        ratio, dtype = scaled
        f = self.sharding_factor(c)
        return f * self.a, [f * ratio * ms for ms in _rank_ms(c, b=self.b, k=self.k[dtype], g=self.g, layers=self.num_layers,
                                                         speeds=self.speeds)]

    def sharding_factor(self, cfg: BalanceConfig | dict[str, Any]) -> float:
        """What ``cfg``'s parameter sharding multiplies the step by (1.0 unsharded)."""
        c = cfg.to_dict() if isinstance(cfg, BalanceConfig) else cfg
        mode = c.get("param_sharding", "off")
        return 1.0 if mode == "off" else self.sharding.get(mode, max(self.sharding.values(), default=1.0))

    def micro_step_ms(self, cfg: BalanceConfig | dict[str, Any]) -> float | None:
        """``s * acc * b``: the part of each rank's micro-steps (:meth:`rank_ms`) paid once per
        micro-step whatever its size (the compiled model scales it per compile mode); None before
        any measurement."""
        c = cfg.to_dict() if isinstance(cfg, BalanceConfig) else cfg
        scaled = self._scale(c["dtype"])
        return None if scaled is None else scaled[0] * int(c["accumulation"]) * self.b

    @classmethod
    def fit(cls, trials: list[FrozenTrial], *, num_layers: int, device: str,
            errors: ModelErrors | None = None) -> StepTimeModel:
        """Fitted on the measured eager trials; a least-squares fit that fails keeps its start (the
        proportional fit) or no per-rank speeds, noted in ``errors``."""
        prior = DTYPE_SPEED_PRIOR.get(device, DTYPE_SPEED_PRIOR["cpu"])
        measured = [(t.user_attrs[TrialAttr.CONFIG], float(t.user_attrs[TrialAttr.STEP_TIME_MS])) for t in trials
                    if t.user_attrs.get(TrialAttr.STATUS) == Status.OK and t.user_attrs.get(TrialAttr.STEP_TIME_MS)
                    and t.user_attrs.get(TrialAttr.REUSED_FROM) is None and t.user_attrs.get(TrialAttr.CONFIG)
                    and t.user_attrs[TrialAttr.CONFIG].get("compile", "off") == "off"]
        rows = [(cfg, ms) for cfg, ms in measured if cfg.get("param_sharding", "off") == "off"]
        sharded = [(cfg, ms) for cfg, ms in measured if cfg.get("param_sharding", "off") != "off"]
        if not rows:  # only sharded trials measured: their unsharded twins taken at the prior's ratio
            rows = [({**cfg, "param_sharding": "off"}, ms / SHARDING_TIME_PRIOR.get(cfg["param_sharding"], 1.0))
                    for cfg, ms in sharded]
            sharded = []
        dtypes = sorted({cfg["dtype"] for cfg, _ in rows})
        typical = (sum(sum(cfg["micro_batches"]) / len(cfg["micro_batches"]) for cfg, _ in rows) / len(rows)
                   if rows else 1.0)
        model = cls(a=0.0, b=0.0, g=0.0, k={}, num_layers=num_layers, prior=prior, typical_micro_batch=typical)
        if not rows:
            return model
        any_ckpt = any(any(ck for ck in cfg["checkpoint"]) for cfg, _ in rows)
        distinct = len({json.dumps(cfg, sort_keys=True) for cfg, _ in rows})
        full = distinct >= 3 + len(dtypes) + 1  # a, b, g and one k per dtype, with one to spare
        layers = max(1, num_layers)

        def unpack(x: Any) -> tuple[float, float, float, dict[str, float]]:
            a, b, g = (float(x[0]), float(x[1]), float(x[2])) if full else (0.0, 0.0, float(x[0]))
            ks = x[3:] if full else x[1:]
            return a, b, g, {d: float(v) for d, v in zip(dtypes, ks, strict=True)}

        def predict(x: Any, cfg: dict[str, Any]) -> float:
            a, b, g, k = unpack(x)
            return a + _slowest_rank_ms(cfg, b=b, k=k[cfg["dtype"]], g=g, layers=layers)

        # start: the proportional fit (k from the mean time per sample-step), g a prior share of it
        k0 = {d: float(np.mean([t / max(_samples_per_rank(c)) for c, t in rows
                                if c["dtype"] == d])) for d in dtypes}
        x0 = ([0.0, 0.0, RECOMPUTE_PRIOR * min(k0.values()) * typical] if full
              else [RECOMPUTE_PRIOR * min(k0.values()) * typical]) + [k0[d] for d in dtypes]
        lower, upper = [0.0] * len(x0), [np.inf] * len(x0)
        g_at = 2 if full else 0
        if not any_ckpt:  # the data cannot see g (every c_r is 0): fitted as 0, set from the prior below
            x0[g_at], upper[g_at] = 0.0, 1e-12
        from scipy.optimize import least_squares

        def residuals(x: Any) -> list[float]:
            return [predict(x, cfg) / t - 1.0 for cfg, t in rows]

        try:
            x = least_squares(residuals, np.clip(x0, lower, upper), bounds=(lower, upper)).x
        except FIT_ERRORS as exc:
            caught(errors, "step time", exc)
            x = np.asarray(x0)
        model.a, model.b, model.g, model.k = unpack(x)
        busy = _busy_rows(trials)
        if busy:  # mixed devices: the same terms with a speed per rank, fitted to the busy times too
            fitted = _fit_with_speeds(rows, busy, dtypes=dtypes, full=full, layers=layers, any_ckpt=any_ckpt,
                                      start=[float(v) for v in x0], errors=errors)
            if fitted is not None:
                (model.a, model.b, model.g, model.k), model.speeds = unpack(fitted[0]), fitted[1]
        if not any_ckpt:
            model.g = RECOMPUTE_PRIOR * (model.b + min(model.k.values()) * typical)
        model._learn_sharding(sharded)
        return model

    def _learn_sharding(self, sharded: list[tuple[dict[str, Any], float]]) -> None:
        """Each measured sharding's factor: the median of measured / predicted unsharded."""
        ratios: dict[str, list[float]] = {}
        for cfg, ms in sharded:
            base = self.predict({**cfg, "param_sharding": "off"})
            if base is not None and base > 0:
                ratios.setdefault(cfg["param_sharding"], []).append(ms / base)
        for mode, values in sorted(ratios.items()):
            self.sharding[mode] = float(np.median(values))
            self.sharding_measured.append(mode)


def _samples_per_rank(cfg: dict[str, Any]) -> list[int]:
    """Samples each rank takes per optimizer step (stored configurations of either form)."""
    if cfg.get("rank_samples"):
        return [int(n) for n in cfg["rank_samples"]]
    return [int(m) * int(cfg["accumulation"]) for m in cfg["micro_batches"]]


def _rank_ms(cfg: dict[str, Any], *, b: float, k: float, g: float, layers: int,
             speeds: list[float] | None = None) -> list[float]:
    """Each rank's micro-steps of one optimizer step: ``acc * (b + g * c_r / L) + k * n_r``, the
    per-sample and recompute terms times ``speeds[r]`` when given."""
    acc = int(cfg["accumulation"])
    samples = _samples_per_rank(cfg)
    if speeds is None or len(speeds) != len(samples):
        return [acc * (b + g * len(ck) / max(1, layers)) + k * n
                for n, ck in zip(samples, cfg["checkpoint"], strict=True)]
    return [acc * (b + s * g * len(ck) / max(1, layers)) + s * k * n
            for n, ck, s in zip(samples, cfg["checkpoint"], speeds, strict=True)]


def _slowest_rank_ms(cfg: dict[str, Any], *, b: float, k: float, g: float, layers: int,
                     speeds: list[float] | None = None) -> float:
    """The slowest rank's micro-steps of one optimizer step (no rank waits for another before the
    step's last all-reduce)."""
    return max(_rank_ms(cfg, b=b, k=k, g=g, layers=layers, speeds=speeds))


def _busy_rows(trials: list[FrozenTrial]) -> list[tuple[dict[str, Any], list[float]]]:
    """(configuration, each rank's busy ms) of the measured eager trials whose every rank reported one."""
    rows = []
    for t in trials:
        cfg, busy = t.user_attrs.get(TrialAttr.CONFIG), t.user_attrs.get(TrialAttr.BUSY_MS)
        if (t.user_attrs.get(TrialAttr.STATUS) != Status.OK or not cfg or not isinstance(busy, list)
                or cfg.get("compile", "off") != "off" or t.user_attrs.get(TrialAttr.REUSED_FROM) is not None):
            continue
        if len(busy) == len(cfg["micro_batches"]) and all(isinstance(v, (int, float)) and v > 0 for v in busy):
            rows.append((cfg, [float(v) for v in busy]))
    return rows


def _fit_with_speeds(rows: list[tuple[dict[str, Any], float]], busy: list[tuple[dict[str, Any], list[float]]], *,
                     dtypes: list[str], full: bool, layers: int, any_ckpt: bool,
                     start: list[float], errors: ModelErrors | None = None) -> tuple[list[float], list[float]] | None:
    """The model's terms (packed as in :meth:`StepTimeModel.fit`) with one speed per rank, fitted by
    bounded least squares on the step times and on every rank's busy time (``a`` plus its own
    micro-steps), and the speeds scaled so the slowest rank is 1.0 (``k`` and ``g`` scaled the other
    way: the same predictions); None when the ranks lie within :data:`EQUAL_SPEED_BAND`."""
    from scipy.optimize import least_squares

    world = len(busy[0][1])
    n = len(start)
    g_at = 2 if full else 0

    def split(x: Any) -> tuple[float, float, float, dict[str, float], list[float]]:
        a, b, g = (float(x[0]), float(x[1]), float(x[2])) if full else (0.0, 0.0, float(x[0]))
        ks = x[3:n] if full else x[1:n]
        return a, b, g, {d: float(v) for d, v in zip(dtypes, ks, strict=True)}, [float(v) for v in x[n:]]

    def residuals(x: Any) -> list[float]:
        a, b, g, k, w = split(x)
        out = [(a + _slowest_rank_ms(c, b=b, k=k[c["dtype"]], g=g, layers=layers, speeds=w)) / t - 1.0
               for c, t in rows]
        for c, times in busy:
            if c["dtype"] in k:
                own = _rank_ms(c, b=b, k=k[c["dtype"]], g=g, layers=layers, speeds=w)
                out += [(a + o) / t - 1.0 for o, t in zip(own, times, strict=True)]
        return out

    x0 = list(start) + [1.0] * world
    lower, upper = [0.0] * n + [1e-3] * world, [np.inf] * n + [np.inf] * world
    lower[n], upper[n] = 1.0, 1.0 + 1e-12  # rank 0's speed fixes the scale (k * speed is what is seen)
    if not any_ckpt:
        x0[g_at], upper[g_at] = 0.0, 1e-12
    try:
        x = least_squares(residuals, np.clip(x0, lower, upper), bounds=(lower, upper)).x
    except FIT_ERRORS as exc:
        caught(errors, "step time (per-rank speeds)", exc)
        return None
    w = split(x)[4]
    top = max(w)
    if top <= 0 or top / max(min(w), 1e-12) < EQUAL_SPEED_BAND:
        return None
    packed = [float(v) for v in x[:n]]
    for i in range(g_at, n):  # g and every k carry the slowest rank's cost
        packed[i] *= top
    return packed, [max(v / top, 1e-3) for v in w]

