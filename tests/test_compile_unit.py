"""Compile and verification pieces that need no process group (fast)."""

from __future__ import annotations

import json
import math

import optuna
import pytest
import torch

from autobalance import BalanceConfig, ConfigError
from autobalance._config import describe_config
from autobalance.protocol import RankReport, RankTiming, Status
from autobalance.tuner import SearchSpace, TuneSettings
from autobalance.tuner._verify import load_config_file
from autobalance.tuner.search import (
    compile_figures,
    compile_notes,
    space_problem,
    typical_compile_s,
)
from autobalance.verify import Check, recomputes, without_recompute
from autobalance.verify import relative as _relative


def make(**kw):
    base = dict(micro_batches=[3, 5], global_batch=8)
    base.update(kw)
    return BalanceConfig(**base)


def test_compile_fields_round_trip_and_old_configs_load():
    cfg = make(compile="max-autotune-no-cudagraphs", activation_budget=[0.45, 1])
    again = BalanceConfig.from_json(cfg.to_json())
    assert again == cfg and again.activation_budget == [0.45, 1.0]
    old = {"micro_batches": [3, 5], "global_batch": 8, "checkpoint": [[0], []], "dtype": "fp32",
           "accumulation": 1, "bucket_cap_mb": 25.0, "gradient_as_bucket_view": False}  # stored before compile existed
    loaded = BalanceConfig.from_dict(old)
    assert loaded.compile == "off" and loaded.activation_budget is None


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (dict(compile="fast"), ["compile='fast'", "off, default, max-autotune-no-cudagraphs"]),
        (dict(compile=True), ["compile=True", "a string"]),
        (dict(activation_budget=[0.5, 0.5]), ["activation_budget=[0.5, 0.5]", "needs compile on"]),
        (dict(compile="default", activation_budget=[0.5]), ["activation_budget has 1 entries for 2 ranks"]),
        (dict(compile="default", activation_budget=[0.5, 1.5]), ["activation_budget[1]=1.5", "[0, 1]"]),
        (dict(compile="default", activation_budget=[-0.1, 1]), ["activation_budget[0]=-0.1"]),
        (dict(compile="default", activation_budget="0.5"), ["activation_budget='0.5'", "list of fractions"]),
        (dict(compile="default", activation_budget=[True, 1]), ["activation_budget=[True, 1]"]),
        (dict(compile="default", checkpoint=[[0, 1], []]), ["checkpoint[0]=[0, 1]", "compile='default'", "checkpoint=[]"]),
        (dict(compile="default", bucket_cap_mb=0.5), ["bucket_cap_mb=0.5", "compile='default'", ">= 1"]),
    ],
)
def test_invalid_compile_configs_give_one_line_errors(kw, words):
    with pytest.raises(ConfigError) as info:
        make(**kw)
    text = str(info.value)
    assert "\n" not in text
    for w in words:
        assert w in text


def test_budget_nan_is_rejected_from_json():
    with pytest.raises(ConfigError, match="malformed"):
        BalanceConfig.from_json('{"micro_batches": [3, 5], "global_batch": 8, "compile": "default", "activation_budget": [NaN, 1]}')


def space(modes):
    return SearchSpace.build(world_size=2, global_batch=16, num_layers=4, dtypes=["fp32", "bf16"], max_accumulation=2,
                             compile_modes=modes)


def test_space_without_compile_has_no_compile_parameters():
    s = space(["off"])
    assert not any(n.startswith(("compile", "budget_r")) for n in s.distributions())
    assert SearchSpace.from_dict({k: v for k, v in s.to_dict().items() if k != "compile_modes"}).compile_modes == ["off"]


def test_space_search_is_conditional_and_coherent():
    s = space(["off", "default"])
    assert SearchSpace.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    seen = set()
    for _ in range(40):
        trial = study.ask()
        cfg = s.suggest(trial)
        seen.add(cfg.compile)
        names = set(trial.params)
        if cfg.compile == "off":
            assert {"ckpt_r0", "ckpt_r1"} <= names and not any(n.startswith("budget_r") for n in names)
            assert cfg.activation_budget is None
        else:
            assert {"budget_r0", "budget_r1"} <= names and not any(n.startswith("ckpt_r") for n in names)
            assert cfg.checkpoint == [[], []]  # no double recomputation
            assert all(0.05 <= b <= 1.0 and abs(b * 20 - round(b * 20)) < 1e-9 for b in cfg.activation_budget)
        assert s.contains(cfg)
        # the parameters describe the configuration (enqueueing it gives it back)
        assert s.config_from_params(s.params_from_config(cfg)) == cfg
        study.tell(trial, 1.0)
    assert seen == {"off", "default"}


def test_space_compile_on_only():
    s = space(["default"])
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    cfg = s.suggest(study.ask())
    assert cfg.compile == "default" and len(cfg.activation_budget) == 2
    assert not s.contains(make(micro_batches=[8, 8], global_batch=16))


def test_settings_compile_defaults_and_continued_study(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    cpu = TuneSettings(script=str(script), device="cpu")
    cuda = TuneSettings(script=str(script), device="cuda")
    assert cpu.compile_modes() == ["off"] and cuda.compile_modes() == ["off", "default"]
    on = TuneSettings(script=str(script), compile="on", compile_mode="max-autotune-no-cudagraphs")
    assert on.compile_modes() == ["max-autotune-no-cudagraphs"]
    assert space_problem(cpu, space(["off", "default"])) is None  # not given: the study's own
    assert "--compile=on" in space_problem(on, space(["off", "default"]))
    from autobalance import UsageError

    with pytest.raises(UsageError, match="--compile='yes'"):
        TuneSettings(script=str(script), compile="yes")
    with pytest.raises(UsageError, match="--compile-mode='off'"):
        TuneSettings(script=str(script), compile_mode="off")
    one = TuneSettings(script=str(script), device="cuda", nproc_per_node=1, compile="search",
                       compile_mode="reduce-overhead")
    assert one.compile_modes() == ["off", "reduce-overhead"]
    with pytest.raises(UsageError, match="--compile-mode=reduce-overhead with 2 ranks: CUDA graphs run at world size 1"):
        TuneSettings(script=str(script), device="cuda", nproc_per_node=2, compile_mode="reduce-overhead")


def test_compile_figures_and_notes():
    def report(rank, budget, secs, hits, misses):
        return RankReport(status=Status.ERROR, rank=rank, world_size=2, activation_budget=budget,
                          timing=RankTiming(compile_s=secs),
                          compile={"mode": "default", "cache": {"fx_graph_hits": hits, "fx_graph_misses": misses,
                                                                "dir": "/x"}})

    figures = compile_figures({0: report(0, 0.45, 30.0, 0, 4), 1: report(1, 0.8, 31.5, 0, 4)})
    assert figures == {"compile_s": 31.5, "activation_budget_used": [0.45, 0.8],
                       "compile_cache": {"fx_graph_hits": 0, "fx_graph_misses": 8}}
    assert compile_figures({0: RankReport(status=Status.ERROR, rank=0, world_size=1, compile={"mode": "off"})}) == {}

    class T:
        def __init__(self, attrs):
            self.user_attrs = attrs

    trials = [T({"compile_s": 30.0, "compile_cache": {"fx_graph_misses": 8}}),
              T({"compile_s": 5.0, "compile_cache": {"fx_graph_hits": 8}}),
              T({"compile_s": 5.0, "compile_cache": {"fx_graph_hits": 8}, "reused_from": 1}), T({})]
    lines, total = compile_notes(trials)
    assert total == 35.0
    assert "2 compiled trial(s) spent 35.0 s" in lines[0]
    assert "8 hit(s), 8 miss(es)" in lines[1] and "30.0 s with misses vs 5.0 s" in lines[1]


def test_the_summary_prices_a_compile_it_did_not_run_at_a_measured_median():
    """The upper median of the recorded compile times (a time some trial took); none recorded: None."""
    class T:
        def __init__(self, attrs):
            self.user_attrs = attrs

    assert typical_compile_s([T({}), T({"compile_s": None})]) is None
    assert typical_compile_s([T({"compile_s": 30.0}), T({"compile_s": 5.0}), T({"compile_s": 0.0})]) == 30.0
    assert typical_compile_s([T({"compile_s": 30.0}), T({"compile_s": 5.0}), T({"compile_s": 12.0})]) == 12.0


def test_describe_config_shows_compile_and_budget():
    text = describe_config(make(compile="default", activation_budget=[0.45, 0.8]))
    assert "budget 0.45;" in text and text.endswith("budget 0.8 | fp32 compile=default bucket=25MB")
    assert "ckpt" not in text
    assert "ckpt 0;" in describe_config(make(checkpoint=[[0], []]))


def test_recomputes_and_its_removal():
    assert not recomputes(make())
    assert recomputes(make(checkpoint=[[0], []]))
    assert not recomputes(make(compile="default"))
    assert not recomputes(make(compile="default", activation_budget=[1.0, 1.0]))
    assert recomputes(make(compile="default", activation_budget=[0.5, 1.0]))
    plain = without_recompute(make(compile="default", activation_budget=[0.5, 1.0]))
    assert plain.compile == "default" and plain.activation_budget is None
    assert without_recompute(make(checkpoint=[[0], [1]])).checkpoint == [[], []]


def test_relative_error_and_check_rule():
    a = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64), "b": torch.tensor([0.0])}
    b = {"w": torch.tensor([1.0, 2.0 + 1e-7], dtype=torch.float64), "b": torch.tensor([0.0])}
    rel, worst = _relative(a, b)
    assert rel == pytest.approx(1e-7 / math.sqrt(5 + 4e-7), rel=1e-3) and worst == "w"
    assert _relative({"z": torch.zeros(2)}, {"z": torch.zeros(2)})[0] == 0.0
    ok = Check(name="equivalence", runs=("tuned", "baseline"), grad_rel=5e-7, param_rel=1e-8, update_rel=1e-3,
               buffer_rel=0.0, tolerance=(1e-6, 1e-6, 1e-6), worst="w")
    bad = Check(name="equivalence", runs=("tuned", "baseline"), grad_rel=0.3, param_rel=1e-8, update_rel=0.5,
                buffer_rel=0.0, tolerance=(1e-6, 1e-6, 1e-6), worst="w")
    bad_buffers = Check(name="equivalence", runs=("tuned", "baseline"), grad_rel=5e-7, param_rel=1e-8,
                        update_rel=1e-3, buffer_rel=0.06, tolerance=(1e-6, 1e-6, 1e-6), worst="w")
    # the update is information only (Adam's first step amplifies noise); running statistics that
    # differ (a BatchNorm updated twice by a recomputation) fail
    assert ok.passed and not bad.passed and not bad_buffers.passed
    assert ok.to_dict()["passed"] is True


def test_config_file_accepts_plain_and_exported(tmp_path):
    cfg = make(compile="default", activation_budget=[0.5, 0.9])
    plain = tmp_path / "plain.json"
    plain.write_text(cfg.to_json())
    exported = tmp_path / "exported.json"
    exported.write_text(json.dumps({"format": "autobalance-config", "config": cfg.to_dict()}))
    assert load_config_file(str(plain)) == cfg == load_config_file(str(exported))
    from autobalance import UsageError

    with pytest.raises(UsageError, match="not JSON"):
        (tmp_path / "bad.json").write_text("{nope")
        load_config_file(str(tmp_path / "bad.json"))


@pytest.mark.parametrize("sizes, graphs", [([6, 6, 5, 5, 5, 5], 1), ([8, 8, 8, 8], 1)])
def test_a_rank_with_two_micro_step_sizes_compiles_one_graph(sizes, graphs):
    """An any split's two sizes share one graph with a dynamic batch dimension (issue 30): Dynamo
    traces once; a rank with one size keeps its static graph. (Dynamo's eager backend: the graph
    count is Dynamo's, whatever the backend.)"""
    import torch
    from torch._dynamo.utils import counters

    from autobalance.runtime._compile import CompileState

    torch._dynamo.reset()
    counters.clear()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    state = CompileState(mode="default", budget=None, sizes=sizes)
    state.backend = "eager"
    state.apply(model)
    assert state.dynamic_batch is (len(set(sizes)) > 1)
    for n in sizes * 2:
        x = torch.randn(n, 4)
        assert torch.allclose(model(x), model._call_impl(x))
    assert int(counters["stats"]["unique_graphs"]) == graphs
    torch._dynamo.reset()


def test_without_the_mark_two_sizes_compile_two_graphs():
    """What the mark saves: the same model and sizes, compiled as before, trace twice."""
    import torch
    from torch._dynamo.utils import counters

    from autobalance.runtime._compile import CompileState

    torch._dynamo.reset()
    counters.clear()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    state = CompileState(mode="default", budget=None, sizes=[6])
    state.backend = "eager"
    state.apply(model)
    for n in (6, 6, 5, 5):
        model(torch.randn(n, 4))
    assert int(counters["stats"]["unique_graphs"]) == 2
    torch._dynamo.reset()


def test_cuda_graph_mode_keeps_the_gradients_and_runs_at_world_size_one_only():
    """reduce-overhead (CUDA graphs): every micro-step begins a new graph step with every gradient
    allocated (the backward adds into them, not into a graph output the next replay overwrites);
    a DDP configuration asking for it is refused in one line."""
    from types import SimpleNamespace

    import torch

    from autobalance._errors import ConfigError
    from autobalance.runtime._compile import CompileState

    cfg = BalanceConfig(micro_batches=[4], accumulation=2, global_batch=8, dtype="bf16", compile="reduce-overhead",
                        activation_budget=[1.0])
    assert BalanceConfig.from_json(cfg.to_json()).compile == "reduce-overhead"
    with pytest.raises(ConfigError, match=r"compile='reduce-overhead' with 2 ranks: CUDA graphs run at world size 1"):
        BalanceConfig(micro_batches=[4, 4], global_batch=8, compile="reduce-overhead")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    state = CompileState(mode="reduce-overhead", budget=1.0, sizes=[4, 4])
    plan = SimpleNamespace(model=model, meter=SimpleNamespace(paused=lambda: "paused"))
    assert state.cuda_graphs and state.on_micro_step(plan) == "paused"  # type: ignore[arg-type]
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters() if p.requires_grad)
    assert model[0].bias.grad is None
    model(torch.ones(2, 4)).sum().backward()
    first = model[1].weight.grad
    state.on_micro_step(plan)  # type: ignore[arg-type]
    assert model[1].weight.grad is first  # kept: accumulation adds into it
    assert CompileState.keep_gradients(model) == 0
    assert not CompileState(mode="default", budget=1.0).cuda_graphs
