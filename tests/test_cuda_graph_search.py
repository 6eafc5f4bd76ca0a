"""CUDA graphs (``torch.compile`` mode ``reduce-overhead``) in the search at world size 1 (issue 30):
the compiled step-time model's per-micro-step factor ``beta`` (fitted when the micro-step count
varied, else the mode's prior measured on one H200; borrowed only within its mode), and the advisor
proposing them in a study that asked for them. Synthetic studies with a known truth (fast)."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState

from autobalance import BalanceConfig
from autobalance.protocol import CONSTRAINTS_KEY
from autobalance.tuner import SearchSpace, TuneSettings
from autobalance.tuner.search import (
    MICRO_STEP_PRIOR,
    CompiledTimeModel,
    Decision,
    ModelAdvisor,
    StepTimeModel,
    TrialHistory,
    graph_probe,
    graphs_verdict,
)
from autobalance.tuner.search._policy import cuda_graphs_phase

LAYERS = 4
GIB = 2**30
FIXED, ACT, SAVED = 4.0, 0.25, 0.15  # GiB: the fixed part, eager activations per sample, saved by checkpointing all
USABLE = 15.0


def cfg(m: int, mode: str = "off", budget: float | None = None, ck: int = 0) -> BalanceConfig:
    return BalanceConfig(micro_batches=[m], accumulation=32 // m, global_batch=32, dtype="bf16", bucket_cap_mb=25.0,
                         checkpoint=[list(range(ck))], compile=mode,
                         activation_budget=None if mode == "off" else [budget if budget is not None else 1.0])


def eager_ms(c: BalanceConfig) -> float:
    """a = 5 ms, b = 10 ms per micro-step, k = 1 ms per sample, g = 8 ms to recompute every block."""
    return 5 + c.accumulation * (10 + 8 * len(c.checkpoint[0]) / LAYERS) + 32


def compiled_ms(c: BalanceConfig, *, s: float, beta: float, rho: float = 0.5) -> float:
    """The module's formula with its own numbers: ``a + s * (beta * acc * b + k * n) * (1 + rho * (1 - budget))``."""
    return 5 + s * (beta * c.accumulation * 10 + 32) * (1 + rho * (1 - c.activation_budget[0]))


def peak(c: BalanceConfig) -> float:
    m = c.micro_batches[0]
    if c.compile == "off":
        return FIXED + m * (ACT - SAVED * len(c.checkpoint[0]) / LAYERS)
    return FIXED + m * ACT * max(c.activation_budget[0], 0.3)


def trial(c: BalanceConfig, ms: float) -> optuna.trial.FrozenTrial:
    attrs = {"status": "ok", "config": c.to_dict(), "step_time_ms": ms, "peak_device_gib": [peak(c)],
             "usable_gib": [USABLE], "capacity_gib": [USABLE], "feasible": True}
    return optuna.trial.create_trial(state=TrialState.COMPLETE, value=ms / 100, user_attrs=attrs,  # step time rules
                                     system_attrs={CONSTRAINTS_KEY: [peak(c) - USABLE]})


EAGER = [cfg(8), cfg(16), cfg(4), cfg(4, ck=2), cfg(2, ck=4), cfg(8, ck=4)]


def eager_trials() -> list[optuna.trial.FrozenTrial]:
    return [trial(c, eager_ms(c)) for c in EAGER]


def test_the_micro_step_factor_is_fitted_when_the_micro_step_count_varied_else_the_modes_prior():
    et = eager_trials()
    timing = StepTimeModel.fit(et, num_layers=LAYERS, device="cuda")
    seen = [cfg(8, "reduce-overhead", 1.0), cfg(4, "reduce-overhead", 1.0), cfg(8, "reduce-overhead", 0.5)]
    model = CompiledTimeModel.fit(et + [trial(c, compiled_ms(c, s=1.1, beta=0.2)) for c in seen], eager=timing,
                                  device="cuda")
    assert model.beta("bf16", "reduce-overhead") == pytest.approx(0.2)  # recovered (grid of 0.05)
    for unseen in (cfg(16, "reduce-overhead", 1.0), cfg(2, "reduce-overhead", 0.3)):
        assert model.predict(unseen) == pytest.approx(compiled_ms(unseen, s=1.1, beta=0.2), rel=0.02)
    # one trial cannot show beta: the mode's prior (one H200: 5.8 of 33 ms per micro-step), s from the trial
    one = CompiledTimeModel.fit([*et, trial(seen[0], compiled_ms(seen[0], s=1.1, beta=0.2))], eager=timing,
                                device="cuda")
    assert one.beta("bf16", "reduce-overhead") == MICRO_STEP_PRIOR["reduce-overhead"] == 0.18
    assert one.params("bf16", "reduce-overhead")[2] is True
    # the default mode keeps beta 1 when its trials say so (the earlier model, unchanged)
    default = [cfg(8, "default", 1.0), cfg(4, "default", 1.0)]
    fitted = CompiledTimeModel.fit(et + [trial(c, compiled_ms(c, s=0.9, beta=1.0)) for c in default], eager=timing,
                                   device="cuda")
    assert fitted.beta("bf16", "default") == pytest.approx(1.0)


def test_a_pair_without_trials_borrows_its_own_modes_beta_never_another_modes():
    et = eager_trials()
    timing = StepTimeModel.fit(et, num_layers=LAYERS, device="cuda")
    default = [cfg(8, "default", 1.0), cfg(4, "default", 1.0)]
    model = CompiledTimeModel.fit([*et, *(trial(c, compiled_ms(c, s=0.9, beta=1.0)) for c in default)], eager=timing,
                                  device="cuda")
    assert model.params("bf16", "reduce-overhead") == (pytest.approx(0.9, rel=0.02), pytest.approx(1 / 3), False)
    assert model.beta("bf16", "reduce-overhead") == MICRO_STEP_PRIOR["reduce-overhead"]  # not the default mode's 1.0
    assert model.beta("bf16", "default") == pytest.approx(1.0)
    # the same mode measured in another dtype: its s and its fitted beta
    graphs = [cfg(8, "reduce-overhead", 1.0), cfg(4, "reduce-overhead", 1.0)]
    fp16 = [BalanceConfig.from_dict({**c.to_dict(), "dtype": "fp16"}) for c in graphs]
    both = CompiledTimeModel.fit([*et, *(trial(c, compiled_ms(c, s=0.9, beta=1.0)) for c in default),
                                  *(trial(c, compiled_ms(c, s=1.2, beta=0.4)) for c in fp16)], eager=timing,
                                 device="cuda")
    assert both.beta("bf16", "reduce-overhead") == pytest.approx(0.4)
    assert both.params("bf16", "reduce-overhead")[0] == pytest.approx(both.params("fp16", "reduce-overhead")[0])


def _advisor(tmp_path, mode: str = "reduce-overhead") -> ModelAdvisor:
    """A one-GPU study's advisor searching eager and ``--compile-mode mode``."""
    script = tmp_path / "train.py"
    script.write_text("")
    settings = TuneSettings(script=str(script), device="cuda", nproc_per_node=1, memory_cap_gib=[USABLE],
                            headroom=0.0, compile="search", compile_mode=mode)
    space = SearchSpace.build(world_size=1, global_batch=32, num_layers=LAYERS, dtypes=["bf16"], max_accumulation=16,
                              compile_modes=settings.compile_modes())
    return ModelAdvisor(space=space, settings=settings)


def test_a_study_that_asks_for_cuda_graphs_gets_proposals_that_fit_and_learns_their_micro_step_cost(tmp_path):
    advisor = _advisor(tmp_path)
    assert advisor.space.compile_modes == ["off", "reduce-overhead"]
    study = optuna.create_study()
    study.set_user_attr("autobalance:reference_step_s", 0.1)
    for t in eager_trials():
        study.add_trial(t)
    graphs = [c for c in advisor.models.scored_candidates(study) if c.config.compile == "reduce-overhead"]
    assert graphs and all(p <= USABLE * GIB for c in graphs for p in c.peaks)
    # after two of its trials with different micro-step counts the model knows their cost
    for c in (cfg(8, "reduce-overhead", 1.0), cfg(4, "reduce-overhead", 1.0)):
        study.add_trial(trial(c, compiled_ms(c, s=1.1, beta=0.2)))
    advisor.models.scored_candidates(study)
    again = {c.config.to_json(): c for c in advisor.models.scored_candidates(study)}
    for c in again.values():
        if c.config.compile == "reduce-overhead":
            assert c.step_ms == pytest.approx(compiled_ms(c.config, s=1.1, beta=0.2), rel=0.03)


# ------------------------------------------------------------------ the probe (--compile-mode auto)


def test_auto_searches_cuda_graphs_at_world_size_1_on_a_gpu_only(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")

    def modes(**kw) -> list[str]:
        return TuneSettings(script=str(script), compile_mode="auto", **kw).compile_modes()

    assert modes(device="cuda", nproc_per_node=1) == ["off", "default", "reduce-overhead"]
    assert modes(device="cuda", nproc_per_node=2) == ["off", "default"]  # DDP: no CUDA graphs
    assert modes(device="cpu", nproc_per_node=1, compile="on") == ["default"]
    assert TuneSettings(script=str(script), device="cuda", nproc_per_node=1).compile_modes() == ["off", "default"]


def _auto_study(tmp_path, graph_ms: float | None):
    """Eager trials, two default-mode compiled ones (8 x 4 the faster) and, when given, the probe:
    8 x 4 with CUDA graphs at ``graph_ms``."""
    advisor = _advisor(tmp_path, "auto")
    study = optuna.create_study()
    study.set_user_attr("autobalance:reference_step_s", 0.1)
    default = [cfg(8, "default", 1.0), cfg(4, "default", 1.0)]
    trials = eager_trials() + [trial(c, compiled_ms(c, s=0.5, beta=1.0)) for c in default]  # 8 x 4: the best trial
    if graph_ms is not None:
        trials.append(trial(cfg(8, "reduce-overhead", 1.0), graph_ms))
    for t in trials:
        study.add_trial(t)
    return advisor, study, trials[len(EAGER)]


def _history(advisor: ModelAdvisor, study: optuna.Study) -> TrialHistory:
    return TrialHistory.from_trials(study.get_trials(), space=advisor.space, usable=[USABLE * GIB])


def test_cuda_graphs_are_first_measured_at_the_best_default_mode_configuration(tmp_path):
    advisor, study, best = _auto_study(tmp_path, graph_ms=None)
    trials = study.get_trials()
    assert graphs_verdict(trials, "bf16") == "untried"
    # no model proposes them before a probe: the default mode's fit says nothing of launch time
    assert not [c for c in advisor.models.scored_candidates(study) if c.config.compile == "reduce-overhead"]
    probe = graph_probe(trials, best=best, modes=advisor.space.compile_modes, dtypes=["bf16"])
    assert probe == BalanceConfig.from_dict({**best.user_attrs["config"], "compile": "reduce-overhead"})
    assert graph_probe(trials, best=trials[0], modes=advisor.space.compile_modes, dtypes=["bf16"]) is None  # eager
    assert graph_probe(trials, best=best, modes=["off", "default"], dtypes=["bf16"]) is None  # not searched
    advisor.models.decision = Decision(study, num_layers=advisor.space.num_layers, device="cuda")
    proposal = cuda_graphs_phase(advisor.policy, _history(advisor, study))  # the cuda-graphs phase: proposed once
    assert proposal is not None and proposal.phase == "cuda-graphs" and proposal.config is not None
    assert proposal.config.compile == "reduce-overhead" and "CUDA graphs" in proposal.reason
    advisor.models.proposed.add(proposal.config.to_json())  # what before_ask does when it enqueues it
    assert cuda_graphs_phase(advisor.policy, _history(advisor, study)) is None


@pytest.mark.parametrize(("gain", "verdict"), [(0.05, "pays"), (0.01, "no-gain")])
def test_after_the_probe_graphs_are_proposed_only_where_they_paid(tmp_path, gain, verdict):
    twin = compiled_ms(cfg(8, "default", 1.0), s=0.5, beta=1.0)
    advisor, study, best = _auto_study(tmp_path, graph_ms=(1 - gain) * twin)
    trials = study.get_trials()
    assert graphs_verdict(trials, "bf16") == verdict
    assert graph_probe(trials, best=best, modes=advisor.space.compile_modes, dtypes=["bf16"]) is None  # done
    graphs = [c for c in advisor.models.scored_candidates(study) if c.config.compile == "reduce-overhead"]
    assert bool(graphs) == (verdict == "pays")
