"""Block discovery in any container, batch-dependent layers, and checkpointing that leaves buffers
updated once per forward (in process, tiny models: fast)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from autobalance import BalanceConfig
from autobalance._errors import ConfigError
from autobalance.protocol import RankReport, Status
from autobalance.runtime._batch_dependent import BufferWatch, batch_dependent_modules
from autobalance.runtime._checkpoint import apply_checkpointing, find_blocks


class Block(nn.Module):
    def __init__(self, width: int = 8, norm: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width) if norm else nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.fc(x)))


class SequentialBody(nn.Module):
    """``model.body.layers``: six identical blocks in an nn.Sequential (the issue's script)."""

    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.body = nn.Module()
        self.body.layers = nn.Sequential(*[Block(norm=norm) for _ in range(6)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body.layers(self.embed(x)))


def test_blocks_in_a_nested_sequential_are_found():
    path, blocks = find_blocks(SequentialBody())
    assert path == "body.layers" and len(blocks) == 6 and all(isinstance(b, Block) for b in blocks)


def test_a_run_inside_a_mixed_sequential_is_found_and_checkpointed_in_place():
    model = nn.Sequential(nn.Linear(4, 8), *[Block() for _ in range(3)], nn.Linear(8, 2))
    path, blocks = find_blocks(model)
    assert len(blocks) == 3 and path == "[1..3]"
    apply_checkpointing(blocks, [0, 2])
    kinds = [type(m).__name__ for m in model]
    assert kinds == ["Linear", "CheckpointWrapper", "Block", "CheckpointWrapper", "Linear"]
    model(torch.randn(5, 4)).sum().backward()  # still runs, gradients flow


def test_composite_blocks_beat_a_pair_of_leaf_layers_and_the_largest_run_wins():
    class Gpt(nn.Module):  # two Embeddings side by side, then one block in a ModuleList
        def __init__(self, layers: int) -> None:
            super().__init__()
            self.tok = nn.Embedding(10, 8)
            self.pos = nn.Embedding(10, 8)
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])

    assert find_blocks(Gpt(1))[0] == "blocks"
    nested = nn.Sequential(nn.Sequential(*[Block() for _ in range(2)]), nn.Sequential(*[Block() for _ in range(4)]))
    path, blocks = find_blocks(nested)
    assert path == "1" and len(blocks) == 4
    assert len(find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))[1]) == 0


def test_no_blocks_error_points_to_blocks_argument():
    cfg = BalanceConfig(micro_batches=[2, 2], global_batch=4, checkpoint=[[0, 2], []])
    with pytest.raises(ConfigError, match=r"blocks=") as info:
        cfg.validate_for(world_size=2, num_layers=0)
    assert "use indices 0..-1" not in str(info.value)
    with pytest.raises(ConfigError, match="blocks="):
        find_blocks(SequentialBody(), "body")  # a plain Module, not a list of blocks


def test_batch_dependent_layers_are_detected_statically_and_by_their_buffer_writes():
    """Fails if BatchNorm is known only by its running buffers (one without them is missed), if
    InstanceNorm without running statistics counts, or if a custom layer writing a buffer in its
    forward is not caught (or one holding a constant buffer is)."""
    assert batch_dependent_modules(SequentialBody(norm=True)) == [
        f"body.layers.{i}.norm (BatchNorm1d)" for i in range(6)]
    assert batch_dependent_modules(SequentialBody()) == []
    # BatchNorm without running statistics has no buffer, yet normalises with the batch's statistics
    # in train mode (and always: train mode is its only mode); LayerNorm/GroupNorm are per sample
    stateless = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False), nn.GroupNorm(2, 4))
    assert batch_dependent_modules(stateless) == ["1 (BatchNorm1d)"]
    assert batch_dependent_modules(nn.Sequential(nn.InstanceNorm1d(4, track_running_stats=True),
                                                 nn.InstanceNorm1d(4))) == ["0 (InstanceNorm1d)"]

    class Ema(nn.Module):  # a custom layer that updates a buffer in its forward
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("avg", torch.zeros(4))
            self.register_buffer("const", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.avg.mul_(0.9).add_(0.1 * x.mean(0).detach())
            return x * self.const

    model = nn.Sequential(nn.Linear(4, 4), Ema())
    watch = BufferWatch(model)
    model(torch.randn(3, 4))
    watch.close()
    assert watch.found == ["1 (Ema)"]
    const_only = nn.Sequential(nn.Linear(4, 4))
    const_only.register_buffer("mask", torch.ones(4))
    watch = BufferWatch(const_only)
    const_only(torch.randn(3, 4))
    assert watch.found == []


def test_checkpointed_batchnorm_updates_its_running_statistics_once_per_step():
    torch.manual_seed(0)
    plain = SequentialBody(norm=True)
    ckpt = SequentialBody(norm=True)
    ckpt.load_state_dict(plain.state_dict())
    _, blocks = find_blocks(ckpt)
    apply_checkpointing(blocks, [0, 1, 2, 3, 4, 5])
    x = torch.randn(16, 4)
    for model in (plain, ckpt):
        model.train()
        model(x).square().mean().backward()
    for i in range(6):
        bn_plain = plain.body.layers[i].norm
        bn_ckpt = ckpt.body.layers[i]._checkpoint_wrapped_module.norm
        assert int(bn_ckpt.num_batches_tracked) == 1
        assert torch.equal(bn_ckpt.running_mean, bn_plain.running_mean)
        assert torch.equal(bn_ckpt.running_var, bn_plain.running_var)
    grads = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (plain, ckpt)]
    assert torch.allclose(grads[0], grads[1], rtol=0, atol=1e-6)


def _report(**sections: Any) -> RankReport:
    """The baseline's report, with the sections the script's facts are read from."""
    return RankReport(status=Status.OK, rank=0, world_size=2, **sections)


def test_a_study_keeps_a_batch_dependent_models_split_and_says_why():
    from autobalance.tuner._summary import keep_split, script_facts
    from autobalance.tuner.search import SearchSpace

    report = _report(model={"num_blocks": 6, "blocks_path": "body.layers",
                            "batch_dependent": ["body.layers.0.norm (BatchNorm1d)"]})
    space = SearchSpace.build(world_size=2, global_batch=32, num_layers=6, dtypes=["fp32"], max_accumulation=4)
    own = BalanceConfig(micro_batches=[16, 16], global_batch=32)
    assert keep_split(space, report=report, own=own, allow=False)
    assert space.accumulations == [1] and not any(n.startswith("share_r") for n in space.distributions())
    assert space.contains(BalanceConfig(micro_batches=[16, 16], global_batch=32, checkpoint=[[0], []]))
    assert not space.contains(BalanceConfig(micro_batches=[10, 22], global_batch=32))
    assert not space.contains(BalanceConfig(micro_batches=[8, 8], accumulation=2, global_batch=32))
    lines = script_facts(report, kept_split=True, allow=False, split="16,16")
    assert any("BatchNorm1d" in line and "stay the script's own" in line and "--allow-batch-dependent" in line
               for line in lines), lines
    free = SearchSpace.build(world_size=2, global_batch=32, num_layers=6, dtypes=["fp32"], max_accumulation=4)
    assert not keep_split(free, report=report, own=own, allow=True)
    assert "share_r0" in free.distributions()


def test_the_kept_split_is_the_scripts_own_even_when_it_is_uneven():
    """Fails if a batch-dependent model's study keeps the even split of the global batch instead of
    the script's own micro-batch per rank and accumulation (here 5 + 11, and an any split 3,2,2 /
    4,3,3): every trial would then change the script's train-mode step."""
    import optuna

    from autobalance.tuner._summary import keep_split
    from autobalance.tuner.search import SearchSpace

    report = _report(model={"num_blocks": 6, "batch_dependent": ["body.layers.0.norm (BatchNorm1d)"]})
    own = BalanceConfig(micro_batches=[5, 11], global_batch=16)
    space = SearchSpace.build(world_size=2, global_batch=16, num_layers=6, dtypes=["fp32", "bf16"], max_accumulation=4)
    assert keep_split(space, report=report, own=own, allow=False)
    assert space.accumulations == [1] and space.micro_total(1) == 16
    assert space.contains(BalanceConfig(micro_batches=[5, 11], global_batch=16, checkpoint=[[0], [0, 1]]))
    assert not space.contains(BalanceConfig(micro_batches=[8, 8], global_batch=16))  # the even split
    assert space.config_for([5, 11], 1, checkpoint=[[0], []]).micro_batches == [5, 11]
    assert not space.contains(space.config_for([8, 8], 1))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(5):
        cfg = space.suggest(study.ask())
        assert cfg.micro_batches == [5, 11] and cfg.accumulation == 1 and space.contains(cfg)
    again = SearchSpace.from_dict(space.to_dict())  # as the study keeps it
    assert again.kept_micro_batches == [5, 11] and again.contains(own)

    # an any split of the script's own (micro-batches that differ within a rank), accumulation 3
    own_any = BalanceConfig.any_split(rank_samples=[7, 10], accumulation=3)
    space = SearchSpace.build(world_size=2, global_batch=17, num_layers=6, dtypes=["fp32"], max_accumulation=4,
                              any_split=True)
    assert keep_split(space, report=report, own=own_any, allow=False)
    assert space.accumulations == [3]
    cfg = space.suggest(optuna.create_study().ask())
    assert cfg.rank_samples == [7, 10] and cfg.split_text() == "rank 0: 3,2,2; rank 1: 4,3,3" and space.contains(cfg)
    assert not space.contains(BalanceConfig.any_split(rank_samples=[8, 9], accumulation=3))

    # a study saved before the kept split was recorded: the even split, as then
    old = {k: v for k, v in SearchSpace.build(world_size=2, global_batch=16, num_layers=6, dtypes=["fp32"],
                                              max_accumulation=1).to_dict().items()
           if not k.startswith("kept_")}
    old["fixed_split"] = True
    assert SearchSpace.from_dict(old).contains(BalanceConfig(micro_batches=[8, 8], global_batch=16))


def test_a_study_without_blocks_says_so_first_and_how_to_name_them():
    from autobalance.tuner._summary import script_facts

    lines = script_facts(_report(model={"num_blocks": 0, "blocks_path": ""}), kept_split=False, allow=False, split="8,8")
    assert lines[0].startswith("No repeated blocks found") and "blocks=" in lines[0]


def test_checkpointing_restores_the_buffers_a_custom_layer_writes_in_its_forward():
    """Fails if the buffers of a checkpointed block are left as its recomputation wrote them (any
    layer, not only BatchNorm: the moving average below is updated twice without the protection)."""

    class EmaBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("avg", torch.zeros(4))
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            with torch.no_grad():
                self.avg.mul_(0.5).add_(0.5 * y.mean(0))
                self.calls.add_(1)
            return torch.tanh(y)

    torch.manual_seed(0)
    plain = nn.Sequential(*[EmaBlock() for _ in range(3)])
    ckpt = nn.Sequential(*[EmaBlock() for _ in range(3)])
    ckpt.load_state_dict(plain.state_dict())
    _, blocks = find_blocks(ckpt)
    apply_checkpointing(blocks, [0, 1, 2])
    x = torch.randn(5, 4)
    for model in (plain, ckpt):
        model(x).square().mean().backward()
    for name, value in plain.state_dict().items():
        assert torch.equal(ckpt.state_dict()[name], value), name
    assert all(int(b) == 1 for n, b in ckpt.named_buffers() if n.endswith("calls"))


def test_the_final_summary_repeats_why_the_split_was_kept_and_that_the_dataset_is_small():
    """The study's first lines are long gone when it ends: fails if the summary under the result
    (``summarise``'s notes, as ``tune`` prints them) drops the batch-dependent line or the
    small-dataset line, or repeats the line naming the blocks."""
    from types import SimpleNamespace

    import optuna
    from rich.console import Console

    from autobalance.cli._views import print_result
    from autobalance.protocol import StudyAttr
    from autobalance.tuner._summary import TuneResult, script_facts, summarise, summary_facts

    report = _report(model={"num_blocks": 6, "blocks_path": "body.layers",
                            "batch_dependent": ["body.layers.0.norm (BatchNorm1d)"]},
                     data={"samples": 20, "global_batch": 64, "steps_per_epoch": 1, "dropped": 0})
    facts = script_facts(report, kept_split=True, allow=False, split="32,32")
    assert [line.split(" ", 1)[0] for line in facts] == ["Blocks:", "Batch-dependent", "The"]
    study = optuna.create_study(directions=["minimize"])
    study.set_user_attr(StudyAttr.SCRIPT_FACTS, facts)
    assert summary_facts(study.user_attrs) == facts[1:]
    result = TuneResult(study_name="s", storage="sqlite:///x.db", trials_run=1, baseline=None, best=None, wall_s=1.0)
    summarise(study, result, cold_note=None, advisor=None, launched_here=set())
    assert result.notes[:2] == facts[1:]
    config = {"micro_batches": [32, 32], "accumulation": 1, "global_batch": 64, "checkpoint": [[0], []],
              "dtype": "fp32", "bucket_cap_mb": 25.0}
    result.best = result.baseline = SimpleNamespace(number=0, user_attrs={"config": config, "status": "ok"})
    console = Console(record=True, width=400)
    print_result(result, settings=SimpleNamespace(script="train.py"), console=console)
    said = " ".join(console.export_text().split())
    assert ("Batch-dependent layers (body.layers.0.norm (BatchNorm1d)): their train-mode step depends on which "
            "samples share a micro-batch, so the split and accumulation stay the script's own (32,32)") in said
    assert "The dataset has 20 samples, fewer than one global batch (64): every step is a partial step" in said
    assert "Blocks: 6" not in said
