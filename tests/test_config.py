from __future__ import annotations

import pytest

from autobalance import BalanceConfig, ConfigError, micro_step_sizes, split_evenly
from autobalance._config import split_at_least


def make(**kw):
    base = dict(micro_batches=[3, 5], accumulation=2, global_batch=16)
    base.update(kw)
    return BalanceConfig(**base)


def test_round_trip_every_field():
    cfg = make(checkpoint=[[2, 0], []], dtype="bf16", bucket_cap_mb=7.5, gradient_as_bucket_view=True)
    again = BalanceConfig.from_json(cfg.to_json())
    assert again == cfg
    assert again.checkpoint == [[0, 2], []]
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (dict(global_batch=15), ["global_batch=15", "sum(micro_batches)"]),
        (dict(dtype="fp8"), ["dtype='fp8'", "fp32, bf16, fp16"]),
        (dict(micro_batches=[0, 8], global_batch=16), ["micro_batches=[0, 8]", "at least one"]),
        (dict(accumulation=0, global_batch=0), ["accumulation=0"]),
        (dict(checkpoint=[[0]]), ["checkpoint has 1 entries for 2 ranks"]),
        (dict(checkpoint=[[1, 1], []]), ["checkpoint[0]=[1, 1]"]),
        (dict(bucket_cap_mb=0), ["bucket_cap_mb=0"]),
        (dict(micro_batches="3,5"), ["micro_batches='3,5'"]),
        (dict(gradient_as_bucket_view=1), ["gradient_as_bucket_view=1"]),
    ],
)
def test_invalid_configs_give_one_line_errors(kw, words):
    with pytest.raises(ConfigError) as info:
        make(**kw)
    text = str(info.value)
    assert "\n" not in text
    for w in words:
        assert w in text


def test_validate_for_world_size_and_layers():
    cfg = make(checkpoint=[[0, 5], []])
    with pytest.raises(ConfigError, match="job has 4 ranks"):
        cfg.validate_for(world_size=4)
    with pytest.raises(ConfigError, match="names block 5 but the model has 4 blocks"):
        cfg.validate_for(world_size=2, num_layers=4)
    cfg.validate_for(world_size=2, num_layers=6)


def test_from_dict_rejects_unknown_fields_and_non_objects():
    with pytest.raises(ConfigError, match="unknown field"):
        BalanceConfig.from_dict({**make().to_dict(), "evil": 1})
    with pytest.raises(ConfigError, match="not a JSON object"):
        BalanceConfig.from_json("[1, 2]")
    with pytest.raises(ConfigError, match="malformed"):
        BalanceConfig.from_json("{nope")


@pytest.mark.parametrize("total", [2, 7, 16, 101])
@pytest.mark.parametrize("weights", [[1, 1], [0.1, 0.9], [3, 1, 1], [0, 0, 1, 5]])
def test_split_evenly_sums_and_minimum(total, weights):
    parts = split_evenly(total, [float(w) for w in weights])
    assert sum(parts) == total
    if total >= len(weights):
        assert min(parts) >= 1


def test_micro_step_sizes_differ_by_at_most_one_larger_first():
    assert micro_step_sizes(32, 6) == [6, 6, 5, 5, 5, 5]
    assert micro_step_sizes(32, 5) == [7, 7, 6, 6, 6]
    assert micro_step_sizes(8, 4) == [2, 2, 2, 2]
    for samples in range(1, 60):
        for steps in range(1, samples + 1):
            sizes = micro_step_sizes(samples, steps)
            assert sum(sizes) == samples and len(sizes) == steps
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_any_split_round_trips_and_shows_plainly():
    cfg = BalanceConfig.any_split(rank_samples=[32, 21], accumulation=6, checkpoint=[[0], []], dtype="bf16")
    assert cfg.global_batch == 53 and cfg.micro_batches == [6, 4]
    assert cfg.micro_step_sizes(0) == [6, 6, 5, 5, 5, 5] and cfg.micro_step_sizes(1) == [4, 4, 4, 3, 3, 3]
    assert cfg.split_lines() == ["rank 0: 6,6,5,5,5,5", "rank 1: 4,4,4,3,3,3"]
    assert cfg.samples_per_rank == [32, 21] and not cfg.equal_micro_batches
    again = BalanceConfig.from_json(cfg.to_json())
    assert again == cfg and again.to_dict()["rank_samples"] == [32, 21]
    # micro_batches may be given too, when consistent
    assert BalanceConfig(micro_batches=[6, 4], rank_samples=[32, 21], accumulation=6, global_batch=53,
                         checkpoint=[[0], []], dtype="bf16") == cfg


def test_equal_split_is_stored_in_the_old_form_and_old_forms_load():
    old = {"micro_batches": [3, 5], "accumulation": 2, "global_batch": 16, "checkpoint": [[], [1]],
           "dtype": "fp32", "bucket_cap_mb": 25.0, "gradient_as_bucket_view": False, "compile": "off",
           "activation_budget": None}
    cfg = BalanceConfig.from_dict(dict(old))
    assert cfg.to_dict() == old and cfg.equal_micro_batches
    assert cfg.samples_per_rank == [6, 10] and cfg.micro_step_sizes(1) == [5, 5]
    # the same split written as rank_samples is the same configuration, stored the old way
    same = BalanceConfig.any_split(rank_samples=[6, 10], accumulation=2, checkpoint=[[], [1]])
    assert same == cfg and "rank_samples" not in same.to_json()
    # a minimal old JSON (defaults left out) still loads
    assert BalanceConfig.from_json('{"micro_batches": [4], "global_batch": 4}').samples_per_rank == [4]


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (dict(rank_samples=[3, 10], accumulation=4, global_batch=13), ["rank_samples=[3, 10]", "at least 4"]),
        (dict(rank_samples=[7, 10], accumulation=2, global_batch=16), ["sums to 17", "global_batch=16"]),
        (dict(micro_batches=[3, 5], rank_samples=[7, 10], accumulation=2, global_batch=17),
         ["micro_batches=[3, 5]", "set it to [4, 5]"]),
        (dict(rank_samples=[], global_batch=0), ["rank_samples=[] is empty"]),
        (dict(rank_samples="7,10", global_batch=17), ["rank_samples='7,10'"]),
        (dict(global_batch=3), ["micro_batches=[] is empty"]),
    ],
)
def test_invalid_any_split_gives_one_line_errors(kw, words):
    with pytest.raises(ConfigError) as info:
        BalanceConfig(**kw)
    text = str(info.value)
    assert "\n" not in text
    for w in words:
        assert w in text


def test_from_dict_needs_micro_batches_or_rank_samples():
    with pytest.raises(ConfigError, match=r"lacks required field\(s\) \['micro_batches'\]"):
        BalanceConfig.from_dict({"global_batch": 4})
    assert BalanceConfig.from_dict({"rank_samples": [3, 2], "global_batch": 5}).micro_batches == [3, 2]


@pytest.mark.parametrize("total", [5, 13, 32, 97])
@pytest.mark.parametrize("minimum", [1, 2, 4])
def test_split_at_least(total, minimum):
    for weights in ([1.0, 1.0], [0.05, 1.0], [0.05, 0.05, 1.0]):
        if total < minimum * len(weights):
            continue
        parts = split_at_least(total, weights, minimum)
        assert sum(parts) == total and min(parts) >= minimum


def test_samples_within_keeps_largest_micro_batches_and_sums():
    from autobalance._config import samples_within

    # 32 samples, 6 micro-steps, one rank: largest 6 -> 36 capacity, 4 taken away
    assert samples_within([6], 6, 32) == [32]
    assert BalanceConfig.any_split(rank_samples=samples_within([6], 6, 32), accumulation=6).micro_batches == [6]
    # two ranks, the costlier one gives samples up first
    got = samples_within([5, 5], 4, 37, cost=[1.0, 1.5])
    assert sum(got) == 37 and got[1] < got[0]
    for largest, acc, total in (([3, 9, 4], 5, 77), ([1, 1], 3, 6), ([7], 1, 7), ([2, 8], 3, 22)):
        got = samples_within(largest, acc, total)
        assert sum(got) == total and all(acc <= s <= b * acc for s, b in zip(got, largest, strict=True))
    with pytest.raises(ValueError, match="outside"):
        samples_within([2, 2], 3, 13)
