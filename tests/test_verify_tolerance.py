"""Verify's tolerance from a measured floor, and the runtime pieces that make the floor meaningful
(issue 29): in process, no runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autobalance._config import BalanceConfig
from autobalance.runtime._precision import already_unscaled, step_optimizer
from autobalance.runtime._sampler import epoch_schedule
from autobalance.runtime._verify import NoDropout, hold_full_precision
from autobalance.verify import (
    BOUND_MAX,
    BOUND_MIN,
    FLOOR_FACTOR,
    Check,
    bound_from_floor,
    floor_too_high,
    noise_problem,
    rounding_likely,
)


def _check(grad: float, param: float = 0.0, buffer: float = 0.0, update: float = 0.0,
           tolerance: tuple[float, float, float] | None = None, name: str = "floor") -> Check:
    return Check(name=name, runs=("a", "b"), grad_rel=grad, param_rel=param, update_rel=update, buffer_rel=buffer,
                 tolerance=tolerance, worst="")


def test_the_bound_is_twenty_times_the_floor_within_its_limits():
    """Fails if the formula of ``_tolerance``'s docstring is not what is applied: the H200 floor
    (1.5e-6 gradients, 2.1e-8 parameters) gives 3e-5 / 4.2e-7; a floor of 0 gives BOUND_MIN; a
    floor above BOUND_MAX / 20 is capped and reported."""
    g, p, b = bound_from_floor(_check(1.5e-6, 2.1e-8, 0.0))
    assert g == pytest.approx(3.0e-5) and p == pytest.approx(BOUND_MIN) and b == BOUND_MIN
    assert bound_from_floor(_check(0.0))[0] == BOUND_MIN
    assert bound_from_floor(_check(1e-3))[0] == BOUND_MAX
    assert not floor_too_high(_check(BOUND_MAX / FLOOR_FACTOR))
    assert floor_too_high(_check(1.01 * BOUND_MAX / FLOOR_FACTOR))


def test_measured_gpu_figures_pass_and_a_1e3_reweighting_fails():
    """The H200 measurements of benchmarks/2026-12-03-h200/verify_floor.json against the rule: every
    correct arrangement (1.1-3.1e-6) passes with at least 9x to spare; the 1e-3 reweighting of one
    micro-batch (7.1e-4) fails and is not called rounding."""
    floor = _check(1.53e-6, 2.11e-8)
    bound = bound_from_floor(floor)
    for grad, param in ((1.06e-6, 1.5e-8), (2.87e-6, 4.7e-8), (3.15e-6, 4.9e-8), (2.69e-6, 4.5e-8)):
        check = _check(grad, param, tolerance=bound, name="equivalence")
        assert check.passed and bound[0] / grad >= 9
    wrong = _check(7.07e-4, 6.4e-6, tolerance=bound, name="equivalence")
    assert not wrong.passed and not rounding_likely(wrong, floor)
    near = _check(5e-5, 3e-8, tolerance=bound, name="equivalence")  # 33x the floor: rounding is likely
    assert not near.passed and rounding_likely(near, floor)


def test_a_baseline_error_above_the_limits_is_not_rounding():
    assert noise_problem(_check(4.6e-3, update=0.1)) is None  # bf16 on the H200 GPT
    assert "gradients are 1.0e+00" in (noise_problem(_check(1.0)) or "")
    assert "update" in (noise_problem(_check(1e-3, update=0.99)) or "")


def test_functional_dropout_is_held_at_zero_and_counted():
    """Fails if NoDropout leaves F.dropout or the dropout_p of scaled_dot_product_attention on, in
    positional or keyword form, or does not count the calls that asked for it."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    q = torch.randn(1, 2, 4, 8)
    mode = NoDropout()
    with mode:
        assert torch.equal(F.dropout(x, 0.5, True), x)
        assert torch.equal(F.dropout(x, p=0.5, training=True), x)
        assert torch.equal(nn.Dropout(0.5).train()(x), x)
        out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.9)
        assert torch.equal(F.dropout(x, 0.0, True), x)
    assert mode.seen == 4
    assert torch.allclose(out, F.scaled_dot_product_attention(q, q, q))
    assert not torch.equal(F.dropout(x, 0.5, True), x)  # outside the mode: dropout again


def test_full_precision_is_held_and_the_script_setting_reported():
    matmul = torch.backends.cuda.matmul
    before = (matmul.allow_tf32, torch.get_float32_matmul_precision())
    try:
        matmul.allow_tf32 = True
        was = hold_full_precision()
        assert was["tf32_matmul"] is True and matmul.allow_tf32 is False
        assert torch.get_float32_matmul_precision() == "highest"
        assert hold_full_precision()["tf32_matmul"] is False
    finally:
        matmul.allow_tf32 = before[0]
        torch.set_float32_matmul_precision(before[1])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_only_fp32_runs_hold_full_precision(dtype, tmp_path):
    """An fp32 verification run holds TF32 off (and reports the script's setting); a bf16 run keeps
    the script's settings, as the trial it verifies ran (its compile then hits the study's cache)."""
    from types import SimpleNamespace

    from autobalance.runtime._verify import VerifyRun

    matmul = torch.backends.cuda.matmul
    before = (matmul.allow_tf32, torch.get_float32_matmul_precision())
    config = BalanceConfig(micro_batches=[4], accumulation=1, global_batch=4, dtype=dtype)
    run = VerifyRun(trial_dir=str(tmp_path), dropout="off", init=None)
    plan = SimpleNamespace(config=config, rank=0, model=None)
    try:
        matmul.allow_tf32 = True
        run.on_wrap(plan, nn.Linear(2, 2))  # type: ignore[arg-type]
        run.on_step_start(plan)  # type: ignore[arg-type]
        assert matmul.allow_tf32 is (dtype != "fp32")
        assert run.script_precision == ({"tf32_matmul": True} if dtype == "fp32" else {})
    finally:
        matmul.allow_tf32 = before[0]
        torch.set_float32_matmul_precision(before[1])


def test_gradients_the_script_unscaled_are_not_unscaled_again():
    """PyTorch's AMP recipe (scaler.unscale_, clip, then plan.optimizer_step(clip_grad_norm=...)):
    the second unscale would raise; the scaler's stage says the gradients are at scale 1."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    assert not already_unscaled(scaler, opt)
    scaler.unscale_(opt)
    assert already_unscaled(scaler, opt)
    step_optimizer(opt, scaler=scaler, clip_grad_norm=1.0)  # no "unscale_() has already been called"
    assert not already_unscaled(scaler, opt)


def test_a_floor_run_takes_the_same_samples_in_reverse_order():
    config = BalanceConfig(micro_batches=[3, 5], global_batch=16, accumulation=2)
    plain = epoch_schedule(num_samples=64, config=config, epoch=0, seed=3)
    rev = epoch_schedule(num_samples=64, config=config, epoch=0, seed=3, reverse_within=True)
    for a, b in zip(plain.steps, rev.steps, strict=True):
        assert [[mb[::-1] for mb in rank] for rank in a.micro_batches] == b.micro_batches


def test_a_warm_worker_puts_the_precision_flags_back_between_runs():
    """A verification run's full fp32 precision must not carry over to the next run in the same warm
    worker (a bf16 compiled run would then miss the study's Inductor cache: the flags are in its key)."""
    from autobalance.runtime._verify import precision_flags, restore_precision_flags

    matmul = torch.backends.cuda.matmul
    before = precision_flags()
    try:
        matmul.allow_bf16_reduced_precision_reduction = True
        snapshot = precision_flags()
        hold_full_precision()
        assert matmul.allow_bf16_reduced_precision_reduction is False
        assert precision_flags() != snapshot
        restore_precision_flags(snapshot)
        assert precision_flags() == snapshot
    finally:
        restore_precision_flags(before)
