"""The compiled model (per-rank budget curves, compiled step time) and its proposals, on synthetic
studies whose truth is known: stepwise budget curves, a rank-0 extra, a recompute cost (fast)."""

from __future__ import annotations

import math

import optuna
import pytest
from optuna.trial import TrialState

from autobalance import BalanceConfig
from autobalance.tuner import SearchSpace, TuneSettings
from autobalance.tuner.search import (
    DYNAMIC,
    UNMEASURED_MARGIN,
    BudgetCurve,
    Candidate,
    CompiledMemoryModel,
    CompiledObservation,
    CompiledTimeModel,
    MemoryModel,
    ModelAdvisor,
    StepTimeModel,
    budget_grid,
    cache_order,
    compiled_graphs,
    compiled_observations,
    graph_keys,
    observations_from_trials,
)

GIB = 2**30
LAYERS = 4
FIXED = [2.0, 1.5]  # GiB: rank 0 holds extras
ACT = 0.25  # GiB per sample, eager, no checkpointing
SAVED = 0.15  # GiB per sample saved by checkpointing every block
USABLE = 5.0


def f_true(budget: float) -> float:
    """A stepwise (knapsack plateaus) fraction of the eager activations kept at ``budget``."""
    return 0.3 if budget < 0.35 else (0.55 if budget < 0.7 else 0.9)


def eager_peak(rank: int, m: int, c: int) -> float:
    return FIXED[rank] + m * (ACT - SAVED * c / LAYERS)


def compiled_peak(rank: int, m: int, budget: float) -> float:
    return FIXED[rank] + m * ACT * f_true(budget)


def eager_ms(cfg: BalanceConfig) -> float:
    """a = 5 ms, b = 10 ms per micro-step, k = 1 ms per sample, g = 8 ms to recompute every block."""
    return 5 + max(cfg.accumulation * (10 + 8 * len(c) / LAYERS) + n
                   for n, c in zip(cfg.samples_per_rank, cfg.checkpoint, strict=True))


def compiled_ms(cfg: BalanceConfig, *, s: float = 0.8, rho: float = 0.5) -> float:
    budgets = cfg.activation_budget or [1.0, 1.0]
    return 5 + s * max((cfg.accumulation * 10 + n) * (1 + rho * (1 - b))
                       for n, b in zip(cfg.samples_per_rank, budgets, strict=True))


def trial(cfg: BalanceConfig, *, status: str = "ok", failing_rank: int | None = None,
          peaks: list[float | None] | None = None) -> optuna.trial.FrozenTrial:
    if peaks is None:
        if cfg.compile == "off":
            peaks = [eager_peak(r, m, len(c)) for r, (m, c) in enumerate(zip(cfg.micro_batches, cfg.checkpoint,
                                                                              strict=True))]
        else:
            peaks = [compiled_peak(r, m, b) for r, (m, b) in enumerate(zip(cfg.micro_batches,
                                                                            cfg.activation_budget or [1.0, 1.0],
                                                                            strict=True))]
    attrs = {"status": status, "config": cfg.to_dict(), "peak_device_gib": peaks, "usable_gib": [USABLE] * 2,
             "capacity_gib": [USABLE] * 2}
    if status == "ok":
        attrs["step_time_ms"] = eager_ms(cfg) if cfg.compile == "off" else compiled_ms(cfg)
    if failing_rank is not None:
        attrs["failing_rank"] = failing_rank
    return optuna.trial.create_trial(state=TrialState.COMPLETE, value=1.0, user_attrs=attrs)


def eager(micro: list[int], ckpt: tuple[int, int] = (0, 0), acc: int = 1) -> BalanceConfig:
    return BalanceConfig(micro_batches=micro, accumulation=acc, global_batch=32, dtype="fp32", bucket_cap_mb=25.0,
                         gradient_as_bucket_view=True, checkpoint=[list(range(c)) for c in ckpt])


def compiled(micro: list[int], budgets: list[float], acc: int = 1) -> BalanceConfig:
    return BalanceConfig(micro_batches=micro, accumulation=acc, global_batch=32, dtype="fp32", bucket_cap_mb=25.0,
                         gradient_as_bucket_view=True, compile="default", activation_budget=budgets)


EAGER = [eager([8, 8], acc=2), eager([6, 10], acc=2), eager([4, 4], (4, 0), acc=4), eager([16, 16], (4, 4)),
         eager([2, 2], (0, 2), acc=8)]
"""Eager trials that determine the eager model (micro-batches and checkpointing vary on each rank)."""


def eager_model(trials: list[optuna.trial.FrozenTrial]) -> MemoryModel:
    return MemoryModel.fit(observations_from_trials(trials, num_layers=LAYERS), world_size=2)


# ------------------------------------------------------------------------------------- the curve


def test_the_curve_is_the_least_monotone_upper_envelope_and_interpolates_between_measured_budgets():
    # a dip at 0.6 (noise, or another micro-batch) cannot lower f: it is monotone
    curve = BudgetCurve.from_points([(0.3, 0.30, True), (0.6, 0.50, True), (0.45, 0.55, True), (1.0, 0.9, True)])
    assert curve.budgets == [0.3, 0.45, 0.6, 1.0]
    assert curve.fractions == [0.30, 0.55, 0.55, 0.9]
    assert all(a <= b for a, b in zip(curve.fractions, curve.fractions[1:], strict=False))
    assert curve.estimate(0.8) == pytest.approx(0.55 + 0.35 * 0.5)  # linear between 0.6 and 1.0
    assert curve.estimate(0.15) == pytest.approx(0.15)  # below the first: the partitioner's rule, b * F1 / b1
    assert curve.lower(0.8) == 0.55 and curve.lower(0.2) == 0.0
    assert curve.measured(0.6) and not curve.measured(0.8)
    assert curve.extra_margin(0.6) == 0.0
    assert curve.extra_margin(0.8) == pytest.approx(UNMEASURED_MARGIN / math.sqrt(5))
    # an out-of-memory rank's lower bound lifts the envelope from its budget upwards, but is no measurement
    lifted = BudgetCurve.from_points([(0.3, 0.3, True), (0.5, 0.7, False)])
    assert lifted.estimate(0.5) == 0.7 and lifted.lower(0.9) == 0.7 and not lifted.measured(0.5)
    # above the last measured budget: proportional, at most the eager activations unless measured more
    assert lifted.estimate(1.0) == pytest.approx(1.0)
    assert BudgetCurve.from_points([(0.5, 0.2, True)]).estimate(1.0) == pytest.approx(0.4)
    assert BudgetCurve.from_points([]).estimate(0.35) == pytest.approx(0.35)  # the prior f(b) = b


def test_the_compiled_model_fits_a_stepwise_budget_curve_from_few_trials():
    trials = [trial(c) for c in EAGER]
    measured = [compiled([16, 16], [0.3, 0.3]), compiled([16, 16], [0.6, 0.6]), compiled([8, 8], [1.0, 1.0], acc=2)]
    trials += [trial(c) for c in measured]
    model = CompiledMemoryModel.fit(compiled_observations(trials), eager=eager_model(trials), num_layers=LAYERS)
    for cfg in measured:  # the points themselves, for any micro-batch and either rank (fixed parts from eager)
        for r in (0, 1):
            for m in (3, 16, 20):
                b = cfg.activation_budget[r]
                got = model.predict(rank=r, micro_batch=m, budget=b, dtype="fp32", mode="default")
                assert got / GIB == pytest.approx(compiled_peak(r, m, b), rel=1e-6)
    # on a plateau it interpolates between measured budgets: never below the truth there (the envelope rises)
    for b in (0.65, 0.75, 0.9):
        got = model.predict(rank=0, micro_batch=16, budget=b, dtype="fp32", mode="default") / GIB
        assert got >= FIXED[0] + 16 * ACT * 0.55 - 1e-9
    # another dtype borrows the fractions (relative to its own activations) with the unmeasured margin
    assert model.curve("bf16", "default").borrowed
    # held out: budget 0.6 predicted from 0.3 and 1.0 (interpolated on a plateau, so over-predicted)
    held = [o for o in compiled_observations(trials) if o.budget == 0.6]
    rest = [o for o in compiled_observations(trials) if o.budget != 0.6]
    loo = CompiledMemoryModel.fit(rest, eager=eager_model(trials), num_layers=LAYERS)
    assert 0.0 <= loo.holdout_error(held) < 0.25


def test_the_largest_fitting_budget_is_chosen_and_measured_bounds_veto_only_what_cannot_fit():
    trials = [trial(c) for c in EAGER]
    trials += [trial(compiled([16, 16], [0.3, 0.3])), trial(compiled([16, 16], [0.6, 0.6])),
               trial(compiled([8, 8], [1.0, 1.0], acc=2))]
    model = CompiledMemoryModel.fit(compiled_observations(trials), eager=eager_model(trials), num_layers=LAYERS)
    limit = USABLE * GIB
    for r in (0, 1):
        chosen = []
        for m in (4, 8, 12, 16, 20, 24):
            b = model.largest_budget(rank=r, micro_batch=m, dtype="fp32", mode="default", limit=limit)
            chosen.append(b if b is not None else 0.0)
            if b is None:
                continue
            assert model.fits(rank=r, micro_batch=m, budget=b, dtype="fp32", mode="default", limit=limit)
            above = [g for g in budget_grid() if g > b]
            assert not any(model.fits(rank=r, micro_batch=m, budget=g, dtype="fp32", mode="default", limit=limit)
                           for g in above)
            if b in (0.3, 0.6, 1.0):  # measured budgets: the truth fits (between them it is a predicted fit)
                assert compiled_peak(r, m, b) <= USABLE
        assert chosen == sorted(chosen, reverse=True)  # more samples, a smaller budget
    # rank 0 at micro-batch 16: budget 0.6 measured (4.2 GiB) fits; 0.7 (truth 5.6 GiB) must not be chosen
    b16 = model.largest_budget(rank=0, micro_batch=16, dtype="fp32", mode="default", limit=limit)
    assert b16 is not None and 0.6 <= b16 < 0.7
    # measured bounds: micro-batch 24 at budget 0.6 needs >= 2 + 24 * 0.25 * 0.55 = 5.3 GiB > 5
    assert model.surely_over(rank=0, micro_batch=24, budget=0.6, dtype="fp32", mode="default", limit=limit)
    assert model.surely_over(rank=0, micro_batch=16, budget=0.6, dtype="fp32", mode="default", limit=limit) is None
    assert model.surely_over(rank=0, micro_batch=24, budget=0.2, dtype="fp32", mode="default", limit=limit) is None


def test_an_under_predicted_compiled_trial_widens_the_margin():
    """Fails if the compiled model's widen factor is not 1.5 (1.5 x a 20 % miss = 0.3, a literal), or
    if an under-prediction within the margin (1 %) widens it."""
    trials = [trial(c) for c in EAGER]
    model = CompiledMemoryModel.fit([], eager=eager_model(trials), num_layers=LAYERS)
    predicted = model.predict(rank=0, micro_batch=16, budget=0.5, dtype="fp32", mode="default")
    assert not model.correct(CompiledObservation(rank=0, micro_batch=16, budget=0.5, dtype="fp32", mode="default",
                                                 peak_bytes=predicted * 1.01))
    assert model.correct(CompiledObservation(rank=0, micro_batch=16, budget=0.5, dtype="fp32", mode="default",
                                             peak_bytes=predicted * 1.2, ok=False))
    assert model.safety_margin == pytest.approx(0.3) and model.corrections == 1


def test_compiled_observations_take_every_measured_rank_and_the_failing_rank_of_an_oom():
    ok = trial(compiled([16, 16], [0.3, 0.6]))
    oom = trial(compiled([20, 12], [0.9, 0.6]), status="oom", failing_rank=0, peaks=[3.0, 2.0])
    reused = trial(compiled([16, 16], [0.3, 0.6]))
    reused.user_attrs["reused_from"] = 0
    obs = compiled_observations([ok, oom, reused, trial(eager([8, 8], acc=2))])
    assert [(o.rank, o.budget, o.ok) for o in obs] == [(0, 0.3, True), (1, 0.6, True), (0, 0.9, False)]
    assert obs[2].peak_bytes == USABLE * GIB  # at least the capacity it ran out of


# ----------------------------------------------------------------------------------- step time


def test_the_compiled_time_model_recovers_speed_and_a_recompute_cost_falling_with_the_budget():
    eager_trials = [trial(c) for c in EAGER]
    timing = StepTimeModel.fit(eager_trials, num_layers=LAYERS, device="cuda")
    seen = [compiled([16, 16], [0.3, 0.3]), compiled([16, 16], [0.6, 1.0]), compiled([8, 8], [1.0, 1.0], acc=2),
            compiled([12, 20], [0.9, 0.2])]
    model = CompiledTimeModel.fit(eager_trials + [trial(c) for c in seen], eager=timing, device="cuda")
    s, rho, own = model.params("fp32", "default")
    assert own and s == pytest.approx(0.8, rel=1e-3) and rho == pytest.approx(0.5)
    unseen = compiled([10, 22], [0.45, 0.05])
    assert model.predict(unseen) == pytest.approx(compiled_ms(unseen), rel=1e-3)
    # budgets that never varied cannot show rho: the prior, and s from the trials
    fixed = CompiledTimeModel.fit([*eager_trials, trial(compiled([16, 16], [0.5, 0.5]))], eager=timing,
                                  device="cuda")
    _, rho_fixed, _ = fixed.params("fp32", "default")
    assert rho_fixed == pytest.approx(1 / 3)
    assert fixed.predict(compiled([16, 16], [0.5, 0.5])) == pytest.approx(compiled_ms(compiled([16, 16], [0.5, 0.5])),
                                                                        rel=1e-6)
    # no compiled trial at all: the device's prior
    assert CompiledTimeModel.fit(eager_trials, eager=timing, device="cuda").params("bf16", "default")[2] is False


# ------------------------------------------------------------------------------------ proposals


def _advisor(tmp_path, *, modes: list[str]) -> ModelAdvisor:
    script = tmp_path / "train.py"
    script.write_text("")
    settings = TuneSettings(script=str(script), device="cuda", nproc_per_node=2, memory_cap_gib=[USABLE],
                            headroom=0.0, compile="search" if "off" in modes else "on")
    space = SearchSpace.build(world_size=2, global_batch=32, num_layers=LAYERS, dtypes=["fp32"],
                              max_accumulation=8, compile_modes=modes)
    return ModelAdvisor(space=space, settings=settings)


def _study(trials: list[optuna.trial.FrozenTrial]) -> optuna.Study:
    study = optuna.create_study()
    study.set_user_attr("autobalance:reference_step_s", 0.06)
    for t in trials:
        study.add_trial(t)
    return study


def test_the_model_proposes_compiled_configs_at_each_ranks_largest_fitting_budget(tmp_path):
    advisor = _advisor(tmp_path, modes=["off", "default"])
    study = _study([trial(c) for c in EAGER] + [trial(compiled([16, 16], [0.3, 0.3])),
                                                trial(compiled([16, 16], [0.6, 0.6])),
                                                trial(compiled([8, 8], [1.0, 1.0], acc=2))])
    candidates = advisor.models.scored_candidates(study)
    compiled_ones = [c for c in candidates if c.source == "compiled-model"]
    assert compiled_ones and all(c.config.compile == "default" and c.config.checkpoint == [[], []]
                                 for c in compiled_ones)
    model = advisor.models.compiled
    for c in compiled_ones:
        for r, (m, b) in enumerate(zip(c.config.micro_batches, c.config.activation_budget, strict=True)):
            top = model.largest_budget(rank=r, micro_batch=m, dtype="fp32", mode="default", limit=USABLE * GIB)
            assert top is not None and b <= top  # never above what is predicted to fit
            if ("fp32", "default", 25.0, m, b) not in compiled_graphs(study.get_trials()):
                assert b == top  # a smaller budget only when its graph is already compiled
    # the case: micro-batch 16 on both ranks, rank 0 (its extras) at a budget below 0.75
    at16 = [c for c in compiled_ones if c.config.micro_batches == [16, 16]]
    assert at16 and all(c.config.activation_budget[0] < 0.75 for c in at16)
    for c in compiled_ones:  # where the budget was measured, the truth fits
        assert all(compiled_peak(r, m, b) <= USABLE for r, (m, b) in
                   enumerate(zip(c.config.micro_batches, c.config.activation_budget, strict=True))
                   if b in (0.3, 0.6, 1.0))
    # compiled (0.8 x eager, modest recomputation) beats eager checkpointing here: the best proposal is compiled
    assert candidates[0].source == "compiled-model"
    advisor.before_ask(study)
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert len(waiting) == 1 and waiting[0].user_attrs["proposed_by"] == "compiled-model"
    assert waiting[0].user_attrs["proposal_step_ms"] > 0 and len(waiting[0].user_attrs["proposal_peak_gib"]) == 2


def test_dominated_and_surely_over_configs_are_never_proposed_and_sampled_ones_are_vetoed(tmp_path):
    advisor = _advisor(tmp_path, modes=["off", "default"])
    # rank 0 ran out of memory at micro-batch 16 with budget 0.5: nothing needing more there is proposed
    trials = [trial(c) for c in EAGER] + [trial(compiled([16, 16], [0.6, 0.6]))]
    trials.append(trial(compiled([16, 16], [0.5, 0.5]), status="oom", failing_rank=0, peaks=[4.0, None]))
    study = _study(trials)
    proposed = [c for c in advisor.models.scored_candidates(study) if c.source == "compiled-model"]
    assert proposed and any(c.config.micro_batches[0] < 16 for c in proposed)
    for c in proposed:
        if c.config.micro_batches[0] >= 16:
            assert c.config.activation_budget[0] < 0.5
    # a sampled configuration that no trial dominates but the measured budgets rule out: rank 0 at
    # micro-batch 24 needs at least 2 + 24 x 0.25 x f(0.6) = 5.3 GiB at any budget >= 0.6 (usable 5)
    advisor = _advisor(tmp_path, modes=["off", "default"])
    study = _study([trial(c) for c in EAGER] + [trial(compiled([16, 16], [0.6, 0.6]))])
    figures, attrs = advisor.predict_infeasible(study, compiled([24, 8], [0.8, 0.3]))
    assert attrs["predicted_by"] == "compiled-model" and "not compiled" in attrs["reason"]
    assert "rank 0" in attrs["reason"] and figures.memory_constraint(0.0) >= 1.0
    assert advisor.predict_infeasible(study, compiled([24, 8], [0.3, 0.3])) is None  # below what was measured
    assert advisor.predict_infeasible(study, compiled([12, 20], [0.8, 0.3])) is None  # may fit: launched


def test_eager_trials_come_first_while_they_teach_the_model_then_compiled_ones(tmp_path):
    advisor = _advisor(tmp_path, modes=["off", "default"])
    study = _study([trial(eager([16, 16], (4, 4)))])  # the baseline only
    assert any(c.source == "compiled-model" for c in advisor.models.scored_candidates(study))
    advisor.before_ask(study)
    first = study.get_trials(states=(TrialState.WAITING,))
    assert first and first[0].user_attrs["proposed_by"] == "memory-model"
    # with every compile on ("--compile on"), there is no eager trial to run: compiled proposals at once
    only = _advisor(tmp_path, modes=["default"])
    study = _study([trial(eager([16, 16], (4, 4)))])
    only.before_ask(study)
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert waiting and waiting[0].user_attrs["proposed_by"] == "compiled-model"
    cfg = waiting[0].user_attrs["proposed_config"]
    assert cfg["compile"] == "default" and all(b in budget_grid() for b in cfg["activation_budget"])


def test_near_ties_go_to_the_candidate_that_compiles_fewer_new_graphs():
    a = Candidate(score=1.000, config=compiled([16, 16], [0.6, 0.6]), peaks=[1, 1], step_ms=1.0, new_graphs=2)
    b = Candidate(score=1.010, config=compiled([16, 16], [0.55, 0.6]), peaks=[1, 1], step_ms=1.0, new_graphs=0)
    c = Candidate(score=1.500, config=compiled([8, 8], [1.0, 1.0], acc=2), peaks=[1, 1], step_ms=1.0, new_graphs=0)
    assert [x.score for x in cache_order([c, a, b])] == [1.010, 1.000, 1.500]
    assert graph_keys(compiled([16, 16], [0.6, 0.6]).to_dict()) == {("fp32", "default", 25.0, 16, 0.6)}
    assert graph_keys(eager([8, 8], acc=2).to_dict()) == set()


def test_a_rank_with_two_micro_step_sizes_is_one_dynamic_graph():
    """An any split (rank 0: 6,6,5,5,5,5) compiles one graph with a dynamic batch dimension, not
    one per size (issue 30); a rank with one size keeps its static graph."""
    cfg = BalanceConfig(micro_batches=[6, 3], accumulation=6, global_batch=48, dtype="bf16",
                        rank_samples=[32, 16], compile="default", activation_budget=[1.0, 0.5])
    assert cfg.micro_step_sizes(0) == [6, 6, 5, 5, 5, 5] and set(cfg.micro_step_sizes(1)) == {3, 2}
    assert graph_keys(cfg.to_dict()) == {("bf16", "default", 25.0, DYNAMIC, 1.0), ("bf16", "default", 25.0, DYNAMIC, 0.5)}
    even = BalanceConfig(micro_batches=[4, 4], accumulation=6, global_batch=48, dtype="bf16", compile="default",
                         activation_budget=[1.0, 1.0])
    assert graph_keys(even.to_dict()) == {("bf16", "default", 25.0, 4, 1.0)}


def test_the_compiled_holdout_error_is_reported_per_trial(tmp_path):
    advisor = _advisor(tmp_path, modes=["off", "default"])
    study = _study([trial(c) for c in EAGER] + [trial(compiled([16, 16], [0.3, 0.3])),
                                                trial(compiled([16, 16], [0.6, 0.6])),
                                                trial(compiled([12, 20], [0.6, 0.3]))])
    error, count = advisor.compiled_holdout_error(study)
    assert count == 3 and 0.0 <= error < 0.2


def test_a_rank_reuses_a_compiled_budget_when_its_recomputation_costs_about_the_same(tmp_path):
    advisor = _advisor(tmp_path, modes=["off", "default"])
    measured = [compiled([16, 16], [0.6, 0.6]), compiled([16, 16], [0.3, 0.3]), compiled([8, 8], [1.0, 1.0], acc=2)]
    trials = [trial(c) for c in measured]
    for t, cfg in zip(trials, measured, strict=True):
        t.user_attrs["step_time_ms"] = compiled_ms(cfg, rho=0.1)  # recomputation nearly free
    study = _study([trial(c) for c in EAGER] + trials)
    at16 = [c for c in advisor.models.scored_candidates(study) if c.source == "compiled-model"
            and c.config.micro_batches == [16, 16] and c.config.accumulation == 1]
    assert len(at16) == 1
    tops = [advisor.models.compiled.largest_budget(rank=r, micro_batch=16, dtype="fp32", mode="default", limit=USABLE * GIB)
            for r in (0, 1)]
    assert tops[1] > 0.6  # a larger budget is predicted to fit on rank 1 ...
    assert at16[0].config.activation_budget == [0.6, 0.6] and at16[0].new_graphs == 0  # ... the cache serves 0.6
