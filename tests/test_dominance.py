"""Model-free OOM prediction by dominance: a configuration that needs at least as much memory on a
rank as a measured trial that did not fit there is recorded as predicted, never launched (fast)."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from autobalance import BalanceConfig
from autobalance.tuner import SearchSpace, TuneSettings
from autobalance.tuner.search import ModelAdvisor, dominating_over_cap

USABLE = [1.0, 1.0]


def compiled(micro: list[int], budget: list[float], **kw: object) -> BalanceConfig:
    return BalanceConfig(micro_batches=micro, global_batch=16, compile="default", activation_budget=budget, **kw)


def measured(cfg: BalanceConfig, peaks: list[float | None], *, status: str = "ok",
             failing_rank: int | None = None) -> optuna.trial.FrozenTrial:
    attrs = {"config": cfg.to_dict(), "status": status, "peak_device_gib": peaks, "usable_gib": USABLE}
    if failing_rank is not None:
        attrs["failing_rank"] = failing_rank
    return optuna.trial.create_trial(state=TrialState.COMPLETE, value=1.0, user_attrs=attrs)


def test_a_trial_over_the_cap_on_rank0_implies_every_config_that_needs_more_there():
    over = measured(compiled([10, 6], [0.5, 0.8]), [1.2, 0.7])  # judged: rank 0 over its usable memory
    trials = [over]
    assert dominating_over_cap(trials, compiled([11, 5], [0.5, 0.3]))[1] == 0  # more samples, same budget
    assert dominating_over_cap(trials, compiled([10, 6], [0.6, 0.1]))[1] == 0  # same samples, larger budget
    assert dominating_over_cap(trials, compiled([10, 6], [0.5, 0.8], bucket_cap_mb=50)) is not None
    # anything that may need less on rank 0 is launched
    assert dominating_over_cap(trials, compiled([9, 7], [0.5, 0.8])) is None  # fewer samples
    assert dominating_over_cap(trials, compiled([12, 4], [0.4, 0.8])) is None  # more recomputation
    assert dominating_over_cap(trials, compiled([10, 6], [0.5, 0.8], bucket_cap_mb=10)) is None  # smaller buckets
    assert dominating_over_cap(trials, compiled([10, 6], [0.5, 0.8], dtype="bf16")) is None  # another dtype
    eager = BalanceConfig(micro_batches=[12, 4], global_batch=16)
    assert dominating_over_cap(trials, eager) is None  # another compile mode
    # rank 1 fitted (0.7 <= 1.0): more on rank 1 implies nothing
    assert dominating_over_cap(trials, compiled([2, 14], [0.1, 1.0])) is None


def test_views_and_checkpointing_count_as_less_memory():
    base = BalanceConfig(micro_batches=[9, 7], global_batch=16, checkpoint=[[0, 1], []], gradient_as_bucket_view=True)
    trials = [measured(base, [None, None], status="oom", failing_rank=0)]
    fewer_ckpt = BalanceConfig(micro_batches=[9, 7], global_batch=16, checkpoint=[[0], []], gradient_as_bucket_view=True)
    more_ckpt = BalanceConfig(micro_batches=[9, 7], global_batch=16, checkpoint=[[0, 1, 2], []],
                              gradient_as_bucket_view=True)
    no_view = BalanceConfig(micro_batches=[9, 7], global_batch=16, checkpoint=[[0, 1], []])
    assert dominating_over_cap(trials, fewer_ckpt) == (trials[0], 0)
    assert dominating_over_cap(trials, no_view) == (trials[0], 0)  # without views the buckets are extra copies
    assert dominating_over_cap(trials, more_ckpt) is None
    viewed = [measured(no_view, [None, None], status="oom", failing_rank=0)]
    assert dominating_over_cap(viewed, base) is None


def test_an_oom_on_an_unknown_rank_implies_only_configs_that_need_more_everywhere():
    trials = [measured(compiled([8, 8], [0.5, 0.5]), [None, None], status="oom")]
    assert dominating_over_cap(trials, compiled([8, 8], [0.7, 0.5])) is not None
    assert dominating_over_cap(trials, compiled([9, 7], [0.5, 0.5])) is None  # rank 1 takes fewer samples
    # reused and unfinished trials are no evidence
    reused = measured(compiled([8, 8], [0.5, 0.5]), [1.5, 1.5])
    reused.user_attrs["reused_from"] = 3
    assert dominating_over_cap([reused], compiled([8, 8], [0.7, 0.7])) is None


def test_the_advisor_records_a_dominated_compiled_config_as_predicted(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    settings = TuneSettings(script=str(script), device="cpu", nproc_per_node=2, memory_cap_gib=[1.0], headroom=0.0,
                            compile="on")
    space = SearchSpace.build(world_size=2, global_batch=16, num_layers=4, dtypes=["fp32"], max_accumulation=1,
                              compile_modes=["default"])
    advisor = ModelAdvisor(space=space, settings=settings)
    study = optuna.create_study()
    study.add_trial(measured(compiled([10, 6], [0.5, 0.8]), [1.2, 0.7]))
    figures, attrs = advisor.predict_infeasible(study, compiled([11, 5], [0.55, 0.8]))
    assert attrs["status"] == "predicted_oom" and attrs["predicted_by"] == "dominance" and attrs["dominated_by"] == 0
    assert "rank 0" in attrs["reason"] and "budget 0.5" in attrs["reason"]
    assert figures.memory_constraint(0.0) >= 1.0  # infeasible for the study
    assert attrs["peak_device_gib"] == [1.2, None]  # what was seen: a lower bound for this config
    assert advisor.predict_infeasible(study, compiled([9, 7], [0.5, 0.8])) is None  # may fit: launched
