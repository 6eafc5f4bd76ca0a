"""The per-rank peak-memory model: exact fits, priors, confidence, hold-out error, margin correction."""

from __future__ import annotations

import random

import pytest

from autobalance._errors import UsageError
from autobalance.tuner.search import (
    DEFAULT_SAFETY_MARGIN,
    MemoryModel,
    MemoryObservation,
)

GIB = 2**30
LAYERS = 12
WORLD = 3

# Ground truth: rank 0 carries a 4 GiB extra (e.g. an EMA copy or an eval buffer).
FIXED: dict[str, list[float]] = {
    "fp32": [10 * GIB, 6 * GIB, 6 * GIB],
    "bf16": [10.5 * GIB, 6.5 * GIB, 6.5 * GIB],
}
FULL = {"fp32": 0.8 * GIB, "bf16": 0.42 * GIB}
SAVED = {"fp32": 0.56 * GIB, "bf16": 0.3 * GIB}


def true_peak(rank: int, mb: int, ckpt: int, dtype: str) -> float:
    return FIXED[dtype][rank] + mb * (FULL[dtype] - SAVED[dtype] * ckpt / LAYERS)


def obs(
    rank: int, mb: int, ckpt: int, dtype: str = "fp32", *, ok: bool = True, scale: float = 1.0
) -> MemoryObservation:
    return MemoryObservation(
        rank=rank,
        micro_batch=mb,
        checkpointed=ckpt,
        num_layers=LAYERS,
        dtype=dtype,
        peak_bytes=true_peak(rank, mb, ckpt, dtype) * scale,
        ok=ok,
    )


def trials(n: int, dtype: str, seed: int) -> list[MemoryObservation]:
    """``n`` random trials, one observation per rank each."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        for rank in range(WORLD):
            out.append(obs(rank, rng.randint(1, 12), rng.randint(0, LAYERS), dtype))
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_exact_fit_with_rank0_extra() -> None:
    model = MemoryModel.fit(trials(4, "fp32", seed=1), world_size=WORLD)
    assert model.is_fitted_for("fp32")
    assert rel(model.fixed_bytes(0, "fp32"), 10 * GIB) < 1e-9
    assert rel(model.fixed_bytes(1, "fp32"), 6 * GIB) < 1e-9
    assert rel(model.fixed_bytes(0, "fp32") - model.fixed_bytes(2, "fp32"), 4 * GIB) < 1e-9
    assert rel(model.per_sample_bytes(1, "fp32", 0, LAYERS), 0.8 * GIB) < 1e-9
    assert rel(model.per_sample_bytes(1, "fp32", LAYERS, LAYERS), 0.24 * GIB) < 1e-9
    for o in trials(10, "fp32", seed=99):  # unseen configurations
        predicted = model.predict(
            rank=o.rank,
            micro_batch=o.micro_batch,
            checkpointed=o.checkpointed,
            num_layers=LAYERS,
            dtype="fp32",
        )
        assert rel(predicted, o.peak_bytes) < 1e-9
        assert model.is_confident(
            rank=o.rank,
            micro_batch=o.micro_batch,
            checkpointed=o.checkpointed,
            num_layers=LAYERS,
            dtype="fp32",
        )
    assert model.safety_margin == DEFAULT_SAFETY_MARGIN  # exact data: no correction
    assert model.corrections == 0


def test_holdout_error_reported() -> None:
    model = MemoryModel.fit(trials(4, "fp32", seed=2), world_size=WORLD)
    assert model.holdout_error(trials(5, "fp32", seed=3)) < 1e-9
    # A held-out set measured 10 % above the truth reads as a 10 %/1.1 relative error.
    noisy = [
        obs(o.rank, o.micro_batch, o.checkpointed, scale=1.1) for o in trials(5, "fp32", seed=4)
    ]
    assert model.holdout_error(noisy) == pytest.approx(0.1 / 1.1, rel=1e-6)
    # Out-of-memory points are lower bounds: skipped.
    mixed = [*trials(2, "fp32", seed=5), obs(0, 12, 0, ok=False, scale=3.0)]
    assert model.holdout_error(mixed) < 1e-9
    with pytest.raises(UsageError, match="no successful observation"):
        model.holdout_error([obs(0, 12, 0, ok=False)])


def test_noisy_fit_is_least_squares() -> None:
    rng = random.Random(7)
    data = [
        obs(o.rank, o.micro_batch, o.checkpointed, scale=1 + rng.uniform(-0.01, 0.01))
        for o in trials(20, "fp32", seed=6)
    ]
    model = MemoryModel.fit(data, world_size=WORLD)
    assert model.holdout_error(trials(10, "fp32", seed=8)) < 0.01
    assert model.safety_margin <= 0.05  # 1 % noise leaves the default margin alone


def test_oom_observation_not_fitted_as_equality() -> None:
    good = trials(4, "fp32", seed=9)
    oom = obs(0, 12, 0, ok=False, scale=0.5)  # a lower bound well below the truth
    model = MemoryModel.fit([*good, oom], world_size=WORLD)
    assert (
        rel(
            model.predict(rank=0, micro_batch=12, checkpointed=0, num_layers=LAYERS, dtype="fp32"),
            true_peak(0, 12, 0, "fp32"),
        )
        < 1e-9
    )
    assert model.safety_margin == DEFAULT_SAFETY_MARGIN


def test_prior_for_dtype_with_too_few_points() -> None:
    data = [*trials(4, "fp32", seed=10), obs(0, 4, 0, "bf16"), obs(1, 4, 0, "bf16")]
    model = MemoryModel.fit(data, world_size=WORLD)
    assert model.is_fitted_for("fp32")
    assert not model.is_fitted_for("bf16")
    assert model.can_predict("bf16") and model.can_predict("fp16")
    assert model.fits["bf16"].reference == "fp32"
    # The measured bf16 points are reproduced exactly and count as confident.
    for rank in (0, 1):
        assert (
            rel(
                model.predict(
                    rank=rank, micro_batch=4, checkpointed=0, num_layers=LAYERS, dtype="bf16"
                ),
                true_peak(rank, 4, 0, "bf16"),
            )
            < 1e-9
        )
        assert model.is_confident(
            rank=rank, micro_batch=4, checkpointed=0, num_layers=LAYERS, dtype="bf16"
        )
    # Elsewhere the prior fills in: close (the true bf16 ratio is 0.52-0.54, the prior says 0.5), low confidence.
    query = dict(rank=2, micro_batch=8, checkpointed=6, num_layers=LAYERS, dtype="bf16")
    assert not model.is_confident(**query)  # type: ignore[arg-type]
    assert rel(model.predict(**query), true_peak(2, 8, 6, "bf16")) < 0.05  # type: ignore[arg-type]
    # A dtype never measured: fp32 fixed part, per-sample terms scaled by 0.5.
    assert model.fits["fp16"].n_observations == 0
    assert model.fixed_bytes(0, "fp16") == pytest.approx(model.fixed_bytes(0, "fp32"))
    assert model.per_sample_bytes(0, "fp16", 3, LAYERS) == pytest.approx(
        0.5 * model.per_sample_bytes(0, "fp32", 3, LAYERS)
    )
    assert not model.is_confident(
        rank=0, micro_batch=1, checkpointed=0, num_layers=LAYERS, dtype="fp16"
    )


def test_generic_prior_without_checkpoint_variation() -> None:
    data = [obs(r, mb, 0) for mb in (2, 5) for r in range(WORLD)]
    model = MemoryModel.fit(data, world_size=WORLD)
    assert not model.is_fitted_for("fp32")  # act_saved is not observable
    assert rel(model.per_sample_bytes(0, "fp32", 0, LAYERS), 0.8 * GIB) < 1e-9
    assert model.per_sample_bytes(0, "fp32", LAYERS, LAYERS) == pytest.approx(0.3 * 0.8 * GIB)
    assert model.is_confident(
        rank=0, micro_batch=9, checkpointed=0, num_layers=LAYERS, dtype="fp32"
    )
    assert not model.is_confident(
        rank=0, micro_batch=9, checkpointed=2, num_layers=LAYERS, dtype="fp32"
    )


def test_bf16_fitted_on_its_own_when_it_has_enough_points() -> None:
    model = MemoryModel.fit(
        [*trials(4, "fp32", seed=11), *trials(4, "bf16", seed=12)], world_size=WORLD
    )
    assert model.is_fitted_for("bf16")
    assert model.holdout_error(trials(5, "bf16", seed=13)) < 1e-9


def test_oom_widens_margin() -> None:
    """Fails if the widen factor is not 1.5 (the expected margin 0.3 is a literal, not the
    implementation's default), if an OOM does not widen the margin, or if it can exceed max_margin."""
    model = MemoryModel.fit(trials(4, "fp32", seed=14), world_size=WORLD)
    predicted = model.predict(
        rank=0, micro_batch=6, checkpointed=0, num_layers=LAYERS, dtype="fp32"
    )
    # A predicted-feasible run (predicted 20 % under its limit) ran out of memory at the limit.
    limit = predicted * 1.2
    oom = MemoryObservation(
        rank=0,
        micro_batch=6,
        checkpointed=0,
        num_layers=LAYERS,
        dtype="fp32",
        peak_bytes=0.9 * limit,
        ok=False,
    )
    assert model.correct(oom, limit=limit)
    # predicted 20 % under the limit, yet out of memory at it: the margin widens to 0.3 (1.5 x the miss)
    assert model.safety_margin == pytest.approx(0.3)
    assert model.corrections == 1
    # The same evidence again changes nothing; the margin never exceeds max_margin.
    assert not model.correct(oom, limit=limit)
    assert model.correct(obs(0, 6, 0, ok=False, scale=3.0))
    assert model.safety_margin == model.max_margin
    # Refitting keeps the margin and the count.
    refit = model.refit(trials(4, "fp32", seed=14))
    assert refit.safety_margin == model.max_margin and refit.corrections == 2


def test_underprediction_beyond_margin_widens_overprediction_does_not() -> None:
    model = MemoryModel.fit(trials(4, "fp32", seed=15), world_size=WORLD)
    assert not model.correct(obs(1, 3, 2, scale=1.03))  # within the 5 % margin
    assert not model.correct(obs(1, 3, 2, scale=0.7))  # over-predicted: the refit handles it
    assert model.correct(obs(1, 3, 2, scale=1.1))
    assert model.safety_margin == pytest.approx(0.15)


def test_fit_applies_oom_evidence() -> None:
    data = [*trials(4, "fp32", seed=16), obs(2, 10, 0, ok=False, scale=1.2)]
    model = MemoryModel.fit(data, world_size=WORLD)
    assert model.safety_margin == pytest.approx(0.3)
    assert model.corrections == 1


def test_usage_errors() -> None:
    with pytest.raises(UsageError, match="checkpointed=13"):
        obs(0, 1, 13)
    with pytest.raises(UsageError, match="dtype='fp8'"):
        MemoryObservation(
            rank=0, micro_batch=1, checkpointed=0, num_layers=2, dtype="fp8", peak_bytes=1.0
        )
    with pytest.raises(UsageError, match="micro_batch=0"):
        MemoryObservation(
            rank=0, micro_batch=0, checkpointed=0, num_layers=2, dtype="fp32", peak_bytes=1.0
        )
    with pytest.raises(UsageError, match="rank=3"):
        MemoryModel.fit(
            [
                obs(0, 1, 0),
                MemoryObservation(
                    rank=3,
                    micro_batch=1,
                    checkpointed=0,
                    num_layers=LAYERS,
                    dtype="fp32",
                    peak_bytes=1.0,
                ),
            ],
            world_size=WORLD,
        )
    empty = MemoryModel.fit([], world_size=WORLD)
    assert not empty.can_predict("fp32")
    with pytest.raises(UsageError, match="no fitted memory model"):
        empty.predict(rank=0, micro_batch=1, checkpointed=0, num_layers=LAYERS, dtype="fp32")
    assert not empty.correct(obs(0, 1, 0, ok=False))
