"""A per-rank peak-memory model fitted from measured trials, with a self-correcting safety margin.

For one dtype the peak of rank ``r`` is modelled as::

    peak_r = fixed_r + micro_batch * (act_full - act_saved * checkpointed / num_layers)

``fixed_r`` holds what does not scale with the batch (parameters, gradients, optimizer state, DDP buckets,
rank-0-only extras: hence per rank); ``act_full`` is one sample's activations without checkpointing and
``act_saved`` what checkpointing all ``num_layers`` blocks saves per sample. The features
``[one-hot(rank), mb, -mb*c/L]`` are linear: each dtype is fitted by least squares on its successful trials. Where
they do not determine every parameter (too few points, one micro-batch, never checkpointed, ...), the fit is the
least-squares solution closest to a prior (:data:`ACTIVATION_BYTES_SCALE`, :data:`PRIOR_CHECKPOINT_SAVING`): the
prior only fills the directions the data cannot see, and predictions that depend on them are low-confidence
(:meth:`MemoryModel.is_confident`). Out-of-memory trials (``ok=False``) are only lower bounds: they feed the safety
margin (:meth:`MemoryModel.correct`), never the fit.

Optimizer state (uneven ZeRO-1, issue 34). When every successful observation carries the rank's
measured optimizer-state bytes ``o_r`` and its trial's whole state ``S_t``, the state is taken out
of the fit and put back as a known term::

    peak_r = fixed_r + o_r + micro_batch * (act_full - act_saved * checkpointed / num_layers)
    o_r    = S * q_r   with ``zero1`` shares q_r (sum 1),   o_r = S   unsharded
    S      = median over the observations of S_t

``fixed_r`` is then what stays on rank ``r`` whatever the sharding. Without those figures
``optimizer_total`` is None, the state stays inside ``fixed_r`` and a share cannot be predicted.

The floor. A rank never holds less than what it keeps apart from activations: the least held part measured on it
(:attr:`MemoryObservation.held`), else the parameter bytes, plus its optimizer state. A line fitted through few
points can cross it (a negative slope, a fixed part below zero): :meth:`MemoryModel.predict` never returns less
than :meth:`MemoryModel.floor_bytes`, and :meth:`MemoryModel.clamped` says when it had to (the search proposes
nothing from such a prediction). :meth:`MemoryModel.extrapolated` says when a prediction leaves what the data
determines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from autobalance._config import DTYPES, BalanceConfig
from autobalance._errors import UsageError
from autobalance._files import is_int, is_number
from autobalance.tuner.search._constants import (
    ACTIVATION_BYTES_SCALE,
    CLAMP_TOLERANCE,
    DEFAULT_SAFETY_MARGIN,
    MAX_MARGIN,
    PRIOR_CHECKPOINT_SAVING,
    WIDEN_FACTOR,
)
from autobalance.tuner.search._constants import CONFIDENT_TOL as _CONFIDENT_TOL
from autobalance.tuner.search._constants import RANK_TOL as _RANK_TOL


class Margined(Protocol):
    """A model with a self-correcting safety margin."""

    safety_margin: float
    corrections: int


def widen_margin(model: Margined, *, measured: float, predicted: float, max_margin: float) -> bool:
    """Widen ``model``'s margin on an under-prediction beyond it; True if widened. With ``e =
    measured / predicted - 1``, ``e > safety_margin`` makes the margin ``min(max_margin,
    WIDEN_FACTOR * e)``. Over-predictions change nothing (the next refit fixes them)."""
    if predicted <= 0:
        return False
    error = measured / predicted - 1.0
    if error <= model.safety_margin or model.safety_margin >= max_margin:
        return False
    model.safety_margin = min(max_margin, WIDEN_FACTOR * error)
    model.corrections += 1
    return True


def below_floor(line: float, floor: float) -> bool:
    """A fitted line impossible as a peak: at or below zero, or :data:`CLAMP_TOLERANCE` under ``floor``."""
    return line <= 0 or line < floor * (1.0 - CLAMP_TOLERANCE)


@dataclass(kw_only=True)
class MemoryObservation:
    """One rank's measured peak in one trial: its global rank, micro-batch, checkpointed blocks of
    the model's ``num_layers`` and the trial's autocast dtype (one of ``DTYPES``)."""

    rank: int
    micro_batch: int
    checkpointed: int
    num_layers: int
    dtype: str
    peak_bytes: float
    """Measured peak in bytes; for an out-of-memory trial (``ok`` False), a lower bound."""
    ok: bool = True
    optimizer_bytes: float | None = None
    """This rank's measured optimizer-state bytes in the trial (None: not measured)."""
    optimizer_total: float | None = None
    """The trial's whole optimizer state, all ranks together (None: not measured)."""
    held: bool = False
    """What the rank holds apart from activations, measured directly (``micro_batch`` 0)."""
    parameter_bytes: float | None = None
    """The model's parameter bytes (``TrialAttr.PARAMETER_BYTES``; None: not reported): a floor."""

    def __post_init__(self) -> None:
        for name in ("rank", "micro_batch", "checkpointed", "num_layers"):
            value = getattr(self, name)
            if not is_int(value):
                raise UsageError(f"MemoryObservation {name}={value!r} is not an integer; pass one.")
        if self.rank < 0:
            raise UsageError(f"MemoryObservation rank={self.rank} is negative; use the global one.")
        if self.micro_batch < 1 and not (self.held and self.micro_batch == 0 and self.ok):
            raise UsageError(f"MemoryObservation micro_batch={self.micro_batch} is below 1; every rank trains "
                             ">= 1 sample (0 only with held=True: what a rank holds apart from activations).")
        _check_checkpointed(self.checkpointed, self.num_layers)
        _check_dtype(self.dtype)
        if not is_number(self.peak_bytes):
            raise UsageError(f"MemoryObservation peak_bytes={self.peak_bytes!r} is not a number.")
        peak = self.peak_bytes = float(self.peak_bytes)
        if not math.isfinite(peak) or peak < 0 or (self.ok and peak == 0):
            raise UsageError(f"MemoryObservation peak_bytes={peak} is not a positive finite byte "
                             "count; pass the measured peak.")


@dataclass(kw_only=True, eq=False)
class DtypeFit:
    """The fitted parameters of one dtype (the module docstring's ``fixed_r``, ``act_full``, ``act_saved``)."""

    dtype: str
    fixed: list[float]
    act_full: float
    act_saved: float
    n_observations: int
    """Successful trials-ranks of this dtype the fit used."""
    identified: bool
    """True when this dtype's own observations determine every parameter (no prior involved)."""
    reference: str | None
    """The dtype whose fit served as the prior (None: the generic prior or no prior needed)."""
    scale: np.ndarray = field(repr=False)
    """Column scales: parameter ``j`` times ``scale[j]`` is its typical contribution in bytes."""
    unseen: np.ndarray = field(repr=False)
    """Orthonormal basis (columns, scaled coordinates) of the directions the data did not fix."""
    micro_range: tuple[int, int] | None = None
    """The least and largest micro-batch of this dtype's own observations (None: none, borrowed)."""

    @property
    def theta(self) -> np.ndarray:
        return np.array([*self.fixed, self.act_full, self.act_saved], dtype=float)


@dataclass(kw_only=True)
class MemoryModel:
    """Per-rank, per-dtype linear peak-memory model with a self-correcting safety margin: after a
    trial, :meth:`correct` the previous model with each new observation, then :meth:`refit`."""

    world_size: int
    safety_margin: float = DEFAULT_SAFETY_MARGIN
    """A prediction counts as feasible if ``peak * (1 + safety_margin) <= limit``."""
    max_margin: float = MAX_MARGIN
    corrections: int = 0
    """How many times the margin was widened."""
    fits: dict[str, DtypeFit] = field(default_factory=dict)
    """Fitted parameters per dtype (dtypes without any usable data or prior are absent)."""
    optimizer_total: float | None = None
    """``S``, the whole optimizer state in bytes (module docstring); None: in the fixed bytes."""
    held_floor: list[float] = field(default_factory=list)
    """Per rank, the floor apart from the optimizer state (module docstring); empty: zero."""

    def __post_init__(self) -> None:
        if not is_int(self.world_size) or self.world_size < 1:
            raise UsageError(f"world_size={self.world_size!r} is not a positive integer; pass the rank count.")
        if not 0 <= self.safety_margin <= self.max_margin:
            raise UsageError(f"safety_margin={self.safety_margin} is outside [0, max_margin="
                             f"{self.max_margin}]; use a small relative margin such as 0.05.")

    @classmethod
    def fit(cls, observations: Sequence[MemoryObservation], *, world_size: int,
            safety_margin: float = DEFAULT_SAFETY_MARGIN) -> MemoryModel:
        """Least-squares fit per dtype on the successful observations (prior-completed); then each
        observation corrects the margin (:meth:`correct`), except one of a dtype with no successful
        observation of its own (an fp32 baseline OOM predicted from bf16: the prior missed)."""
        model = cls(world_size=world_size, safety_margin=safety_margin)
        for obs in observations:
            model._check_rank(obs.rank)
        measured = list(observations)  # the margin is checked against the peaks as measured
        ok = [o for o in observations if o.ok]
        if ok and all(o.optimizer_bytes is not None and o.optimizer_total is not None for o in ok):
            model.optimizer_total = float(np.median([float(o.optimizer_total or 0.0) for o in ok]))
            observations = [o if o.optimizer_bytes is None  # fitted without the measured state
                            else replace(o, peak_bytes=max(1.0, o.peak_bytes - o.optimizer_bytes))
                            for o in observations]
        # the floor: per rank the least held part measured on it, at least the parameters (else 0)
        params = max((float(o.parameter_bytes) for o in observations if o.parameter_bytes), default=0.0)
        held = [o for o in observations if o.held and o.ok]
        model.held_floor = [max(min((o.peak_bytes for o in held if o.rank == r), default=0.0),
                                params) for r in range(world_size)]
        by_dtype = {d: [o for o in observations if o.ok and o.dtype == d] for d in DTYPES}
        order = sorted((d for d in DTYPES if by_dtype[d]), key=lambda d: (
            -_data_rank(by_dtype[d], world_size), -len(by_dtype[d]), DTYPES.index(d)))
        reference: DtypeFit | None = None
        for dtype in order:
            model.fits[dtype] = _fit_dtype(dtype, by_dtype[dtype], world_size, reference)
            reference = reference or model.fits[dtype]
        for dtype in [d for d in DTYPES if d not in model.fits] if reference is not None else []:
            model.fits[dtype] = _fit_dtype(dtype, [], world_size, reference)
        for obs in measured:
            if by_dtype[obs.dtype]:  # a dtype borrowed whole from another: its miss is the prior's
                model.correct(obs)
        return model

    def refit(self, observations: Sequence[MemoryObservation]) -> MemoryModel:
        """:meth:`fit` on ``observations`` keeping this model's margin and correction count."""
        model = MemoryModel.fit(observations, world_size=self.world_size, safety_margin=self.safety_margin)
        model.corrections += self.corrections
        return model

    @property
    def can_shard(self) -> bool:
        """Whether a ``zero1`` share can be predicted (the optimizer state was measured)."""
        return self.optimizer_total is not None

    def optimizer_bytes(self, share: float | None) -> float:
        """``S * share`` (``S`` unsharded, ``share`` None); 0: ``S`` unknown (in the fixed part)."""
        if self.optimizer_total is None:
            return 0.0
        return self.optimizer_total * (1.0 if share is None else share)

    def is_fitted_for(self, dtype: str) -> bool:
        """True when ``dtype``'s own successful trials determine every parameter (no prior used)."""
        _check_dtype(dtype)
        return dtype in self.fits and self.fits[dtype].identified

    def can_predict(self, dtype: str) -> bool:
        """True when :meth:`predict` works for ``dtype`` (own data or another dtype's as prior)."""
        _check_dtype(dtype)
        return dtype in self.fits

    def predict(self, *, rank: int, micro_batch: int, checkpointed: int, num_layers: int,
                dtype: str, optimizer_share: float | None = None) -> float:
        """Predicted peak bytes of ``rank``, keeping ``optimizer_share`` of the optimizer state
        (None: all of it); never below :meth:`floor_bytes`."""
        raw = self.fitted_line(rank=rank, micro_batch=micro_batch, checkpointed=checkpointed,
                               num_layers=num_layers, dtype=dtype, optimizer_share=optimizer_share)
        return max(raw, self.floor_bytes(rank, optimizer_share))

    def fitted_line(self, *, rank: int, micro_batch: int, checkpointed: int, num_layers: int,
                    dtype: str, optimizer_share: float | None = None) -> float:
        """The fitted line's value, unclamped (may fall below the floor, even below zero)."""
        fit = self._fit(dtype)
        x = self._query(rank, micro_batch, checkpointed, num_layers)
        return float(x @ fit.theta) + self.optimizer_bytes(optimizer_share)

    def floor_bytes(self, rank: int, optimizer_share: float | None = None) -> float:
        """The least ``rank`` holds (:attr:`held_floor`) plus the optimizer state it keeps."""
        self._check_rank(rank)
        held = self.held_floor[rank] if rank < len(self.held_floor) else 0.0
        return held + self.optimizer_bytes(optimizer_share)

    def clamped(self, *, rank: int, micro_batch: int, checkpointed: int, num_layers: int,
                dtype: str, optimizer_share: float | None = None) -> bool:
        """True when that prediction is impossible as fitted (:func:`below_floor` of
        :meth:`floor_bytes`) or its per-sample term is negative."""
        raw = self.fitted_line(rank=rank, micro_batch=micro_batch, checkpointed=checkpointed,
                               num_layers=num_layers, dtype=dtype, optimizer_share=optimizer_share)
        if below_floor(raw, self.floor_bytes(rank, optimizer_share)):
            return True
        return micro_batch > 0 and self.per_sample_bytes(rank, dtype, checkpointed, num_layers) < 0

    def extrapolated(self, *, rank: int, micro_batch: int, checkpointed: int, num_layers: int, dtype: str) -> bool:
        """True when that prediction leans on the prior (not :meth:`is_confident`) or its
        micro-batch lies outside the dtype's own measured ones."""
        fit = self._fit(dtype)
        if fit.micro_range is None or not fit.micro_range[0] <= micro_batch <= fit.micro_range[1]:
            return True
        return not self.is_confident(rank=rank, micro_batch=micro_batch, checkpointed=checkpointed,
                                     num_layers=num_layers, dtype=dtype)

    def config_clamped(self, config: BalanceConfig, *, num_layers: int) -> bool:
        """:meth:`clamped` on any rank of ``config`` (its checkpoint counts, ``zero1`` shares)."""
        return any(self.clamped(**q) for q in self._config_queries(config, num_layers))

    def config_extrapolated(self, config: BalanceConfig, *, num_layers: int) -> bool:
        """:meth:`extrapolated` on any rank of ``config``."""
        return any(self.extrapolated(**{k: v for k, v in q.items() if k != "optimizer_share"})
                   for q in self._config_queries(config, num_layers))

    def _config_queries(self, config: BalanceConfig, num_layers: int) -> list[dict[str, Any]]:
        shares = config.sharding_shares()
        return [dict(rank=r, micro_batch=m, checkpointed=len(config.checkpoint[r]),
                     num_layers=num_layers, dtype=config.dtype,
                     optimizer_share=None if shares is None else shares[r])
                for r, m in enumerate(config.micro_batches)]

    def is_confident(self, *, rank: int, micro_batch: int, checkpointed: int, num_layers: int, dtype: str) -> bool:
        """True when that prediction depends on measured data only, not on the prior."""
        fit = self._fit(dtype)
        xs = self._query(rank, micro_batch, checkpointed, num_layers) / fit.scale
        if fit.unseen.shape[1] == 0:
            return True
        return float(np.linalg.norm(xs @ fit.unseen)) <= _CONFIDENT_TOL * max(float(np.linalg.norm(xs)), 1e-300)

    def fixed_bytes(self, rank: int, dtype: str, optimizer_share: float | None = None) -> float:
        """The part of ``rank``'s peak that does not scale with its micro-batch, keeping
        ``optimizer_share`` of the optimizer state (None: all of it, unsharded)."""
        self._check_rank(rank)
        return self._fit(dtype).fixed[rank] + self.optimizer_bytes(optimizer_share)

    def per_sample_bytes(self, rank: int, dtype: str, checkpointed: int, num_layers: int) -> float:
        """Bytes one more sample adds to ``rank``'s peak with ``checkpointed`` of ``num_layers``
        blocks checkpointed (the same on every rank: the model is replicated)."""
        self._check_rank(rank)
        _check_checkpointed(checkpointed, num_layers)
        fit = self._fit(dtype)
        return fit.act_full - fit.act_saved * checkpointed / num_layers

    def holdout_error(self, observations: Sequence[MemoryObservation]) -> float:
        """Mean relative error ``|predicted - measured| / measured`` over the successful
        observations given (trials the model was not fitted on); out-of-memory ones are skipped."""
        ok = [o for o in observations if o.ok]
        if not ok:
            raise UsageError("holdout_error got no successful observation; pass measured trials "
                             "that did not run out of memory.")
        return float(np.mean([abs(self._predict_obs(o) - o.peak_bytes) / o.peak_bytes for o in ok]))

    def correct(self, observation: MemoryObservation, *, limit: float | None = None) -> bool:
        """:func:`widen_margin` on this observation (an out-of-memory trial measured at least
        ``max(peak_bytes, limit)``); a dtype the model cannot predict yet changes nothing."""
        self._check_rank(observation.rank)
        if not self.can_predict(observation.dtype):
            return False
        predicted = self._predict_obs(observation)
        measured = observation.peak_bytes
        if not observation.ok and limit is not None:
            measured = max(measured, float(limit))
        return widen_margin(self, measured=measured, predicted=predicted, max_margin=self.max_margin)

    def _fit(self, dtype: str) -> DtypeFit:
        if not self.can_predict(dtype):
            raise UsageError(f"dtype={dtype!r} has no fitted memory model; measure at least one "
                             "successful trial first.")
        return self.fits[dtype]

    def _query(self, rank: int, micro_batch: int, checkpointed: int, num_layers: int) -> np.ndarray:
        self._check_rank(rank)
        if micro_batch < 0:
            raise UsageError(f"micro_batch={micro_batch} is negative; pass a sample count.")
        _check_checkpointed(checkpointed, num_layers)
        return _features(self.world_size, rank, micro_batch, checkpointed, num_layers)

    def _predict_obs(self, obs: MemoryObservation) -> float:
        base = self.predict(rank=obs.rank, micro_batch=obs.micro_batch,
                            checkpointed=obs.checkpointed, num_layers=obs.num_layers,
                            dtype=obs.dtype) - self.optimizer_bytes(None)
        if self.optimizer_total is None:
            return base
        # the state this rank measured (an OOM before the first step measured none: the model's S)
        return base + (obs.optimizer_bytes if obs.optimizer_bytes is not None else self.optimizer_total)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise UsageError(f"rank={rank} is outside 0..{self.world_size - 1}; the model was "
                             f"built for world_size={self.world_size}.")


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise UsageError(f"dtype={dtype!r} is unknown; use one of {', '.join(DTYPES)}.")


def _check_checkpointed(checkpointed: int, num_layers: int) -> None:
    if num_layers < 1:
        raise UsageError(f"num_layers={num_layers} is below 1; pass the model's block count.")
    if not 0 <= checkpointed <= num_layers:
        raise UsageError(f"checkpointed={checkpointed} is outside 0..{num_layers}; count checkpointed blocks.")


def _features(world_size: int, rank: int, micro_batch: int, checkpointed: int, num_layers: int) -> np.ndarray:
    """The linear features ``[one-hot(rank), mb, -mb * checkpointed / num_layers]``."""
    x = np.zeros(world_size + 2)
    x[rank] = 1.0
    x[world_size] = micro_batch
    x[world_size + 1] = -micro_batch * checkpointed / num_layers
    return x


def _design(observations: Sequence[MemoryObservation], world_size: int) -> tuple[np.ndarray, np.ndarray]:
    if not observations:
        return np.zeros((0, world_size + 2)), np.zeros(0)
    x = np.stack([_features(world_size, o.rank, o.micro_batch, o.checkpointed, o.num_layers)
                  for o in observations])
    return x, np.array([o.peak_bytes for o in observations])


def _column_scale(x: np.ndarray, world_size: int) -> np.ndarray:
    """Fixed parts in bytes (scale 1); per-sample terms times the largest micro-batch seen."""
    largest = float(np.max(np.abs(x[:, world_size]))) if len(x) else 1.0
    scale = np.ones(world_size + 2)
    scale[world_size:] = max(largest, 1.0)
    return scale


def _data_rank(observations: Sequence[MemoryObservation], world_size: int) -> int:
    x, _ = _design(observations, world_size)  # never empty: only dtypes with observations are ranked
    xs = x / _column_scale(x, world_size)
    return int(np.linalg.matrix_rank(xs, tol=_RANK_TOL * float(np.linalg.norm(xs, 2))))


def _least_squares(xs: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Minimum-norm least-squares solution and an orthonormal basis of the null space of ``xs``."""
    unknowns = xs.shape[1]
    if len(xs) == 0:
        return np.zeros(unknowns), np.eye(unknowns)
    u, s, vt = np.linalg.svd(xs, full_matrices=True)
    rank = int(np.sum(s > _RANK_TOL * s[0])) if s.size and s[0] > 0 else 0
    theta = vt[:rank].T @ ((u[:, :rank].T @ y) / s[:rank])
    return theta, vt[rank:].T


def _prior(dtype: str, world_size: int, reference: DtypeFit | None) -> tuple[np.ndarray, np.ndarray]:
    """Prior as linear relations ``A @ theta ~= b`` (theta in bytes per feature unit)."""
    unknowns = world_size + 2
    if reference is not None:
        ratio = ACTIVATION_BYTES_SCALE[dtype] / ACTIVATION_BYTES_SCALE[reference.dtype]
        b = reference.theta.copy()
        b[world_size:] *= ratio
        return np.eye(unknowns), b
    a = np.zeros((world_size + 1, unknowns))
    a[:world_size, :world_size] = np.eye(world_size) - 1.0 / world_size  # ranks alike
    a[world_size, world_size + 1] = 1.0  # act_saved = saving * act_full
    a[world_size, world_size] = -PRIOR_CHECKPOINT_SAVING
    return a, np.zeros(world_size + 1)


def _fit_dtype(dtype: str, observations: Sequence[MemoryObservation], world_size: int,
               reference: DtypeFit | None) -> DtypeFit:
    """The least-squares solution closest (in bytes-scaled coordinates) to the prior."""
    x, y = _design(observations, world_size)
    if len(x):
        scale = _column_scale(x, world_size)
    else:
        scale = reference.scale.copy() if reference is not None else np.ones(world_size + 2)
    theta_s, unseen = _least_squares(x / scale, y)
    used_reference = None
    if unseen.shape[1]:
        a, b = _prior(dtype, world_size, reference)
        row_scale = (np.abs(a) @ scale) / np.maximum(np.abs(a).sum(axis=1), 1e-300)
        a_s = (a / scale) * row_scale[:, None]
        z, *_ = np.linalg.lstsq(a_s @ unseen, b * row_scale - a_s @ theta_s, rcond=None)
        theta_s = theta_s + unseen @ z
        used_reference = reference.dtype if reference is not None else None
    theta = theta_s / scale
    micro = [o.micro_batch for o in observations]
    return DtypeFit(dtype=dtype, fixed=[float(v) for v in theta[:world_size]],
                    act_full=float(theta[world_size]), act_saved=float(theta[world_size + 1]),
                    n_observations=len(observations), identified=unseen.shape[1] == 0,
                    reference=used_reference, scale=scale, unseen=unseen,
                    micro_range=(min(micro), max(micro)) if micro else None)
