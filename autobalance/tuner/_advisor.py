"""The default strategy: a per-rank memory model fitted from the study's own trials proposes
balanced splits (water-filling, per-rank checkpointing) and predicts OOMs before they are launched.

The wrapped Optuna sampler still proposes everything the model does not; every proposal is an
ordinary enqueued trial, so the study stays a plain Optuna study (dashboard, samplers, resume).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance.protocol import Status, StudyAttr, TrialAttr, best_trial
from autobalance.tuner._memory_model import MemoryModel, MemoryObservation
from autobalance.tuner._objective import TrialFigures
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner._solver import balanced_split_for, plans_from_model, predict_config_feasible
from autobalance.tuner._space import SearchSpace

__all__ = ["ModelAdvisor", "dominating_over_cap", "observations_from_trials"]

GIB = 2**30
_MAX_PREDICTED_IN_A_ROW = 25
SAMPLER_EVERY = 3
_WORTH = 1.5
# Step-time priors per dtype before any measurement (relative to fp32); replaced by measurements.
RECOMPUTE_PRIOR = 1.0
"""While checkpointing has not varied: recomputing all blocks once costs one typical micro-step
(``b + k * m``; the H200 grid of the GPT scenario measured 0.85 of it)."""
_DTYPE_SPEED_PRIOR = {"cuda": {"bf16": 0.55, "fp16": 0.55, "fp32": 1.0}, "cpu": {"bf16": 1.2, "fp16": 1.5, "fp32": 1.0}}


def observations_from_trials(trials: list[FrozenTrial], *, num_layers: int) -> list[MemoryObservation]:
    """One observation per rank of every measured (ok) or OOMed trial (OOM peaks are lower bounds)."""
    obs: list[MemoryObservation] = []
    for t in trials:
        status = t.user_attrs.get(TrialAttr.STATUS)
        if t.state != TrialState.COMPLETE or status not in (Status.OK, Status.OOM) or t.user_attrs.get(TrialAttr.REUSED_FROM) is not None:
            continue
        cfg = t.user_attrs.get(TrialAttr.CONFIG)
        peaks = t.user_attrs.get(TrialAttr.PEAK_DEVICE_GIB) or []
        if not cfg or len(peaks) != len(cfg["micro_batches"]) or cfg.get("compile", "off") != "off":
            continue  # the model is of eager memory; compiled trials follow their budget instead
        for rank, peak in enumerate(peaks):
            if peak is None or peak <= 0:
                continue
            obs.append(MemoryObservation(
                rank=rank, micro_batch=int(cfg["micro_batches"][rank]), checkpointed=len(cfg["checkpoint"][rank]),
                num_layers=max(1, num_layers), dtype=cfg["dtype"], peak_bytes=float(peak) * GIB, ok=status == Status.OK,
            ))
    return obs


def _budget(cfg: dict[str, Any], rank: int) -> float:
    budgets = cfg.get("activation_budget")
    return 1.0 if not budgets else float(budgets[rank])


def _ranks_over_cap(t: FrozenTrial) -> list[int] | None:
    """Ranks whose memory did not fit in trial ``t``; [] when it fit; None when it ran out of memory
    but the rank is unknown (then only a configuration that dominates it on every rank is implied)."""
    peaks = t.user_attrs.get(TrialAttr.PEAK_DEVICE_GIB) or []
    usable = t.user_attrs.get(TrialAttr.USABLE_GIB) or []
    over = {r for r, (p, u) in enumerate(zip(peaks, usable, strict=False)) if p is not None and u and p > u}
    if t.user_attrs.get(TrialAttr.STATUS) == Status.OOM:
        if t.user_attrs.get(TrialAttr.FAILING_RANK) is not None:
            over.add(int(t.user_attrs[TrialAttr.FAILING_RANK]))
        if not over:
            return None
    return sorted(over)


def _needs_at_least(cfg: dict[str, Any], other: dict[str, Any], rank: int) -> bool:
    """Rank ``rank`` of ``cfg`` holds at least the memory it held under ``other``: same dtype and
    compile mode, a micro-batch no smaller, no more recomputation (checkpointing the first N blocks,
    or a compile budget: a larger budget keeps more activations), buckets no smaller and not views
    where ``other`` used views. Accumulation does not change a rank's peak."""
    if cfg["dtype"] != other["dtype"] or cfg.get("compile", "off") != other.get("compile", "off"):
        return False
    return (cfg["micro_batches"][rank] >= other["micro_batches"][rank]
            and len(cfg["checkpoint"][rank]) <= len(other["checkpoint"][rank])
            and _budget(cfg, rank) >= _budget(other, rank)
            and float(cfg["bucket_cap_mb"]) >= float(other["bucket_cap_mb"])
            and (not cfg["gradient_as_bucket_view"] or bool(other["gradient_as_bucket_view"])))


def dominating_over_cap(trials: list[FrozenTrial], config: BalanceConfig) -> tuple[FrozenTrial, int] | None:
    """A launched trial that did not fit on some rank where ``config`` needs at least as much memory
    (so ``config`` will not fit either), with that rank; None when there is none. Model-free: it
    needs only monotonicity, so it covers compiled configurations, which the memory model does not."""
    cfg = config.to_dict()
    for t in trials:
        other = t.user_attrs.get(TrialAttr.CONFIG)
        if (t.state != TrialState.COMPLETE or t.user_attrs.get(TrialAttr.STATUS) not in (Status.OK, Status.OOM) or not other
                or t.user_attrs.get(TrialAttr.REUSED_FROM) is not None or len(other["micro_batches"]) != config.world_size):
            continue
        over = _ranks_over_cap(t)
        if over is None:
            if all(_needs_at_least(cfg, other, r) for r in range(config.world_size)):
                return t, int(t.user_attrs.get(TrialAttr.FAILING_RANK) or 0)
            continue
        for r in over:
            if _needs_at_least(cfg, other, r):
                return t, r
    return None


@dataclass(kw_only=True)
class StepTimeModel:
    """``t = a + acc * s * max_r(b + k[dtype] * m_r + g * c_r / L)`` milliseconds per optimizer step.

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
        c = cfg.to_dict() if isinstance(cfg, BalanceConfig) else cfg
        scaled = self._scale(c["dtype"])
        if scaled is None:
            return None
        ratio, dtype = scaled
        layers = max(1, self.num_layers)
        micro = max(self.b + self.k[dtype] * m + self.g * len(ck) / layers
                    for m, ck in zip(c["micro_batches"], c["checkpoint"], strict=True))
        return self.a + int(c["accumulation"]) * ratio * micro

    @classmethod
    def fit(cls, trials: list[FrozenTrial], *, num_layers: int, device: str) -> StepTimeModel:
        prior = _DTYPE_SPEED_PRIOR.get(device, _DTYPE_SPEED_PRIOR["cpu"])
        rows = [(t.user_attrs[TrialAttr.CONFIG], float(t.user_attrs[TrialAttr.STEP_TIME_MS])) for t in trials
                if t.user_attrs.get(TrialAttr.STATUS) == Status.OK and t.user_attrs.get(TrialAttr.STEP_TIME_MS)
                and t.user_attrs.get(TrialAttr.REUSED_FROM) is None and t.user_attrs.get(TrialAttr.CONFIG)
                and t.user_attrs[TrialAttr.CONFIG].get("compile", "off") == "off"]
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
            micro = max(b + k[cfg["dtype"]] * m + g * len(ck) / layers
                        for m, ck in zip(cfg["micro_batches"], cfg["checkpoint"], strict=True))
            return a + int(cfg["accumulation"]) * micro

        # start: the proportional fit (k from the mean time per sample-step), g a prior share of it
        k0 = {d: float(np.mean([t / (int(c["accumulation"]) * max(c["micro_batches"])) for c, t in rows
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
        except Exception:
            x = np.asarray(x0)
        model.a, model.b, model.g, model.k = unpack(x)
        if not any_ckpt:
            model.g = RECOMPUTE_PRIOR * (model.b + min(model.k.values()) * typical)
        return model


class ModelAdvisor:
    """Enqueues model-balanced configurations and vetoes predicted OOMs."""

    def __init__(self, *, space: SearchSpace, settings: TuneSettings) -> None:
        self.space = space
        self.settings = settings
        self.model: MemoryModel | None = None
        self._proposed: set[str] = set()
        self._predicted_in_a_row = 0
        self._margin = 0.05
        self._asks = 0

    # ------------------------------------------------------------------ model
    def _usable(self, study: optuna.Study) -> list[float] | None:
        caps = self.settings.caps_bytes()
        capacity = caps or study.user_attrs.get(StudyAttr.CAPACITY)
        if not capacity:
            return None
        if len(capacity) == 1:
            capacity = capacity * self.space.world_size
        return [float(c) * (1.0 - self.settings.headroom) for c in capacity]

    def refit(self, study: optuna.Study) -> MemoryModel | None:
        obs = observations_from_trials(study.get_trials(deepcopy=False), num_layers=self.space.num_layers)
        if not any(o.ok for o in obs):
            return None
        try:
            model = MemoryModel.fit(obs, world_size=self.space.world_size, safety_margin=self._margin)
        except Exception:
            return None
        self._margin = model.safety_margin
        self.model = model
        return model

    # ------------------------------------------------------------------ proposals
    def _reference_ms(self, study: optuna.Study) -> float | None:
        ref = study.user_attrs.get(StudyAttr.REFERENCE)
        return 1000 * float(ref) if ref else None

    def _neighbours(self, micro: list[int]) -> list[list[int]]:
        """Splits one sample away from ``micro`` (memory-balanced is not always fastest)."""
        out = []
        for a in range(len(micro)):
            for b in range(len(micro)):
                if a != b and micro[a] > 1:
                    moved = list(micro)
                    moved[a] -= 1
                    moved[b] += 1
                    out.append(moved)
        return out

    def candidates(self, study: optuna.Study) -> list[tuple[float, BalanceConfig]]:
        """Configurations the memory model predicts to fit, scored by the predicted objective
        (spread from the memory model, step time from a time model fitted to the study's trials)."""
        model = self.refit(study)
        usable = self._usable(study)
        if model is None or usable is None:
            return []
        timing = StepTimeModel.fit(study.get_trials(deepcopy=False), num_layers=self.space.num_layers,
                                   device=self.settings.device)
        reference = self._reference_ms(study)
        bucket, view = self._bucket_choice(study)
        layers = max(1, self.space.num_layers)
        world = self.space.world_size
        max_spread = self.settings.max_spread_gib * GIB if self.settings.max_spread_gib is not None else None
        seen: set[str] = set()
        out: list[tuple[float, BalanceConfig]] = []

        def consider(micro: list[int], counts: list[int], dtype: str, acc: int) -> None:
            cfg = BalanceConfig(micro_batches=micro, accumulation=acc, global_batch=self.space.global_batch,
                                checkpoint=[list(range(c)) for c in counts], dtype=dtype,
                                bucket_cap_mb=bucket, gradient_as_bucket_view=view)
            key = cfg.to_json()
            if key in seen or not self.space.contains(cfg):  # e.g. a split the space keeps fixed
                return
            seen.add(key)
            fits, peaks = predict_config_feasible(model, cfg, num_layers=layers, limits=usable)
            if not fits:
                return
            if max_spread is not None and max(peaks) - min(peaks) > max_spread:
                return
            score = self.predicted_objective(cfg, peaks, usable, timing, reference)
            if score is not None:
                out.append((score, cfg))

        for dtype in self.space.dtypes:
            if not model.can_predict(dtype):
                continue
            for acc in self.space.accumulations:
                total = self.space.global_batch // acc
                try:
                    plans = plans_from_model(model, total=total, num_layers=layers, dtype=dtype, limits=usable,
                                             max_plans=5, recompute_fraction=timing.rho,
                                             max_spread_bytes=max_spread)
                except Exception:
                    plans = []
                for plan in plans:
                    consider(list(plan.micro_batches), list(plan.checkpointed), dtype, acc)
                try:
                    even = balanced_split_for(model, total=total, checkpointed=[0] * world, num_layers=layers,
                                              dtype=dtype, limits=usable)
                except Exception:
                    even = None
                if even is not None:
                    for micro in (even, *self._neighbours(even)):
                        consider(micro, [0] * world, dtype, acc)
        out.sort(key=lambda item: item[0])
        return out

    def predicted_objective(self, cfg: BalanceConfig, peaks: list[float], usable: list[float],
                            timing: StepTimeModel, reference_ms: float | None) -> float | None:
        capacity = [u / (1.0 - self.settings.headroom) for u in usable]
        fracs = [p / c for p, c in zip(peaks, capacity, strict=True)]
        spread = max(fracs) - min(fracs)
        t = timing.predict(cfg)
        if t is None:
            return None
        ref = reference_ms or t
        return self.settings.weight_spread * spread + self.settings.weight_time * t / ref

    def _bucket_choice(self, study: optuna.Study) -> tuple[float, bool]:
        best = best_trial(study)
        if best is not None:
            cfg = best.user_attrs[TrialAttr.CONFIG]
            return float(cfg["bucket_cap_mb"]), bool(cfg["gradient_as_bucket_view"])
        return 25.0, True

    def before_ask(self, study: optuna.Study) -> None:
        """Enqueue the best untried model proposal when nothing is waiting.

        Every ``SAMPLER_EVERY``-th trial is left to the wrapped sampler (it explores what the model
        does not: bucket sizes, dtypes the model cannot predict yet); so are proposals scored more
        than ``_WORTH`` times the best candidate's score.
        """
        if study.get_trials(deepcopy=False, states=(TrialState.WAITING,)) or "off" not in self.space.compile_modes:
            return  # (its proposals are eager configurations)
        self._asks += 1
        if self._asks % SAMPLER_EVERY == 0:
            return
        candidates = self.candidates(study)
        if not candidates:
            return
        best_score = candidates[0][0]
        for score, cfg in candidates:
            if score > _WORTH * best_score:
                return
            key = cfg.to_json()
            measured = {json.dumps(t.user_attrs.get(TrialAttr.CONFIG), sort_keys=True)
                        for t in study.get_trials(deepcopy=False) if t.user_attrs.get(TrialAttr.CONFIG)}
            if key in self._proposed or key in measured:
                continue
            self._proposed.add(key)
            study.enqueue_trial(self.space.params_from_config(cfg),
                                user_attrs={"proposed_by": "memory-model", "proposed_config": cfg.to_dict()})
            return

    def holdout_error(self, study: optuna.Study) -> float | None:
        """Leave-one-trial-out mean relative error of the peak prediction over measured trials."""
        trials = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(TrialAttr.STATUS) == Status.OK
                  and t.user_attrs.get(TrialAttr.REUSED_FROM) is None]
        errors: list[float] = []
        for i, held in enumerate(trials):
            train = observations_from_trials(trials[:i] + trials[i + 1:], num_layers=self.space.num_layers)
            test = observations_from_trials([held], num_layers=self.space.num_layers)
            if not train or not test:
                continue
            try:
                model = MemoryModel.fit(train, world_size=self.space.world_size)
            except Exception:
                continue
            if not all(model.is_confident(rank=o.rank, micro_batch=o.micro_batch, checkpointed=o.checkpointed,
                                          num_layers=o.num_layers, dtype=o.dtype) for o in test):
                continue
            errors.append(model.holdout_error(test))
        return sum(errors) / len(errors) if errors else None

    # ------------------------------------------------------------------ vetoes
    def predict_infeasible(self, study: optuna.Study, config: BalanceConfig) -> tuple[TrialFigures, dict[str, Any]] | None:
        """Figures for a config that will not fit (a measured trial it dominates did not, or the
        model is confident); None to launch it."""
        usable = self._usable(study)
        if usable is None or self._predicted_in_a_row >= _MAX_PREDICTED_IN_A_ROW:
            return None
        dominated = dominating_over_cap(study.get_trials(deepcopy=False), config)
        if dominated is not None:
            self._predicted_in_a_row += 1
            return self._dominance_figures(config, usable, *dominated)
        model = self.model if self.model is not None else self.refit(study)
        if model is None or config.compile != "off":  # compiled memory follows the budget, not this model
            return None
        counts = [len(c) for c in config.checkpoint]
        if not model.can_predict(config.dtype) or not all(
            model.is_confident(rank=r, micro_batch=m, checkpointed=c, num_layers=max(1, self.space.num_layers),
                               dtype=config.dtype)
            for r, (m, c) in enumerate(zip(config.micro_batches, counts, strict=True))
        ):
            return None
        feasible, peaks = predict_config_feasible(model, config, num_layers=max(1, self.space.num_layers),
                                                  limits=usable)
        if feasible:
            self._predicted_in_a_row = 0
            return None
        self._predicted_in_a_row += 1
        capacity = [u / (1.0 - self.settings.headroom) for u in usable]
        worst = max(range(len(peaks)), key=lambda r: peaks[r] / usable[r])
        figures = TrialFigures(status=Status.PREDICTED_OOM, peak_device=list(peaks), peak_allocated=[None] * len(peaks),
                               peak_reserved=[None] * len(peaks), outside_pytorch=[None] * len(peaks),
                               capacity=capacity, step_time_s=None, samples_per_s=None, startup_s=None)
        attrs = {
            **figures.user_attrs(self.settings.headroom),
            "status": Status.PREDICTED_OOM,
            "predicted": True,
            "predicted_by": "memory-model",
            "reason": (f"not launched: the memory model predicts rank {worst} at {peaks[worst] / GIB:.3f} GiB "
                       f"(+{100 * model.safety_margin:.0f}% margin) > usable {usable[worst] / GIB:.3f} GiB"),
            "baseline": False,
        }
        return figures, attrs

    def _dominance_figures(self, config: BalanceConfig, usable: list[float], trial: FrozenTrial,
                           rank: int) -> tuple[TrialFigures, dict[str, Any]]:
        capacity = [u / (1.0 - self.settings.headroom) for u in usable]
        seen = (trial.user_attrs.get(TrialAttr.PEAK_DEVICE_GIB) or [None] * config.world_size)[rank]
        peaks: list[float | None] = [None] * config.world_size
        peaks[rank] = None if seen is None else float(seen) * GIB  # a lower bound: this one needs at least that
        figures = TrialFigures(status=Status.PREDICTED_OOM, peak_device=peaks, peak_allocated=[None] * len(peaks),
                               peak_reserved=[None] * len(peaks), outside_pytorch=[None] * len(peaks),
                               capacity=capacity, step_time_s=None, samples_per_s=None, startup_s=None)
        other = trial.user_attrs[TrialAttr.CONFIG]
        what = (f"budget {_budget(other, rank):g}" if other.get("compile", "off") != "off"
                else f"{len(other['checkpoint'][rank])} checkpointed blocks")
        attrs = {
            **figures.user_attrs(self.settings.headroom),
            "status": Status.PREDICTED_OOM,
            "predicted": True,
            "predicted_by": "dominance",
            "dominated_by": trial.number,
            "reason": (f"not launched: trial {trial.number} exceeded rank {rank}'s usable memory "
                       f"({usable[rank] / GIB:.3f} GiB) with micro-batch {other['micro_batches'][rank]}, {what}; this "
                       "configuration needs at least as much there (same dtype and compile mode, no smaller "
                       "micro-batch, no more recomputation, no smaller bucket)"),
            "baseline": False,
        }
        return figures, attrs

    def after_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """A launched trial that OOMed although the model said it fits widens the safety margin."""
        if self.model is None or trial.user_attrs.get(TrialAttr.STATUS) != Status.OOM:
            return
        usable = self._usable(study)
        for obs in observations_from_trials([trial], num_layers=self.space.num_layers):
            limit = usable[obs.rank] if usable else None
            self.model.correct(obs, limit=limit)
        self._margin = self.model.safety_margin
