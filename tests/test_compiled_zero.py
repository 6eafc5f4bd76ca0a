"""Uneven ZeRO-1 in the compiled model and its proposals (issue 34), on a synthetic study whose truth is
known: rank 0 holds extras, the optimizer state ``S`` is measured, the budget curve is stepwise.

The compiled peak is ``fixed_r(q) + m * act_r * f(b)`` with ``fixed_r(q) = fixed_r + S * q`` (``q = 1``
unsharded); every expected figure here is computed from that formula and the truth below, not from
the model."""

from __future__ import annotations

import dataclasses

import optuna
import pytest
from optuna.trial import TrialState

from autobalance import BalanceConfig
from autobalance.tuner import SearchSpace
from autobalance.tuner.search import (
    CompiledMemoryModel,
    CompiledTimeModel,
    MemoryModel,
    StepTimeModel,
    compiled_observations,
    observations_from_trials,
)
from autobalance.tuner.search._dominance import dominating_over_cap
from autobalance.tuner.search._models import _splits, compiled_candidates

GIB = 2**30
LAYERS = 4
FIXED = [2.0, 1.0]  # GiB without the optimizer state: rank 0 holds 1 GiB of extras
STATE = 2.0  # GiB: the whole optimizer state S
ACT = 0.25  # GiB per sample, eager, no checkpointing
SAVED = 0.15  # GiB per sample saved by checkpointing every block
MEASURED_CAP = 10.0  # GiB: what the synthetic trials ran under (none of them over it)


def f_true(budget: float) -> float:
    """A stepwise fraction of the eager activations the partitioner keeps."""
    return 0.3 if budget < 0.35 else (0.55 if budget < 0.7 else 0.9)


def shares_of(cfg: BalanceConfig) -> list[float]:
    return cfg.sharding_shares() or [1.0] * cfg.world_size


def true_peak(cfg: BalanceConfig, rank: int) -> float:
    """GiB: eager ``fixed_r + S*q_r + m*(ACT - SAVED*c/L)``, compiled ``fixed_r + S*q_r + m*ACT*f(b)``."""
    m, q = cfg.micro_batches[rank], shares_of(cfg)[rank]
    if cfg.compile == "off":
        return FIXED[rank] + STATE * q + m * (ACT - SAVED * len(cfg.checkpoint[rank]) / LAYERS)
    return FIXED[rank] + STATE * q + m * ACT * f_true((cfg.activation_budget or [1.0, 1.0])[rank])


def step_ms(cfg: BalanceConfig) -> float:
    budgets = cfg.activation_budget or [1.0, 1.0]
    if cfg.compile == "off":
        return 5 + max(cfg.accumulation * (10 + 8 * len(c) / LAYERS) + n
                       for n, c in zip(cfg.samples_per_rank, cfg.checkpoint, strict=True))
    return 5 + 0.8 * max((cfg.accumulation * 10 + n) * (1 + 0.5 * (1 - b))
                         for n, b in zip(cfg.samples_per_rank, budgets, strict=True))


def trial(cfg: BalanceConfig, *, status: str = "ok", failing_rank: int | None = None,
          peaks: list[float | None] | None = None) -> optuna.trial.FrozenTrial:
    world = cfg.world_size
    if peaks is None:
        peaks = [true_peak(cfg, r) for r in range(world)]
    attrs = {"status": status, "config": cfg.to_dict(), "peak_device_gib": peaks,
             "usable_gib": [MEASURED_CAP] * world, "capacity_gib": [MEASURED_CAP] * world,
             "optimizer_state_bytes": [int(STATE * q * GIB) for q in shares_of(cfg)]}
    if status == "ok":
        attrs["step_time_ms"] = step_ms(cfg)
    if failing_rank is not None:
        attrs["failing_rank"] = failing_rank
    return optuna.trial.create_trial(state=TrialState.COMPLETE, value=1.0, user_attrs=attrs)


def eager(micro: list[int], ckpt: tuple[int, int] = (0, 0), acc: int = 1) -> BalanceConfig:
    return BalanceConfig(micro_batches=micro, accumulation=acc, global_batch=32, dtype="fp32", bucket_cap_mb=25.0,
                         gradient_as_bucket_view=True, checkpoint=[list(range(c)) for c in ckpt])


def compiled(micro: list[int], budgets: list[float], acc: int = 1, shares: list[float] | None = None,
             zero: bool = False) -> BalanceConfig:
    return BalanceConfig(micro_batches=micro, accumulation=acc, global_batch=sum(micro) * acc, dtype="fp32",
                         bucket_cap_mb=25.0, gradient_as_bucket_view=True, compile="default",
                         activation_budget=budgets, optimizer_sharding="zero1" if zero or shares else "off",
                         optimizer_shares=shares)


EAGER = [eager([8, 8], acc=2), eager([6, 10], acc=2), eager([4, 4], (4, 0), acc=4), eager([16, 16], (4, 4)),
         eager([2, 2], (0, 2), acc=8)]
"""Eager trials (unsharded, state measured) that determine the eager model."""
COMPILED = [compiled([16, 16], [0.3, 0.3]), compiled([16, 16], [0.6, 0.6]), compiled([8, 8], [1.0, 1.0], acc=2)]
"""Unsharded compiled trials measuring the curve at 0.3, 0.6 and 1.0."""


def models(trials: list[optuna.trial.FrozenTrial]) -> tuple[CompiledMemoryModel, CompiledTimeModel, StepTimeModel]:
    memory = MemoryModel.fit(observations_from_trials(trials, num_layers=LAYERS), world_size=2)
    timing = StepTimeModel.fit(trials, num_layers=LAYERS, device="cuda")
    return (CompiledMemoryModel.fit(compiled_observations(trials), eager=memory, num_layers=LAYERS),
            CompiledTimeModel.fit(trials, eager=timing, device="cuda"), timing)


def space(shardings: list[str]) -> SearchSpace:
    s = SearchSpace.build(world_size=2, global_batch=32, num_layers=LAYERS, dtypes=["fp32"], max_accumulation=8,
                          compile_modes=["default"])
    s.shardings = shardings
    return s


def candidates(shardings: list[str], usable_gib: float, trials: list[optuna.trial.FrozenTrial]):
    memory, timing, eager_timing = models(trials)
    return memory, compiled_candidates(
        space=space(shardings), trials=trials, memory=memory, timing=timing, eager_timing=eager_timing,
        usable=[usable_gib * GIB] * 2, bucket=25.0, view=True, max_spread=None,
        score=lambda cfg, peaks, ms: ms)


# ------------------------------------------------------------------------------------------ the model


def test_a_zero1_observation_gives_the_fraction_of_its_unsharded_twin():
    trials = [trial(c) for c in EAGER]
    memory, _, _ = models(trials)
    assert memory.eager.can_shard and memory.eager.optimizer_total == pytest.approx(STATE * GIB, rel=1e-6)
    twin = [trial(compiled([16, 16], [0.6, 0.6])), trial(compiled([16, 16], [0.6, 0.6], shares=[0.25, 0.75]))]
    off, zero = compiled_observations(twin[:1]), compiled_observations(twin[1:])
    assert [o.optimizer_share for o in off] == [None, None]
    assert [o.optimizer_share for o in zero] == [0.25, 0.75]
    for a, b in zip(off, zero, strict=True):
        assert a.peak_bytes - b.peak_bytes == pytest.approx(STATE * (1 - b.optimizer_share) * GIB)  # measured less
        assert memory.fraction(a) == pytest.approx(f_true(0.6), rel=1e-6)
        assert memory.fraction(b) == pytest.approx(f_true(0.6), rel=1e-6)
        # read as unsharded, the zero1 point would be low by S * (1 - q) / (m * act)
        wrong = memory.fraction(dataclasses.replace(b, optimizer_share=None))
        assert f_true(0.6) - wrong == pytest.approx(STATE * (1 - b.optimizer_share) / (16 * ACT), rel=1e-6)
    # fitted from the zero1 trial alone, it predicts the unsharded twin's measured peaks
    fitted = CompiledMemoryModel.fit(zero, eager=memory.eager, num_layers=LAYERS)
    assert fitted.holdout_error(off) == pytest.approx(0.0, abs=1e-9)
    assert fitted.holdout_error(zero) == pytest.approx(0.0, abs=1e-9)
    assert not fitted.correct(zero[0]) and fitted.corrections == 0  # exact: no widening


def test_config_peaks_of_a_zero1_config_hold_each_ranks_share_of_the_state():
    trials = [trial(c) for c in EAGER + COMPILED]
    memory, _, _ = models(trials)
    shares = [0.1, 0.9]
    off, zero = compiled([12, 20], [0.6, 0.3]), compiled([12, 20], [0.6, 0.3], shares=shares)
    peaks_off, peaks_zero = memory.config_peaks(off), memory.config_peaks(zero)
    for r, (m, b, q) in enumerate(zip([12, 20], [0.6, 0.3], shares, strict=True)):
        assert peaks_zero[r] / GIB == pytest.approx(FIXED[r] + STATE * q + m * ACT * f_true(b), rel=1e-6)
        assert (peaks_off[r] - peaks_zero[r]) / GIB == pytest.approx(STATE * (1 - q), rel=1e-6)
        assert memory.predict(rank=r, micro_batch=m, budget=b, dtype="fp32", mode="default",
                              optimizer_share=q) == pytest.approx(peaks_zero[r])
    even = memory.config_peaks(compiled([12, 20], [0.6, 0.3], zero=True))  # zero1 without shares: even
    assert (peaks_off[0] - even[0]) / GIB == pytest.approx(STATE * 0.5, rel=1e-6)
    # the veto's bounds follow the share too: rank 0 at micro-batch 24, budget 0.6, under a 5 GiB limit
    limit = 5.0 * GIB
    assert memory.surely_over(rank=0, micro_batch=24, budget=0.6, dtype="fp32", mode="default", limit=limit)
    low = 2.0 + 0.1 * STATE + 24 * ACT * f_true(0.6)  # 5.5 GiB: still over with 10 % of the state
    assert memory.surely_over(rank=0, micro_batch=24, budget=0.6, dtype="fp32", mode="default", limit=limit,
                              optimizer_share=0.1) == pytest.approx(low * GIB)
    assert memory.surely_over(rank=0, micro_batch=16, budget=0.6, dtype="fp32", mode="default", limit=limit,
                              optimizer_share=0.1) is None  # 2.2 + 2.2 = 4.4 GiB
    assert memory.over_at_any_budget(rank=0, micro_batch=8, dtype="fp32", mode="default", limit=4.0 * GIB)
    assert memory.over_at_any_budget(rank=0, micro_batch=8, dtype="fp32", mode="default", limit=4.0 * GIB,
                                     optimizer_share=0.0) is None


# ------------------------------------------------------------------------------------------ proposals


def test_under_a_cap_rank_0_cannot_meet_unsharded_zero1_is_proposed_with_the_least_state_on_rank_0():
    """Usable 4.2 GiB: rank 0's unsharded fixed part (2 + 2 GiB) times the 5 % margin is already 4.2 GiB,
    so no budget fits it unsharded; zero1 moves state to rank 1."""
    usable = 4.2
    trials = [trial(c) for c in EAGER + COMPILED]
    memory, found = candidates(["off", "zero1"], usable, trials)
    assert found and all(c.config.optimizer_sharding == "zero1" for c in found)
    for c in found:
        cfg, q = c.config, c.config.optimizer_shares
        assert q is not None and q[0] < q[1] and sum(q) == pytest.approx(1.0)
        # the shares water-fill S over base_r = fixed_r + m_r * act * f(1.0) (measured: no extra margin)
        base = [FIXED[r] + m * ACT * f_true(1.0) for r, m in enumerate(cfg.micro_batches)]
        level = (STATE + sum(base)) / 2
        want = [max(0.0, level - b) for b in base]
        want = [w / sum(want) for w in want]
        assert q == pytest.approx(want, abs=1e-4)
        for r, (m, b) in enumerate(zip(cfg.micro_batches, cfg.activation_budget, strict=True)):
            assert memory.fits(rank=r, micro_batch=m, budget=b, dtype="fp32", mode="default", limit=usable * GIB,
                               optimizer_share=q[r])
            if b in (0.3, 0.6, 1.0):  # a measured budget: the truth of that rank fits (with the margin)
                assert true_peak(cfg, r) * (1 + memory.safety_margin) <= usable + 1e-9
        assert c.peaks == pytest.approx([true_peak(cfg, r) * GIB for r in range(2)], rel=0.3)
    # the same ranks unsharded: rank 0 fits at no budget, whatever its micro-batch
    assert memory.largest_budget(rank=0, micro_batch=1, dtype="fp32", mode="default", limit=usable * GIB) is None


def test_zero1_splits_balance_the_sharded_fixed_parts():
    """At budget 1.0 (measured, f = 0.9) the balanced split equalises ``fixed_r(q_r) + m_r * act * 0.9``
    with ``m_0 + m_1 = 32``: ``m_0 = (32 + (fixed_1(q_1) - fixed_0(q_0)) / (act * 0.9)) / 2``. Unsharded
    (fixed 4 and 3 GiB) that is 13.8 -> [14, 18]; with all the state on rank 1 (2 and 3 GiB) 18.2 -> [18, 14]."""
    trials = [trial(c) for c in EAGER + COMPILED]
    memory, _, _ = models(trials)

    def balanced(shares: list[float] | None) -> list[int]:
        q = shares or [1.0, 1.0]
        fixed = [FIXED[r] + STATE * q[r] for r in range(2)]
        m0 = round((32 + (fixed[1] - fixed[0]) / (ACT * f_true(1.0))) / 2)
        return [m0, 32 - m0]

    assert balanced(None) == [14, 18] and balanced([0.0, 1.0]) == [18, 14]
    kw = {"total": 32, "dtype": "fp32", "mode": "default", "usable": [8 * GIB] * 2, "world": 2}
    plain, zero = _splits(memory, **kw), _splits(memory, **kw, shares=[0.0, 1.0])
    assert balanced(None) in plain and balanced(None) not in zero
    assert balanced([0.0, 1.0]) in zero and balanced([0.0, 1.0]) not in plain


def test_zero1_is_not_proposed_unless_searched():
    trials = [trial(c) for c in EAGER + COMPILED]
    _, none = candidates(["off"], 4.2, trials)
    assert none == []
    _, plain = candidates(["off"], 8.0, trials)
    assert plain and all(c.config.optimizer_sharding == "off" for c in plain)
    _, both = candidates(["off", "zero1"], 8.0, trials)
    assert any(c.config.optimizer_sharding == "zero1" for c in both)
    assert any(c.config.optimizer_sharding == "off" for c in both)


# ------------------------------------------------------------------------------------------ dominance


def test_a_zero1_trial_out_of_memory_dominates_configs_holding_at_least_its_state_there():
    oom = trial(compiled([16, 16], [0.6, 0.6], shares=[0.2, 0.8]), status="oom", failing_rank=0,
                peaks=[MEASURED_CAP, None])
    assert dominating_over_cap([oom], compiled([16, 16], [0.6, 0.6], shares=[0.3, 0.7])) is not None
    assert dominating_over_cap([oom], compiled([16, 16], [0.6, 0.6], shares=[0.2, 0.8])) is not None
    assert dominating_over_cap([oom], compiled([16, 16], [0.6, 0.6])) is not None  # unsharded: all of it
    assert dominating_over_cap([oom], compiled([16, 16], [0.6, 0.6], shares=[0.1, 0.9])) is None  # less state
    assert dominating_over_cap([oom], compiled([12, 16], [0.6, 0.6], shares=[0.3, 0.7])) is None  # fewer samples
    # an unsharded trial out of memory on rank 0 says nothing of a zero1 config with less state there
    off = trial(compiled([16, 16], [0.6, 0.6]), status="oom", failing_rank=0, peaks=[MEASURED_CAP, None])
    assert dominating_over_cap([off], compiled([16, 16], [0.6, 0.6], shares=[0.5, 0.5])) is None
    assert dominating_over_cap([off], compiled([16, 16], [0.6, 0.6])) is not None
    # three ranks: rank 1's run of the parameters must contain the trial's, a larger share is not enough
    three = BalanceConfig(micro_batches=[8, 8, 8], global_batch=24, dtype="fp32", compile="default",
                          activation_budget=[0.6] * 3, optimizer_sharding="zero1", optimizer_shares=[0.2, 0.3, 0.5])
    oom3 = trial(three, status="oom", failing_rank=1, peaks=[None, MEASURED_CAP, None])
    moved = dataclasses.replace(three, optimizer_shares=[0.1, 0.35, 0.55])  # run [0.10, 0.45] vs [0.20, 0.50]
    wider = dataclasses.replace(three, optimizer_shares=[0.15, 0.4, 0.45])  # run [0.15, 0.55]
    assert dominating_over_cap([oom3], moved) is None
    found = dominating_over_cap([oom3], wider)
    assert found is not None and found[1] == 1


def test_a_sampled_zero1_compiled_config_is_judged_with_its_share_of_the_state(tmp_path):
    """The advisor's veto of a sampled compiled configuration: rank 0 at micro-batch 16, budget 0.3
    holds ``2 + 2*q_0 + 16 * 0.25 * 0.3`` GiB: 5.2 unsharded (surely over 4.2 usable), 3.2 with no state
    (q_0 = 0). Vetoed unsharded, never with the share."""
    from autobalance.tuner import TuneSettings
    from autobalance.tuner.search import ModelAdvisor

    script = tmp_path / "train.py"
    script.write_text("")
    settings = TuneSettings(script=str(script), device="cuda", nproc_per_node=2, memory_cap_gib=[4.2], headroom=0.0,
                            compile="search")
    advisor = ModelAdvisor(space=space(["off", "zero1"]), settings=settings)
    study = optuna.create_study()
    study.set_user_attr("autobalance:reference_step_s", 0.06)
    for t in [trial(c) for c in EAGER + COMPILED]:
        study.add_trial(t)
    vetoed = advisor.predict_infeasible(study, compiled([16, 16], [0.3, 0.3]))
    assert vetoed is not None and "rank 0" in vetoed[1]["reason"]
    assert advisor.predict_infeasible(study, compiled([16, 16], [0.3, 0.3], shares=[0.0, 1.0])) is None
