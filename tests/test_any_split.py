"""Any split of the global batch in the search (fast, no torchrun): the space expresses it, the
step-time model prices it, and the model strategy proposes, for each number of micro-steps, the
largest micro-batch that fits."""

from __future__ import annotations

import random

import optuna
import pytest

from autobalance import BalanceConfig
from autobalance._config import describe_config
from autobalance.tuner import SearchSpace, TuneSettings
from autobalance.tuner.search import ModelAdvisor, StepTimeModel

GIB = 2**30


def test_space_with_any_split_has_every_accumulation_for_a_prime_batch():
    any_ = SearchSpace.build(world_size=2, global_batch=31, num_layers=4, dtypes=["fp32"], max_accumulation=8,
                             any_split=True)
    equal = SearchSpace.build(world_size=2, global_batch=31, num_layers=4, dtypes=["fp32"], max_accumulation=8)
    assert any_.accumulations == list(range(1, 9)) and equal.accumulations == [1]
    assert SearchSpace.build(world_size=3, global_batch=7, num_layers=0, dtypes=["fp32"], max_accumulation=8,
                             any_split=True).accumulations == [1, 2]
    params = {"accumulation": 6, "share_r0": 1.0, "share_r1": 0.4, "ckpt_r0": 1, "ckpt_r1": 0, "dtype": "fp32",
              "bucket_cap_mb": 25.0, "grad_as_bucket_view": False}
    cfg = any_.config_from_params(params)
    assert cfg.global_batch == 31 and cfg.accumulation == 6 and sum(cfg.samples_per_rank) == 31
    assert not cfg.equal_micro_batches and any_.contains(cfg) and not equal.contains(cfg)


def test_space_round_trips_random_configurations_and_old_spaces_load_unchanged():
    rng = random.Random(0)
    for _ in range(200):
        world = rng.randint(1, 3)
        gb = rng.choice([7, 13, 31, 32, 53, 64, 97])
        space = SearchSpace.build(world_size=world, global_batch=gb, num_layers=3, dtypes=["fp32", "bf16"],
                                  max_accumulation=8, any_split=True)
        params = {"accumulation": rng.choice(space.accumulations), "dtype": rng.choice(space.dtypes),
                  "bucket_cap_mb": 25.0, "grad_as_bucket_view": False,
                  **{f"share_r{r}": rng.uniform(0.05, 1.0) for r in range(world) if world > 1},
                  **{f"ckpt_r{r}": rng.randint(0, 3) for r in range(world)}}
        cfg = space.config_from_params(params)
        assert space.config_from_params(space.params_from_config(cfg)) == cfg
    # a study from before any split stored its space without the flag: the old mapping, divisors only
    old = {"world_size": 2, "global_batch": 16, "num_layers": 0, "dtypes": ["fp32"], "accumulations": [1, 2, 4],
           "compile_modes": ["off"]}
    space = SearchSpace.from_dict(old)
    assert not space.any_split
    cfg = space.config_from_params({"accumulation": 4, "share_r0": 1.0, "share_r1": 0.3, "dtype": "fp32",
                                    "bucket_cap_mb": 25.0, "grad_as_bucket_view": False})
    assert cfg.equal_micro_batches and cfg.micro_batches == [3, 1] and cfg.accumulation == 4


def test_step_time_model_prices_each_rank_by_its_samples():
    model = StepTimeModel(a=4.0, b=20.0, g=12.0, k={"bf16": 1.5}, num_layers=8, prior={"bf16": 1.0})
    equal = BalanceConfig(micro_batches=[4, 4], accumulation=8, global_batch=64, dtype="bf16")
    assert model.predict(equal) == pytest.approx(4 + 8 * (20 + 1.5 * 4))  # the equal form, unchanged
    split = BalanceConfig.any_split(rank_samples=[32, 31], accumulation=6, dtype="bf16", checkpoint=[[], [0, 1]])
    assert model.predict(split) == pytest.approx(4 + max(6 * 20 + 1.5 * 32, 6 * (20 + 12 * 2 / 8) + 1.5 * 31))
    # fitted from trials of both forms, it recovers the same costs
    rng = random.Random(1)
    trials = []
    for _ in range(12):
        acc = rng.randint(1, 8)
        samples = [rng.randint(acc, acc + 20) for _ in range(2)]
        cfg = BalanceConfig.any_split(rank_samples=samples, accumulation=acc, dtype="bf16",
                                      checkpoint=[list(range(rng.randint(0, 8))), []])
        trials.append(optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=1.0, user_attrs={
            "status": "ok", "config": cfg.to_dict(), "step_time_ms": model.predict(cfg)}))
    fitted = StepTimeModel.fit(trials, num_layers=8, device="cuda")
    assert fitted.predict(split) == pytest.approx(model.predict(split), rel=1e-3)


def _study_with_trials(settings: TuneSettings, space: SearchSpace) -> optuna.Study:
    """One rank, a linear memory (1 GiB + 0.25 GiB per sample of the largest micro-batch) and a
    launch-bound step time (20 ms per micro-step + 1 ms per sample): measured equal-form trials."""
    study = optuna.create_study()
    study.set_user_attr("autobalance:reference_step_s", 0.2)
    for m, acc, ckpt in ((1, 32, 0), (2, 16, 0), (4, 8, 0), (2, 16, 4), (4, 8, 2), (1, 32, 2)):  # ckpt saves nothing
        cfg = BalanceConfig(micro_batches=[m], accumulation=acc, global_batch=32, dtype="fp32", bucket_cap_mb=25.0,
                            gradient_as_bucket_view=True, checkpoint=[list(range(ckpt))])
        study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=1.0, user_attrs={
            "status": "ok", "config": cfg.to_dict(), "peak_device_gib": [1.0 + 0.25 * m],
            "usable_gib": [2.8], "step_time_ms": 20.0 * acc + 32.0 + 10 * ckpt}))
    return study


@pytest.mark.parametrize("split", ["any", "equal"])
def test_the_model_proposes_the_largest_micro_batch_that_fits_for_each_accumulation(tmp_path, split):
    script = tmp_path / "train.py"
    script.write_text("")
    settings = TuneSettings(script=str(script), device="cpu", nproc_per_node=1, memory_cap_gib=[2.8], headroom=0.0,
                            split=split)
    space = SearchSpace.build(world_size=1, global_batch=32, num_layers=4, dtypes=["fp32"], max_accumulation=8,
                              any_split=split == "any")
    advisor = ModelAdvisor(space=space, settings=settings)
    candidates = advisor.models.candidates(_study_with_trials(settings, space))
    by_acc = {}
    for _, cfg in candidates:
        by_acc.setdefault(cfg.accumulation, cfg)
    # usable 2.8 GiB / (1 + 5 % model margin) = 2.67 GiB: micro-batches of up to 6 fit, 8 does not
    if split == "equal":
        assert sorted(by_acc) == [8] and candidates[0][1].micro_batches == [4]  # 4 x 8 micro-steps: 8 does not fit
    else:
        assert sorted(by_acc) == [6, 7, 8]
        best = candidates[0][1]
        assert best.accumulation == 6 and best.split_lines() == ["rank 0: 6,6,5,5,5,5"]
        assert by_acc[7].micro_step_sizes(0) == [5, 5, 5, 5, 4, 4, 4]
        assert describe_config(best).startswith("rank 0: 6,6,5,5,5,5 | ")


def test_a_model_without_blocks_gets_no_checkpointing_proposals(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    settings = TuneSettings(script=str(script), device="cpu", nproc_per_node=1, memory_cap_gib=[2.8], headroom=0.0)
    space = SearchSpace.build(world_size=1, global_batch=32, num_layers=0, dtypes=["fp32"], max_accumulation=8,
                              any_split=True)
    study = optuna.create_study()
    for m, acc in ((1, 32), (2, 16), (4, 8)):
        cfg = BalanceConfig(micro_batches=[m], accumulation=acc, global_batch=32)
        study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=1.0, user_attrs={
            "status": "ok", "config": cfg.to_dict(), "peak_device_gib": [1.0 + 0.25 * m], "usable_gib": [2.8],
            "step_time_ms": 20.0 * acc + 32.0}))
    candidates = ModelAdvisor(space=space, settings=settings).models.candidates(study)
    assert candidates and all(cfg.checkpoint == [[]] for _, cfg in candidates)
    assert max(max(cfg.micro_batches) for _, cfg in candidates) == 6  # 2.8 GiB / 1.05 margin: at most 6 fit


def _two_rank_study() -> optuna.Study:
    """Two ranks of different memory: rank 0 peaks at 1 GiB + 0.25 GiB per sample of its LARGEST
    micro-batch (usable 2.8 GiB), rank 1 at 1.2 GiB + 0.25 GiB per sample (usable 2.0 GiB); a
    launch-bound step (20 ms per micro-step + 1 ms per sample of the busier rank). Measured any-split
    trials of a prime global batch, 31."""
    study = optuna.create_study()
    study.set_user_attr("autobalance:reference_step_s", 0.2)
    for samples, acc in (([23, 8], 8), ([16, 15], 8), ([25, 6], 6), ([21, 10], 7), ([26, 5], 5), ([10, 21], 7)):
        cfg = BalanceConfig.any_split(rank_samples=samples, accumulation=acc, bucket_cap_mb=25.0,
                                      gradient_as_bucket_view=True)
        peaks = [1.0 + 0.25 * cfg.micro_batches[0], 1.2 + 0.25 * cfg.micro_batches[1]]
        study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=1.0, user_attrs={
            "status": "ok", "config": cfg.to_dict(), "peak_device_gib": peaks, "usable_gib": [2.8, 2.0],
            "step_time_ms": 20.0 * acc + max(samples) + 5.0}))
    return study


@pytest.mark.parametrize("split", ["any", "equal"])
def test_the_model_proposes_per_rank_the_largest_micro_batch_that_fits(tmp_path, split):
    """Per rank, not only on one: with 2.8 / 1.05 GiB rank 0 holds micro-batches of up to 6, rank 1
    (2.0 / 1.05 GiB) up to 2, so 31 samples need at least 4 micro-steps, as 6,6,6,5 and 2,2,2,2.
    Fails if the memory model learns from a trial's mean micro-batch instead of its largest (the
    peaks then look costlier per sample and 6 no longer fits), if the solver does not fill each
    rank up to what fits, or if the equal form (31 is prime: 1 micro-step only) proposes anything."""
    script = tmp_path / "train.py"
    script.write_text("")
    settings = TuneSettings(script=str(script), device="cpu", nproc_per_node=2, memory_cap_gib=[2.8, 2.0],
                            headroom=0.0, split=split)
    space = SearchSpace.build(world_size=2, global_batch=31, num_layers=0, dtypes=["fp32"], max_accumulation=8,
                              any_split=split == "any")
    candidates = ModelAdvisor(space=space, settings=settings).models.candidates(_two_rank_study())
    if split == "equal":
        assert candidates == []  # 31 on 2 ranks in 1 micro-step: 16 + 15 at once fit on neither rank
        return
    assert candidates
    for _, cfg in candidates:  # every proposal fits on each rank by its largest micro-batch
        assert cfg.global_batch == 31 and cfg.micro_batches[0] <= 6 and cfg.micro_batches[1] <= 2, cfg
        for r in range(2):
            sizes = cfg.micro_step_sizes(r)
            assert max(sizes) - min(sizes) <= 1 and max(sizes) == cfg.micro_batches[r]
    fewest = min(cfg.accumulation for _, cfg in candidates)
    first = next(cfg for _, cfg in candidates if cfg.accumulation == fewest)
    assert fewest == 4 and first.micro_batches == [6, 2]
    assert first.split_text() == "rank 0: 6,6,6,5; rank 1: 2,2,2,2"
    assert candidates[0][1].accumulation == 4  # the fewest micro-steps is also the fastest here
