from __future__ import annotations

import pytest

from autobalance import BalanceConfig, ConfigError, split_evenly


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
