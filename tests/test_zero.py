"""Uneven ZeRO-1 (issue 34): the partition, the configuration fields, and the sharded optimizer against
the plain one under torchrun (gloo, 2 and 3 ranks)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from autobalance._config import BalanceConfig, describe_config
from autobalance._errors import ConfigError, UsageError
from autobalance.runtime._zero import owner_ranges, partition
from tests.conftest import REPO, torchrun

# ------------------------------------------------------------------------------------ partition


def test_partition_is_contiguous_whole_parameters_within_one_parameter_of_each_share() -> None:
    rng = random.Random(5)
    for _ in range(300):
        sizes = [rng.choice([4, 64, 4096, rng.randint(1, 10_000)]) for _ in range(rng.randint(1, 40))]
        world = rng.randint(1, 5)
        raw = [rng.random() + (0.0 if rng.random() < 0.2 else 0.05) for _ in range(world)]
        shares = [w / sum(raw) for w in raw]
        counts = partition(sizes, shares)
        assert len(counts) == world and sum(counts) == len(sizes) and min(counts) >= 0
        total = sum(sizes)
        largest = max(sizes)
        for r, run in enumerate(owner_ranges(counts)):
            got = sum(sizes[i] for i in run)
            assert abs(got - shares[r] * total) <= largest, (sizes, shares, counts)


def test_partition_examples() -> None:
    assert partition([10] * 10, [0.5, 0.5]) == [5, 5]
    assert partition([10] * 10, [0.1, 0.9]) == [1, 9]
    assert partition([10] * 10, [0.0, 1.0]) == [0, 10]
    assert partition([100, 1, 1, 1], [0.5, 0.5]) == [1, 3]  # whole parameters: the big one alone
    assert partition([], [0.5, 0.5]) == [0, 0]
    with pytest.raises(UsageError, match="shares"):
        partition([1, 2], [0.5, 0.6])


# ------------------------------------------------------------------------------------ configuration


def test_config_sharding_fields_round_trip_and_old_json_loads() -> None:
    old = BalanceConfig(micro_batches=[2, 2], global_batch=4)
    assert old.optimizer_sharding == "off" and old.sharding_shares() is None
    assert "optimizer" not in old.to_json()  # stored as before sharding existed
    cfg = BalanceConfig(micro_batches=[2, 2], global_batch=4, optimizer_sharding="zero1", optimizer_shares=[0.2, 0.8])
    assert BalanceConfig.from_json(cfg.to_json()) == cfg
    assert describe_config(cfg).endswith("zero1 20%/80%")
    even = BalanceConfig(micro_batches=[2, 2], global_batch=4, optimizer_sharding="zero1")
    assert even.sharding_shares() == [0.5, 0.5]
    for bad, word in [({"optimizer_sharding": "zero3"}, "optimizer_sharding"),
                      ({"optimizer_shares": [0.5, 0.5]}, "optimizer_shares"),
                      ({"optimizer_sharding": "zero1", "optimizer_shares": [0.5, 0.6]}, "optimizer_shares"),
                      ({"optimizer_sharding": "zero1", "optimizer_shares": [1.0]}, "optimizer_shares"),
                      ({"optimizer_sharding": "zero1", "optimizer_shares": "even"}, "optimizer_shares")]:
        with pytest.raises(ConfigError, match=word):
            BalanceConfig(micro_batches=[2, 2], global_batch=4, **bad)


# ------------------------------------------------------------------------------------ under torchrun

_RUNS: dict[int, list[dict[str, Any]]] = {}


def zero_check(world: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if world not in _RUNS:
        out = Path(tmp_path_factory.mktemp(f"zero{world}")) / "zero.json"
        proc = torchrun([str(REPO / "tests/dist_scripts/zero_check.py"), str(out)], nproc=world, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _RUNS[world] = json.loads(out.read_text())
    return _RUNS[world]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_update_is_bitwise_the_plain_one(tmp_path_factory, world):
    """AdamW (foreach, fused, two parameter groups) and SGD with Nesterov momentum, clipping by global
    norm, an LR scheduler, accumulation 2 over an uneven any split, checkpointing on rank 0, uneven
    shares (one of them 0): 3 steps give bitwise the parameters of the plain optimizer; fp16 with a
    step whose gradients overflow on every rank skips that step on every rank, as the plain one does."""
    results = zero_check(world, tmp_path_factory)
    kinds = {r["kind"] for r in results}
    assert {"adamw", "sgd", "adamw-groups"} <= kinds
    for r in results:
        assert r["equal_steps"] == [True, True, True], r
        assert r["moved"] == r["params"], r  # every parameter changed: the check compared real updates
        assert r["lr_after"] == r["plain_lr_after"], r
        assert len(r["counts"]) == world and sum(r["counts"]) == r["params"], r
        if r["poison_step"] is not None:
            assert r["skipped"][r["poison_step"] - 1] is True, r  # the overflowed step changed nothing
    if world == 2:
        assert {"adamw-fused"} <= kinds
        assert any(r["dtype"] == "fp16" and r["poison_step"] == 1 for r in results)
        assert any(r["counts"][0] == 0 for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_state_dict_round_trips_and_state_bytes_follow_the_shares(tmp_path_factory, world):
    """The gathered state_dict equals the plain optimizer's bitwise; it loads into a plain optimizer and
    a plain state loads into a sharded one (one more step equal). Each rank's measured state bytes (the
    report's too) are its share of the whole within one parameter's state."""
    for r in zero_check(world, tmp_path_factory):
        assert r["state_equal"] and r["into_plain"] and r["into_sharded"], r
        assert sum(rank["state_bytes"] for rank in r["ranks"]) == r["total_state"], r
        for share, rank in zip(r["shares"], r["ranks"], strict=True):
            assert rank["reported"] == rank["state_bytes"], r
            assert abs(rank["state_bytes"] - share * r["total_state"]) <= r["largest_param_state"], r
