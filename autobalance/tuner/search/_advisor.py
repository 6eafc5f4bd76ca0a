"""The default strategy: a per-rank memory model fitted from the study's own trials proposes
balanced splits (water-filling, per-rank checkpointing) and predicts OOMs before they are launched.

The wrapped Optuna sampler still proposes everything the model does not; every proposal is an
ordinary enqueued trial, so the study stays a plain Optuna study (dashboard, samplers, resume).
"""

from __future__ import annotations

import json
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance.protocol import Status, StudyAttr, TrialAttr, best_trial, objective_value
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner.search._dominance import activation_budget, dominating_over_cap
from autobalance.tuner.search._memory_model import MemoryModel, MemoryObservation
from autobalance.tuner.search._objective import TrialFigures, spread_fraction
from autobalance.tuner.search._solver import (
    balanced_split_for,
    plans_from_model,
    predict_config_feasible,
)
from autobalance.tuner.search._space import SearchSpace
from autobalance.tuner.search._step_time import StepTimeModel

__all__ = ["ModelAdvisor", "observations_from_trials"]

GIB = 2**30
_MAX_PREDICTED_IN_A_ROW = 25
SAMPLER_EVERY = 3
_WORTH = 1.5


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
            # any split: the largest micro-batch per rank that fits; the ranks whose steps cost more
            # per sample (more recomputation) give up the samples beyond the global batch first
            cost = [1.0 + timing.rho * c / layers for c in counts]
            cfg = self.space.config_for(micro, acc, cost, checkpoint=[list(range(c)) for c in counts], dtype=dtype,
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
                total = self.space.micro_total(acc)
                try:
                    plans = plans_from_model(model, total=total, num_layers=layers, dtype=dtype, limits=usable,
                                             max_plans=5, recompute_fraction=timing.rho,
                                             max_spread_bytes=max_spread,
                                             checkpoint_counts=None if self.space.num_layers > 0 else [0])
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
        t = timing.predict(cfg)
        if t is None:
            return None
        return objective_value(spread_fraction(peaks, capacity), t / (reference_ms or t),
                               weight_spread=self.settings.weight_spread, weight_time=self.settings.weight_time)

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
        what = (f"budget {activation_budget(other, rank):g}" if other.get("compile", "off") != "off"
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
