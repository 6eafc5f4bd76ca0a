"""Issue 33, part 3: the configuration follows the GPU, not the rank number.

A saved configuration records each rank's device (the fingerprint's ``device_names``); a production
job that finds the same devices in another rank order runs each device's configuration on whatever
rank it came up as, and says so in one line. On CPU the device identity of an emulated slow rank is
the processor's name with the emulation appended (``runtime._emulate.device_identity``), so swapping
``AUTOBALANCE_EMULATE_MS_PER_SAMPLE`` between the ranks is the same machine in another rank order.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from autobalance import BalanceConfig
from autobalance._errors import ConfigError
from autobalance.runtime._emulate import device_identity
from autobalance.store import (
    ConfigStore,
    HardwareFingerprint,
    current_fingerprint,
    differences,
    minor_differences,
    rank_order,
)
from tests.conftest import torchrun

SHOW = "tests/scripts/show_plan.py"
SLOW_MS = "10"


def _fp(names: list[str], device_type: str = "cuda", capacity: list[int] | None = None) -> HardwareFingerprint:
    return HardwareFingerprint(device_type=device_type, device_name=" + ".join(dict.fromkeys(names)),
                               device_names=names, capacity_bytes=capacity or [80 * 2**30] * len(names),
                               world_size=len(names))


def test_rank_order_maps_each_rank_to_the_tuned_rank_of_its_device() -> None:
    tuned = _fp(["A100", "V100"])
    assert rank_order(tuned, _fp(["V100", "A100"])) == [1, 0]
    assert rank_order(tuned, _fp(["A100", "V100"])) is None  # the same order: nothing moves
    assert rank_order(tuned, _fp(["A100", "A100"])) is None  # another set: differences() says how
    assert rank_order(tuned, dataclasses.replace(_fp(["V100", "A100"]), device_names=[])) is None  # not recorded
    # identical devices keep their relative order (never swap), whatever the others do
    assert rank_order(_fp(["a", "b", "a", "b"]), _fp(["b", "a", "b", "a"])) == [1, 0, 3, 2]
    assert rank_order(_fp(["a", "a", "b"]), _fp(["b", "a", "a"])) == [2, 0, 1]


def test_permuted_config_moves_every_per_rank_field_and_keeps_the_step() -> None:
    config = BalanceConfig.any_split(rank_samples=[23, 9, 16], accumulation=2, checkpoint=[[], [0, 1], [2]],
                                     optimizer_sharding="zero1", optimizer_shares=[0.5, 0.2, 0.3])
    moved = config.permuted([1, 2, 0])
    assert moved.samples_per_rank == [9, 16, 23]
    assert moved.micro_batches == [5, 8, 12]
    assert moved.checkpoint == [[0, 1], [2], []]
    assert moved.optimizer_shares == [0.2, 0.3, 0.5]
    assert (moved.global_batch, moved.accumulation) == (config.global_batch, config.accumulation)
    # each sample's weight is 1/global_batch on whichever rank it lands: the same multiset of micro-steps
    assert sorted(n for r in range(3) for n in moved.micro_step_sizes(r)) == \
        sorted(n for r in range(3) for n in config.micro_step_sizes(r))
    compiled = BalanceConfig(micro_batches=[3, 5], global_batch=8, compile="default", activation_budget=[0.4, 1.0])
    assert compiled.permuted([1, 0]).activation_budget == [1.0, 0.4]
    # every per-rank list of the configuration is one permuted() knows: a new one must be added there
    per_group = {"keep_gathered"}  # a list of FSDP2 groups (embeddings, blocks), the same on every rank
    per_rank = {f.name for f in dataclasses.fields(BalanceConfig)
                if (isinstance(getattr(config, f.name), list) or isinstance(getattr(compiled, f.name), list))
                and f.name not in per_group}
    assert per_rank == {"micro_batches", "rank_samples", "checkpoint", "activation_budget", "optimizer_shares"}
    with pytest.raises(ConfigError, match="not a permutation"):
        config.permuted([0, 0, 1])


def test_permuted_fingerprint_then_matches_and_another_set_still_differs() -> None:
    gib = 2**30
    tuned = _fp(["A100", "V100"], capacity=[80 * gib, 32 * gib])
    now = _fp(["V100", "A100"], capacity=[32 * gib, 80 * gib])
    assert differences(tuned, now)  # compared rank by rank, the memory differs
    order = rank_order(tuned, now)
    assert order is not None and differences(tuned.permuted(order), now) == []
    assert differences(tuned, _fp(["A100", "A100"], capacity=[80 * gib, 32 * gib])) == [
        "rank 1 GPU 'V100' (tuned) vs 'A100' (this job)"]
    cpu_tuned = dataclasses.replace(tuned, device_type="cpu", device_name="x")
    cpu_other = dataclasses.replace(cpu_tuned, device_names=["A100", "A100"])
    assert "rank 1 device 'V100' (tuned) vs 'A100' (this job)" in minor_differences(cpu_tuned, cpu_other)
    round_trip = HardwareFingerprint.from_dict(tuned.to_dict())
    assert round_trip == tuned
    legacy = {k: v for k, v in tuned.to_dict().items() if k not in ("device_names", "ms_per_sample")}
    assert HardwareFingerprint.from_dict(legacy).device_names == []  # saved before names were recorded


def test_device_identity_names_the_emulated_slowdown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOBALANCE_EMULATE_MS_PER_SAMPLE", f"0,{SLOW_MS}")
    fast, slow = device_identity(torch.device("cpu"), 0), device_identity(torch.device("cpu"), 1)
    assert fast != slow and slow.startswith(fast) and f"+{SLOW_MS} ms/sample" in slow


# ------------------------------------------------------------------ production, 2 gloo ranks


def _names(monkeypatch: pytest.MonkeyPatch, emulate: str) -> list[str]:
    monkeypatch.setenv("AUTOBALANCE_EMULATE_MS_PER_SAMPLE", emulate)
    return [device_identity(torch.device("cpu"), r) for r in range(2)]


@pytest.fixture
def tuned_fast_slow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, BalanceConfig]:
    """A configuration saved from a job whose rank 0 was fast and rank 1 slow: the slow one has
    fewer samples, a checkpointed block and the smaller optimizer share."""
    url = f"sqlite:///{tmp_path / 'best.db'}"
    config = BalanceConfig(micro_batches=[11, 5], global_batch=16, checkpoint=[[], [0]],
                           optimizer_sharding="zero1", optimizer_shares=[0.7, 0.3])
    fingerprint = current_fingerprint(device_type="cpu", world_size=2, device_names=_names(monkeypatch, f"0,{SLOW_MS}"))
    monkeypatch.delenv("AUTOBALANCE_EMULATE_MS_PER_SAMPLE")
    with ConfigStore(url=url) as store:
        store.save(study_name="mixed", trial_number=3, config=config, figures={}, fingerprint=fingerprint,
                   saved_by="test")
    return url, config


def _production(tmp_path: Path, url: str, emulate: str) -> tuple[str, dict[int, dict]]:
    out = tmp_path / f"plans-{emulate.replace(',', '-')}"
    out.mkdir()
    proc = torchrun([SHOW], timeout=120, env={"AUTOBALANCE_DEVICE": "cpu", "SHOW_PLAN_DIR": str(out),
                                              "AUTOBALANCE_STUDY": "mixed", "AUTOBALANCE_STORAGE": url,
                                              "AUTOBALANCE_EMULATE_MS_PER_SAMPLE": emulate})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {}
    for path in out.glob("rank*.json"):
        data = json.loads(path.read_text())
        found[data["rank"]] = data
    assert set(found) == {0, 1}
    return proc.stderr, found


@pytest.mark.slow
def test_production_with_the_slow_device_on_rank_0_runs_its_configuration_there(
        tuned_fast_slow: tuple[str, BalanceConfig], tmp_path: Path) -> None:
    """Tuned as [fast, slow]; production comes up as [slow, fast]: every rank applies the permuted
    configuration (rank 0 gets the slow device's 5 samples, block and 30 % of the state), the global
    batch is unchanged, and one line says so. Another set of devices is not remapped: it is warned
    about as any hardware difference."""
    url, config = tuned_fast_slow
    stderr, found = _production(tmp_path, url, f"{SLOW_MS},0")
    for data in found.values():
        got = BalanceConfig.from_dict(data["config"])
        assert got == config.permuted([1, 0]), got
        assert got.micro_batches == [5, 11] and got.checkpoint == [[0], []] and got.optimizer_shares == [0.3, 0.7]
        assert got.global_batch == config.global_batch
    lines = [line for line in stderr.splitlines() if "another rank order" in line]
    assert len(lines) == 1, stderr[-3000:]
    assert "rank 0" in lines[0] and "tuned rank 1" in lines[0] and "rank 1" in lines[0], lines[0]

    stderr, found = _production(tmp_path, url, "5,0")  # a different slow device: a different set
    assert all(BalanceConfig.from_dict(d["config"]) == config for d in found.values())
    assert "another rank order" not in stderr
    assert any("was tuned on" in line or "(tuned) vs" in line for line in stderr.splitlines()), stderr[-3000:]
