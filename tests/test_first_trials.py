"""Issue 30, on CPU without a GPU: the first trials of a GPU study come from the models and priors
(bf16 first, fp32 without TF32 only when asked or learned, the sampler only once the proposals stop
improving), and a compiled configuration that no budget can fit is never compiled.

The studies are Optuna studies answered by a simulated one-GPU machine shaped like the H200 study of
the issue (the ~270M GPT of ``studies/gpt-1gpu.toml``: 8.2 GiB fixed, 1.14 GiB of bf16 activations
per sample, 16 GiB cap): the advisor asks, the simulation measures, nothing is launched (fast)."""

from __future__ import annotations

import warnings
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autobalance import BalanceConfig
from autobalance.protocol import StudyAttr
from autobalance.tuner import SearchSpace, TuneSettings
from autobalance.tuner.search import (
    Decision,
    ModelAdvisor,
    TimeBudget,
    proposable_dtypes,
    proposals_stalled,
)
from autobalance.tuner.search._policy import sampler_proposal

GIB = 2**30
LAYERS = 16
FIXED = 8.23
ACT = {"bf16": 1.137, "fp16": 1.137, "fp32": 2.274}
"""GiB of activations per sample, eager, nothing checkpointed."""
SAVED = 0.44
"""Fraction of them that checkpointing every block frees (logits and block inputs stay)."""
MS_PER_SAMPLE = {"bf16": 1.3, "fp16": 1.35, "fp32": 8.0}


def f_compiled(budget: float) -> float:
    """Fraction of the eager activations a compiled graph keeps (0.43 at 0.4, 0.62 at 1.0; a floor of 0.3)."""
    return 0.3 + 0.32 * budget


def true_peak(cfg: BalanceConfig) -> float:
    m, act = max(cfg.micro_batches), ACT[cfg.dtype]
    if cfg.compile != "off":
        return FIXED + m * act * f_compiled((cfg.activation_budget or [1.0])[0])
    return FIXED + m * act * (1 - SAVED * len(cfg.checkpoint[0]) / LAYERS)


def true_ms(cfg: BalanceConfig) -> float:
    n = cfg.samples_per_rank[0]
    eager = 5 + cfg.accumulation * (30 + 40 * len(cfg.checkpoint[0]) / LAYERS) + MS_PER_SAMPLE[cfg.dtype] * n
    if cfg.compile == "off":
        return eager
    return 0.85 * eager * (1 + (1 - (cfg.activation_budget or [1.0])[0]) / 3)


def baseline() -> BalanceConfig:
    return BalanceConfig(micro_batches=[8], accumulation=4, global_batch=32, dtype="fp32", bucket_cap_mb=25.0,
                         gradient_as_bucket_view=True, checkpoint=[[]])


def advisor_for(tmp_path: Path, *, device: str = "cuda", cap: float = 16.0, compile: str = "off",
                dtypes: list[str] | None = None) -> ModelAdvisor:
    script = tmp_path / "train.py"
    script.write_text("")
    settings = TuneSettings(script=str(script), device=device, nproc_per_node=1, memory_cap_gib=[cap], headroom=0.05,
                            compile=compile)
    space = SearchSpace.build(world_size=1, global_batch=32, num_layers=LAYERS, dtypes=dtypes or ["fp32", "bf16", "fp16"],
                              max_accumulation=8, compile_modes=settings.compile_modes(), any_split=True)
    return ModelAdvisor(space=space, settings=settings)


def _usable(advisor: ModelAdvisor) -> float:
    caps = advisor.settings.caps_bytes() or [0]
    return caps[0] * (1 - advisor.settings.headroom) / GIB


def _tell(study: optuna.Study, trial: optuna.Trial, cfg: BalanceConfig, advisor: ModelAdvisor, *,
          baseline_trial: bool = False) -> None:
    usable = _usable(advisor)
    prediction = None if baseline_trial else advisor.predict_infeasible(study, cfg)
    attrs: dict[str, object]
    if prediction is not None:
        attrs = dict(prediction[1])
        value = 10.0
    else:
        peak = true_peak(cfg)
        fits = peak <= usable
        attrs = {"status": "ok" if fits else "oom", "peak_device_gib": [peak], "usable_gib": [usable],
                 "capacity_gib": [usable / 0.95]}
        if fits:
            attrs["step_time_ms"] = true_ms(cfg)
        else:
            attrs["failing_rank"] = 0
        value = true_ms(cfg) / 200.0 if fits else 10.0 + peak / usable
    attrs["config"] = cfg.to_dict()
    attrs["baseline"] = baseline_trial
    for key, v in attrs.items():
        trial.set_user_attr(key, v)
    study.tell(trial, value)
    frozen = study.get_trials(deepcopy=False)[trial.number]
    if not baseline_trial:
        advisor.after_trial(study, frozen)


def simulated_study(advisor: ModelAdvisor, trials: int, *, seed: int = 0) -> list[optuna.trial.FrozenTrial]:
    """The baseline (the script's fp32 8 x 4), then ``trials`` trials as the tuner's loop asks them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True, n_startup_trials=7)
        study = optuna.create_study(sampler=sampler)
        study.set_user_attr(StudyAttr.OBJECTIVE, {"weight_spread": 1.0, "weight_time": 1.0})
        study.set_user_attr(StudyAttr.REFERENCE, 0.2)
        study.set_user_attr(StudyAttr.CAPACITY, [advisor.settings.caps_bytes()[0]])  # type: ignore[index]
        study.set_user_attr(StudyAttr.DEVICE, {"type": advisor.settings.device, "tf32": False})
        study.enqueue_trial(advisor.space.params_from_config(baseline()))
        first = study.ask()
        _tell(study, first, advisor.space.suggest(first), advisor, baseline_trial=True)
        study.set_user_attr(StudyAttr.BASELINE, 0)
        for _ in range(trials):
            advisor.before_ask(study)
            trial = study.ask()
            _tell(study, trial, advisor.space.suggest(trial), advisor)
    return study.get_trials()


def launched(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    return [t for t in trials[1:] if t.user_attrs.get("status") != "predicted_oom"]


# ------------------------------------------------------------------------------------------ dtypes


def test_on_a_gpu_bf16_is_measured_first_and_fp32_without_tf32_is_never_proposed(tmp_path):
    advisor = advisor_for(tmp_path, cap=40.0)  # the fp32 baseline fits: the model has something to fit
    trials = simulated_study(advisor, 8)
    runs = launched(trials)
    assert runs[0].user_attrs["proposed_by"] == "memory-model" and runs[0].user_attrs["config"]["dtype"] == "bf16"
    assert "bf16 first" in runs[0].user_attrs["proposal_note"]
    assert all(t.user_attrs["config"]["dtype"] != "fp32" for t in runs), \
        [(t.number, t.user_attrs["config"]["dtype"], t.user_attrs.get("proposed_by")) for t in runs]
    first_fp16 = next((i for i, t in enumerate(runs) if t.user_attrs["config"]["dtype"] == "fp16"), None)
    if first_fp16 is not None:  # only after bf16 was measured
        assert any(t.user_attrs["status"] == "ok" and t.user_attrs["config"]["dtype"] == "bf16"
                   for t in runs[:first_fp16])


def test_when_the_scripts_own_configuration_runs_out_of_memory_the_priors_start_with_the_least_memory_bf16(tmp_path):
    advisor = advisor_for(tmp_path)  # 16 GiB: the fp32 baseline (26 GiB) runs out of memory, as in the issue
    trials = simulated_study(advisor, 6)
    assert trials[0].user_attrs["status"] == "oom"
    probe = trials[1]
    cfg = probe.user_attrs["config"]
    assert probe.user_attrs["proposed_by"] == "prior" and cfg["dtype"] == "bf16"
    assert cfg["accumulation"] == 4 and len(cfg["checkpoint"][0]) == LAYERS  # the baseline's split, all checkpointed
    assert probe.user_attrs["status"] == "ok"  # it fits: the model has its first point
    runs = launched(trials)
    assert all(t.user_attrs["config"]["dtype"] != "fp32" for t in runs)
    assert all(t.user_attrs.get("proposed_by") in ("prior", "memory-model") for t in runs[:3])


def test_the_sampler_gets_a_trial_only_after_the_proposals_stop_improving_and_never_with_fp32_first(tmp_path):
    advisor = advisor_for(tmp_path, cap=40.0)
    trials = simulated_study(advisor, 12, seed=3)
    objective = {"weight_spread": 1.0, "weight_time": 1.0}
    sampled = 0
    for t in launched(trials):
        before = [u for u in trials if u.number < t.number]
        if t.user_attrs.get("proposed_by") in (None, "sampler"):  # the sampler's: only once the proposals stalled
            sampled += 1
            assert proposals_stalled(before, objective), t.number
            assert t.user_attrs["config"]["dtype"] != "fp32"
        elif not proposals_stalled(before, objective):
            assert t.user_attrs["proposed_by"] in ("memory-model", "compiled-model", "prior")
    assert sampled >= 1  # and then it does explore
    # on CPU every third trial is still the sampler's, free to pick any dtype
    cpu = advisor_for(tmp_path, device="cpu", cap=40.0)
    study_trials = simulated_study(cpu, 3)
    assert study_trials[3].user_attrs.get("proposed_by") is None


def test_fp32_is_proposed_only_when_asked_or_learned():
    space = SearchSpace.build(world_size=1, global_batch=32, num_layers=LAYERS, dtypes=["fp32", "bf16", "fp16"],
                              max_accumulation=8, any_split=True)

    def done(dtype: str, status: str) -> optuna.trial.FrozenTrial:
        cfg = BalanceConfig(micro_batches=[8], accumulation=4, global_batch=32, dtype=dtype, checkpoint=[[]])
        state = TrialState.COMPLETE if status in ("ok", "oom") else TrialState.FAIL
        return optuna.trial.create_trial(state=state, value=1.0 if state == TrialState.COMPLETE else None,
                                         user_attrs={"status": status, "config": cfg.to_dict()})

    assert proposable_dtypes(space=space, device="cuda", trials=[])[0] == ["bf16"]
    assert proposable_dtypes(space=space, device="cpu", trials=[])[0] == ["fp32", "bf16", "fp16"]
    measured = [done("fp32", "ok"), done("bf16", "ok")]
    assert proposable_dtypes(space=space, device="cuda", trials=measured)[0] == ["bf16", "fp16"]
    # TF32 makes fp32 a candidate like fp16 (after the first dtype)
    assert proposable_dtypes(space=space, device="cuda", trials=measured, tf32=True)[0] == ["fp32", "bf16", "fp16"]
    assert proposable_dtypes(space=space, device="cuda", trials=[], tf32=True)[0] == ["bf16"]
    # so does naming fp32 in --dtypes fp32,bf16,fp16 (asked), still after bf16
    assert proposable_dtypes(space=space, device="cuda", trials=measured, asked=True)[0] == ["fp32", "bf16", "fp16"]
    assert proposable_dtypes(space=space, device="cuda", trials=[], asked=True)[0] == ["bf16"]
    # learned: every half-precision dtype failed (errors, not memory) ...
    failed = [done("bf16", "error"), done("fp16", "crash")]
    assert "fp32" in proposable_dtypes(space=space, device="cuda", trials=failed)[0]
    assert "fp32" not in proposable_dtypes(space=space, device="cuda", trials=[done("bf16", "oom")])[0]
    # ... or fp32 measured faster per sample than each of them
    assert "fp32" in proposable_dtypes(space=space, device="cuda", trials=measured,
                                       per_sample_ms={"fp32": 1.0, "bf16": 1.4})[0]
    # asked: the space holds fp32 only
    only = SearchSpace.build(world_size=1, global_batch=32, num_layers=LAYERS, dtypes=["fp32"], max_accumulation=8)
    assert proposable_dtypes(space=only, device="cuda", trials=[])[0] == ["fp32"]


def test_proposals_stall_after_two_that_do_not_improve_the_best():
    objective: dict[str, float] = {}

    def t(number: int, value: float, by: str | None = "memory-model") -> optuna.trial.FrozenTrial:
        cfg = BalanceConfig(micro_batches=[8], accumulation=4, global_batch=32, dtype="bf16", checkpoint=[[]])
        made = optuna.trial.create_trial(value=value, user_attrs={"status": "ok", "config": cfg.to_dict(),
                                                                  **({"proposed_by": by} if by else {})})
        made.number = number
        return made

    assert not proposals_stalled([t(0, 2.0, None), t(1, 1.5), t(2, 1.2)], objective)
    assert not proposals_stalled([t(0, 2.0, None), t(1, 1.5), t(2, 1.6)], objective)  # one miss
    assert proposals_stalled([t(0, 2.0, None), t(1, 1.5), t(2, 1.6), t(3, 1.499)], objective)  # < 1 %: noise
    assert not proposals_stalled([t(0, 2.0, None), t(1, 1.5), t(2, 1.6), t(3, 1.2)], objective)


# ----------------------------------------------------------------------------------------- compile


def compiled_cfg(micro: int, acc: int, budget: float, dtype: str = "bf16") -> BalanceConfig:
    return BalanceConfig(micro_batches=[micro], accumulation=acc, global_batch=32, dtype=dtype, bucket_cap_mb=25.0,
                         gradient_as_bucket_view=True, checkpoint=[[]], compile="default", activation_budget=[budget])


def _measured_study(advisor: ModelAdvisor, configs: list[BalanceConfig]) -> optuna.Study:
    study = optuna.create_study()
    study.set_user_attr(StudyAttr.OBJECTIVE, {"weight_spread": 1.0, "weight_time": 1.0})
    study.set_user_attr(StudyAttr.REFERENCE, 0.2)
    study.set_user_attr(StudyAttr.DEVICE, {"type": "cuda"})
    for cfg in configs:
        trial = study.ask()
        _tell(study, trial, cfg, advisor, baseline_trial=True)
    return study


EAGER_BF16 = [BalanceConfig(micro_batches=[m], accumulation=acc, global_batch=32, dtype="bf16", bucket_cap_mb=25.0,
                            gradient_as_bucket_view=True, checkpoint=[list(range(c))])
              for m, acc, c in ((4, 8, 0), (8, 4, 16), (4, 8, 8), (2, 16, 4))]


@pytest.mark.parametrize("measured_compiled", [[], [compiled_cfg(8, 4, 0.4)]], ids=["prior", "measured-0.4"])
def test_a_compiled_configuration_that_no_budget_can_fit_is_recorded_without_compiling(tmp_path, measured_compiled):
    advisor = advisor_for(tmp_path, compile="search")
    study = _measured_study(advisor, EAGER_BF16 + measured_compiled)
    # the issue: the whole batch in one micro-step at the smallest budget, 48 s of compiling, then out of memory
    whole = compiled_cfg(32, 1, 0.05)
    assert true_peak(whole) > _usable(advisor)
    figures, attrs = advisor.predict_infeasible(study, whole)
    assert attrs["predicted_by"] == "compiled-model" and "not compiled" in attrs["reason"]
    assert "at any budget" in attrs["reason"] and figures.memory_constraint(0.05) > 0
    # what may fit is launched (compiled): the models' veto is no blanket ban
    assert advisor.predict_infeasible(study, compiled_cfg(8, 4, 1.0)) is None
    assert advisor.predict_infeasible(study, compiled_cfg(16, 2, 0.05)) is None  # truth: 14.0 GiB, fits
    if measured_compiled:  # 8 x 4 at 0.4 measured: 16 x 2 needs at least twice its activations (truth 16.0 GiB)
        assert advisor.predict_infeasible(study, compiled_cfg(16, 2, 0.4)) is not None
    # and never proposed
    proposed = [c.config for c in advisor.models.scored_candidates(study) if c.source == "compiled-model"]
    assert proposed and all(max(c.micro_batches) < 32 for c in proposed)


def test_a_simulated_gpu_study_never_compiles_what_cannot_fit(tmp_path):
    advisor = advisor_for(tmp_path, compile="search")
    trials = simulated_study(advisor, 14, seed=1)
    runs = launched(trials)
    compiled_runs = [t for t in runs if t.user_attrs["config"]["compile"] != "off"]
    floor = {t.number: FIXED + max(t.user_attrs["config"]["micro_batches"]) * ACT[t.user_attrs["config"]["dtype"]]
             * f_compiled(0.05) for t in compiled_runs}
    assert all(v <= _usable(advisor) for v in floor.values()), floor
    assert all(t.user_attrs["config"]["dtype"] != "fp32" for t in runs)


def _compile_left(advisor: ModelAdvisor, study: optuna.Study, seconds: float) -> Decision:
    """A decision whose time budget leaves ``seconds`` for a compile (``TimeBudget.compile_left_s``)."""
    budget = TimeBudget(budget_s=None, started=0.0, compile_left_s=seconds)
    return Decision(study, num_layers=advisor.space.num_layers, device=advisor.settings.device, budget=budget)


def test_near_the_end_of_a_time_budget_no_new_graph_is_compiled(tmp_path):
    advisor = advisor_for(tmp_path, compile="search")
    study = _measured_study(advisor, [*EAGER_BF16, compiled_cfg(8, 4, 0.4)])
    best = advisor.models.scored_candidates(study)[0]
    assert best.source == "compiled-model" and best.new_graphs > 0  # the models' best compiles something new
    # time for a compile (no compile_s measured here: the 45 s prior on a GPU)
    advisor.before_ask(study, _compile_left(advisor, study, 200.0))
    first = study.get_trials(states=(TrialState.WAITING,))[0]
    assert first.user_attrs["proposed_by"] == "compiled-model"
    study.tell(study.ask(), 1.0)
    # less than a compile takes: the best proposal that compiles nothing new
    advisor.before_ask(study, _compile_left(advisor, study, 30.0))
    second = study.get_trials(states=(TrialState.WAITING,))
    assert second and (second[0].user_attrs.get("proposal_new_graphs") or 0) == 0
    assert advisor.space.suggest(study.ask()).compile == "off"  # here: the best eager proposal
    # a trial left to the sampler then runs eager too (and in bf16: fp32 is still held back)
    study.tell(study.trials[-1].number, 1.0)
    advisor.models.decision = _compile_left(advisor, study, 30.0)  # what before_ask sets while the policy's phases run
    sampler = sampler_proposal(advisor.models, "the sampler's trial")
    assert sampler.config is None and sampler.phase == "sampler"
    assert sampler.fixed == {"compile": "off", "dtype": "bf16"}
    assert "the time budget holds no compile" in sampler.reason


def test_under_a_time_budget_a_new_graph_is_compiled_only_when_predicted_to_beat_the_best(tmp_path):
    advisor = advisor_for(tmp_path, compile="search")
    study = _measured_study(advisor, [*EAGER_BF16, compiled_cfg(8, 4, 0.4)])
    assert any(c.new_graphs > 0 for c in advisor.models.scored_candidates(study))
    # a measured best that no proposal is predicted to beat (feasible: its constraint is met)
    cfg = BalanceConfig(micro_batches=[4], accumulation=8, global_batch=32, dtype="bf16", checkpoint=[[0, 1]])
    study.add_trial(optuna.trial.create_trial(value=0.01, system_attrs={"constraints": [-1.0]},
                                              user_attrs={"status": "ok", "config": cfg.to_dict()}))
    # time enough for any compile, but none promises a gain
    advisor.before_ask(study, _compile_left(advisor, study, 1000.0))
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert not waiting or (waiting[0].user_attrs.get("proposal_new_graphs") or 0) == 0
    fresh = ModelAdvisor(space=advisor.space, settings=advisor.settings)  # without a budget: what it would compile
    if waiting:
        study.tell(study.ask(), 1.0)
    fresh.before_ask(study)
    again = study.get_trials(states=(TrialState.WAITING,))
    assert again and again[0].user_attrs.get("proposal_new_graphs", 0) > 0


def test_the_eager_veto_judges_at_the_default_margin_not_the_widened_one(tmp_path):
    """Issue 41: a margin widened by under-predictions (up to 50 %) vetoed configurations that fit
    ("predicts 9.28 MiB (+50% margin) > usable 12.2 MiB", measured 9.2-10.0). Proposals may stay that
    careful; a configuration is recorded ``predicted_oom`` without launching only when its central
    prediction plus the default 5 % is over the usable memory. Fails if the veto uses the widened margin."""
    from autobalance.tuner.search import DEFAULT_SAFETY_MARGIN

    advisor = advisor_for(tmp_path)
    study = _measured_study(advisor, EAGER_BF16)
    model = advisor.models.refit(study)
    assert model is not None
    model.safety_margin = 0.5  # as after under-predictions
    usable = _usable(advisor) * GIB
    layers = 16
    fits = [c for c in (BalanceConfig(micro_batches=[m], accumulation=32 // m, global_batch=32, dtype="bf16",
                                      bucket_cap_mb=25.0, gradient_as_bucket_view=True, checkpoint=[list(range(c))])
                        for m in (4, 8) for c in (0, 8, 16))
            if 1.0 / 1.5 * usable < model.predict(rank=0, micro_batch=c.micro_batches[0], checkpointed=len(c.checkpoint[0]),
                                                  num_layers=layers, dtype="bf16") * (1 + DEFAULT_SAFETY_MARGIN) <= usable]
    assert fits, "no configuration between the widened and the default margin: the check would be empty"
    for cfg in fits:  # over with the widened margin, within with the default: launched
        assert advisor.predict_infeasible(study, cfg) is None, cfg
    over = BalanceConfig(micro_batches=[32], accumulation=1, global_batch=32, dtype="bf16", bucket_cap_mb=25.0,
                         gradient_as_bucket_view=True, checkpoint=[[]])
    _figures, attrs = advisor.predict_infeasible(study, over)
    assert attrs["predicted_by"] == "memory-model" and "(+5% margin)" in attrs["reason"]
