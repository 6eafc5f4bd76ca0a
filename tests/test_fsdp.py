"""Parameter sharding with FSDP2 (``fully_shard``): the configuration field, the runtime against one
process on the whole global batch under torchrun (gloo, 2 and 3 ranks), save and resume, the
live-tensor peaks, the search's dimension."""

from __future__ import annotations

import pytest

from autobalance._config import BalanceConfig, describe_config
from autobalance._errors import ConfigError

# ------------------------------------------------------------------------------------ configuration


def test_param_sharding_round_trips_and_old_json_loads_unchanged() -> None:
    old = BalanceConfig(micro_batches=[2, 2], global_batch=4)
    assert old.param_sharding == "off" and old.keep_gathered == []
    assert "param_sharding" not in old.to_json() and "keep_gathered" not in old.to_json()
    cfg = BalanceConfig.any_split(rank_samples=[3, 5], accumulation=2, param_sharding="blocks",
                                  keep_gathered=["blocks", "embeddings"])
    assert cfg.keep_gathered == ["embeddings", "blocks"]  # one order, whatever the order given
    assert BalanceConfig.from_json(cfg.to_json()) == cfg
    assert describe_config(cfg).endswith("fsdp=blocks keep=embeddings+blocks")
    emb = BalanceConfig(micro_batches=[2, 2], global_batch=4, param_sharding="embeddings")
    assert describe_config(emb).endswith("bucket=25MB fsdp=embeddings")
    assert describe_config(emb.to_dict()) == describe_config(emb)  # the views read stored dicts


@pytest.mark.parametrize(("fields", "named"), [
    ({"param_sharding": "zero3"}, "param_sharding='zero3'"),
    ({"param_sharding": 1}, "param_sharding=1"),
    ({"keep_gathered": ["blocks"]}, "keep_gathered=['blocks']"),
    ({"param_sharding": "embeddings", "keep_gathered": ["blocks"]}, "keep_gathered=['blocks']"),
    ({"param_sharding": "blocks", "keep_gathered": ["blocks", "blocks"]}, "keep_gathered="),
    ({"param_sharding": "blocks", "keep_gathered": "blocks"}, "keep_gathered='blocks'"),
    ({"param_sharding": "blocks", "optimizer_sharding": "zero1"}, "optimizer_sharding='zero1'"),
    ({"param_sharding": "embeddings", "dtype": "fp16"}, "dtype='fp16'"),
    ({"param_sharding": "blocks", "compile": "default"}, "compile='default'"),
])
def test_bad_param_sharding_is_one_line_naming_field_value_and_fix(fields: dict, named: str) -> None:
    with pytest.raises(ConfigError) as err:
        BalanceConfig(micro_batches=[2, 2], global_batch=4, **fields)
    text = str(err.value)
    assert named in text and "\n" not in text and ("use" in text or "set" in text or "list" in text or "fix" in text)


def test_different_micro_step_counts_with_sharding_are_refused_before_launch() -> None:
    """A rank with fewer samples than micro-steps would run fewer micro-steps: with sharding every
    forward all-gathers, so the others would wait forever. Refused when the configuration is built
    (the tuner and ``plan()`` build it before any collective), in one line naming the field, the value
    and the fix."""
    with pytest.raises(ConfigError) as err:
        BalanceConfig.any_split(rank_samples=[2, 9], accumulation=3, param_sharding="embeddings")
    text = str(err.value)
    assert "\n" not in text
    assert "rank_samples=[2, 9]" in text and "param_sharding='embeddings'" in text
    assert "same number of micro-steps" in text and "at least 3 samples" in text
    # through the JSON a trial or production reads
    with pytest.raises(ConfigError, match="same number of micro-steps"):
        BalanceConfig.from_json('{"rank_samples": [2, 9], "accumulation": 3, "global_batch": 11, '
                                '"param_sharding": "blocks"}')
