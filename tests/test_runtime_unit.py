"""Runtime pieces that need no process group."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from autobalance import BalanceConfig
from autobalance.runtime import (
    CpuMemoryTracker,
    apply_checkpointing,
    epoch_schedule,
    find_blocks,
    write_report,
)


@pytest.mark.parametrize("num_samples", [64, 67, 100, 3, 1])
@pytest.mark.parametrize(("mbs", "acc"), [([3, 5], 2), ([1, 7], 1), ([2, 2, 5], 3)])
def test_schedule_uses_every_sample_once_in_proportion(num_samples, mbs, acc):
    cfg = BalanceConfig(micro_batches=mbs, accumulation=acc, global_batch=sum(mbs) * acc)
    sched = epoch_schedule(num_samples=num_samples, config=cfg, epoch=0, seed=1)
    seen = [i for step in sched.steps for rank in step.micro_batches for mb in rank for i in mb]
    assert len(seen) == len(set(seen))
    assert len(seen) + sched.dropped == num_samples
    assert sched.dropped < len(mbs)
    for step in sched.steps[:-1] if sched.steps and sched.steps[-1].total < cfg.global_batch else sched.steps:
        for rank, size in enumerate(mbs):
            assert [len(mb) for mb in step.micro_batches[rank]] == [size] * acc
    for step in sched.steps:
        for rank, size in enumerate(mbs):
            assert step.micro_batches[rank], "every rank takes part in every step"
            assert all(0 < len(mb) <= size for mb in step.micro_batches[rank])


def test_schedule_deterministic_per_seed_and_epoch():
    cfg = BalanceConfig(micro_batches=[3, 5], accumulation=1, global_batch=8)
    a = epoch_schedule(num_samples=50, config=cfg, epoch=0, seed=1)
    b = epoch_schedule(num_samples=50, config=cfg, epoch=0, seed=1)
    c = epoch_schedule(num_samples=50, config=cfg, epoch=1, seed=1)
    assert a == b
    assert a != c


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.ReLU()) for _ in range(3)]
        )
        self.other = nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_find_blocks_picks_largest_uniform_list_and_named_path():
    net = Net()
    path, blocks = find_blocks(net)
    assert path == "layers" and len(blocks) == 3
    path, blocks = find_blocks(net, "other")
    assert path == "other" and len(blocks) == 1


def test_checkpointing_keeps_dropout_rng_and_state_dict_keys():
    torch.manual_seed(0)
    plain = Net()
    ckpt = Net()
    ckpt.load_state_dict(plain.state_dict())
    apply_checkpointing(ckpt.layers, [0, 2])
    assert set(ckpt.state_dict()) == set(plain.state_dict())
    x = torch.randn(4, 8)
    grads = []
    for model in (plain, ckpt):
        torch.manual_seed(123)
        model(x).square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.layers.parameters()]))
    assert torch.equal(grads[0], grads[1])


def test_cpu_tracker_counts_live_tensors_and_enforces_budget():
    with CpuMemoryTracker() as tracker:
        a = torch.zeros(1024, dtype=torch.float32)
        after_a = tracker.live_bytes
        b = torch.ones(2048, dtype=torch.float32)
        assert tracker.live_bytes - after_a == 8192
        del b
        assert tracker.live_bytes == after_a
        assert tracker.peak_bytes >= after_a + 8192
        view = a[:10]  # a view allocates nothing
        assert tracker.live_bytes == after_a
        del view
    with CpuMemoryTracker(budget_bytes=10_000) as tracker, pytest.raises(torch.OutOfMemoryError, match="budget"):
        torch.zeros(4096)


def test_report_written_atomically(tmp_path):
    path = write_report(str(tmp_path), 3, {"status": "ok"})
    assert json.loads(open(path).read()) == {"status": "ok"}
    assert os.listdir(tmp_path) == ["rank3.json"]
