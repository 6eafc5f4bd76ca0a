"""The smart search's step-time model: fixed costs per step and per micro-step, per-sample cost per
dtype, recomputation cost; fitted from trials (fast)."""

from __future__ import annotations

import itertools

import optuna
import pytest

from autobalance import BalanceConfig
from autobalance.tuner.search import StepTimeModel

LAYERS = 8


def truth(cfg: BalanceConfig) -> float:
    """a = 4 ms per step, b = 20 ms per micro-step, k = 1.5 (bf16) / 3 (fp32) ms per sample, g = 12 ms
    to recompute all blocks."""
    k = {"bf16": 1.5, "fp32": 3.0}[cfg.dtype]
    micro = max(20 + k * m + 12 * len(c) / LAYERS for m, c in zip(cfg.micro_batches, cfg.checkpoint, strict=True))
    return 4 + cfg.accumulation * micro


def trial(cfg: BalanceConfig, ms: float) -> optuna.trial.FrozenTrial:
    return optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=1.0,
                                     user_attrs={"status": "ok", "config": cfg.to_dict(), "step_time_ms": ms})


def configs(dtypes: tuple[str, ...], *, ckpt: bool = True) -> list[BalanceConfig]:
    out = []
    for dtype, acc, m0, c0 in itertools.product(dtypes, (1, 2), (3, 6), (0, 4) if ckpt else (0,)):
        total = 16 // acc
        out.append(BalanceConfig(micro_batches=[m0, total - m0], accumulation=acc, global_batch=16, dtype=dtype,
                                 checkpoint=[list(range(c0)), []]))
    return out


def test_recovers_fixed_per_sample_and_recompute_costs():
    seen = configs(("bf16", "fp32"))
    model = StepTimeModel.fit([trial(c, truth(c)) for c in seen], num_layers=LAYERS, device="cuda")
    assert model.a == pytest.approx(4, abs=0.05) and model.b == pytest.approx(20, rel=1e-3)
    assert model.k == pytest.approx({"bf16": 1.5, "fp32": 3.0}, rel=1e-3)
    assert model.g == pytest.approx(12, rel=1e-3)
    unseen = BalanceConfig(micro_batches=[5, 11], global_batch=16, dtype="bf16", checkpoint=[[0, 1], [0]])
    assert model.predict(unseen) == pytest.approx(truth(unseen), rel=1e-3)
    # the solver's proxy: recomputing all blocks = g / (k * typical micro-batch) of a micro-step's compute
    assert model.rho == pytest.approx(12 / (1.5 * model.typical_micro_batch), rel=1e-3)


def test_few_trials_fall_back_to_the_proportional_form_and_unseen_dtypes_use_the_prior():
    few = configs(("bf16",))[:3]
    model = StepTimeModel.fit([trial(c, truth(c)) for c in few], num_layers=LAYERS, device="cuda")
    assert model.a == model.b == 0.0 and model.k["bf16"] > 0
    fp16 = BalanceConfig(micro_batches=[8, 8], global_batch=16, dtype="fp16")
    bf16 = BalanceConfig(micro_batches=[8, 8], global_batch=16, dtype="bf16")
    assert model.predict(fp16) == pytest.approx(model.predict(bf16))  # same speed prior on CUDA
    fp32 = BalanceConfig(micro_batches=[8, 8], global_batch=16, dtype="fp32")
    assert model.predict(fp32) == pytest.approx(model.predict(bf16) / 0.55)
    assert StepTimeModel.fit([], num_layers=LAYERS, device="cuda").predict(bf16) is None


def test_without_checkpointing_data_the_recompute_cost_is_the_prior():
    """Fails if RECOMPUTE_PRIOR changes from one micro-step (the expected 28.4 ms is derived by
    hand below, not from the implementation's constant)."""
    extra = BalanceConfig(micro_batches=[2, 6], accumulation=2, global_batch=16, dtype="bf16")
    seen = [*configs(("bf16",), ckpt=False), extra]
    model = StepTimeModel.fit([trial(c, truth(c)) for c in seen], num_layers=LAYERS, device="cuda")
    # Without checkpointing in the data, recomputing every block is priced as one micro-step at the
    # typical micro-batch: the mean per-rank micro-batch of the five trials is (8 + 8 + 4 + 4 + 4) / 5
    # = 5.6, so g = b + k * 5.6 = 20 + 1.5 * 5.6 = 28.4 ms. Fails if the prior changes silently.
    assert model.typical_micro_batch == pytest.approx(5.6)
    assert model.g == pytest.approx(28.4, rel=2e-3)
    cfg = BalanceConfig(micro_batches=[7, 9], global_batch=16, dtype="bf16")
    assert model.predict(cfg) == pytest.approx(truth(cfg), rel=0.02)


def sharded(cfg: BalanceConfig, mode: str) -> BalanceConfig:
    return BalanceConfig.from_dict({**cfg.to_dict(), "param_sharding": mode})


def test_a_sharding_costs_its_prior_until_measured_then_its_measured_ratio_and_stays_out_of_the_fit():
    from autobalance.tuner.search._constants import SHARDING_TIME_PRIOR

    seen = configs(("bf16", "fp32"))
    probe = BalanceConfig(micro_batches=[5, 11], global_batch=16, dtype="bf16", checkpoint=[[0, 1], [0]])
    model = StepTimeModel.fit([trial(c, truth(c)) for c in seen], num_layers=LAYERS, device="cuda")
    for mode in ("embeddings", "blocks"):  # not measured: the H200's ratio
        assert model.predict(sharded(probe, mode)) == pytest.approx(truth(probe) * SHARDING_TIME_PRIOR[mode], rel=1e-3)
    # two embeddings-sharded trials at 1.2x their unsharded truth: learned, and the unsharded terms unchanged
    slow = [trial(sharded(c, "embeddings"), 1.2 * truth(c)) for c in seen[:2]]
    learned = StepTimeModel.fit([trial(c, truth(c)) for c in seen] + slow, num_layers=LAYERS, device="cuda")
    assert learned.predict(sharded(probe, "embeddings")) == pytest.approx(1.2 * truth(probe), rel=1e-3)
    assert learned.predict(probe) == pytest.approx(truth(probe), rel=1e-3)
    assert learned.predict(sharded(probe, "blocks")) == pytest.approx(truth(probe) * SHARDING_TIME_PRIOR["blocks"],
                                                                      rel=1e-3)


def test_only_sharded_trials_still_give_a_model_through_the_prior():
    from autobalance.tuner.search._constants import SHARDING_TIME_PRIOR

    seen = configs(("bf16",))
    f = SHARDING_TIME_PRIOR["embeddings"]
    model = StepTimeModel.fit([trial(sharded(c, "embeddings"), f * truth(c)) for c in seen], num_layers=LAYERS,
                              device="cuda")
    probe = BalanceConfig(micro_batches=[5, 11], global_batch=16, dtype="bf16", checkpoint=[[0, 1], [0]])
    assert model.predict(sharded(probe, "embeddings")) == pytest.approx(f * truth(probe), rel=1e-3)
    assert model.predict(probe) == pytest.approx(truth(probe), rel=1e-3)
