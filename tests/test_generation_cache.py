"""A checkpointed block that appends to a generation cache (Hugging Face models whose config says
``use_cache``: transformers 4.x builds the cache in training too) appended its keys again when it was
recomputed, and torch stopped the backward with ``CheckpointError``: HF's ``BalanceTrainer`` on
transformers 4.57.6 failed every trial that checkpointed a block. The runtime switches the cache off
when any rank checkpoints (``runtime/_checkpoint.without_generation_cache``), as transformers does under
its own gradient checkpointing. Here a small model caches the way those models do."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

from autobalance.runtime import apply_checkpointing
from autobalance.runtime._checkpoint import without_generation_cache


class _Cache:
    def __init__(self) -> None:
        self.keys: list[torch.Tensor | None] = [None, None]


class _Block(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.key = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: _Cache | None) -> torch.Tensor:
        k = self.key(x)
        if cache is not None:  # this step's keys joined to the cached ones, as attention with a cache does
            old = cache.keys[self.index]
            cache.keys[self.index] = k if old is None else torch.cat([old, k], dim=1)
            k = cache.keys[self.index]
        return x + torch.tanh(k).mean(dim=1, keepdim=True)


class _CachingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(use_cache=True)
        self.blocks = nn.ModuleList([_Block(0), _Block(1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = _Cache() if self.config.use_cache else None
        for block in self.blocks:
            x = block(x, cache)
        return x


def _step(model: nn.Module) -> torch.Tensor:
    torch.manual_seed(0)
    model(torch.randn(2, 5, 8)).square().mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_a_checkpointed_block_that_caches_fails_its_recomputation_without_the_switch() -> None:
    """The failure the switch prevents (the test below is not vacuous)."""
    torch.manual_seed(0)
    model = _CachingModel()
    apply_checkpointing(model.blocks, [0])
    with pytest.raises(CheckpointError, match="different metadata"):
        _step(model)


def test_the_cache_is_switched_off_when_any_rank_checkpoints_and_the_step_is_unchanged() -> None:
    torch.manual_seed(0)
    reference = _CachingModel()
    torch.manual_seed(0)
    model = _CachingModel()
    apply_checkpointing(model.blocks, [0])
    assert without_generation_cache(model, [[0], []]) is True
    assert model.config.use_cache is False
    grads = _step(model)
    reference.config.use_cache = False  # the cache never changes the step: the same gradients without it
    assert torch.equal(grads, _step(reference))


def test_a_caching_model_inside_another_module_is_switched_off_too() -> None:
    """A Hugging Face model inside a LightningModule (or any wrapper): the wrapper has no config."""
    outer = nn.Module()
    outer.inner = _CachingModel()
    assert without_generation_cache(outer, [[0], []]) is True
    assert outer.inner.config.use_cache is False


@pytest.mark.parametrize(("checkpoint", "config"), [
    ([[], []], SimpleNamespace(use_cache=True)),  # nothing recomputed: the model is left as it is
    ([[1], []], SimpleNamespace(use_cache=False)),
    ([[1], []], SimpleNamespace()),
    ([[1], []], None),
])
def test_the_switch_leaves_other_models_alone(checkpoint: list[list[int]], config: object) -> None:
    model = nn.Linear(2, 2)
    if config is not None:
        model.config = config  # type: ignore[assignment]
    before = vars(config).copy() if config is not None else None
    assert without_generation_cache(model, checkpoint) is False
    assert (vars(config) if config is not None else None) == before


class _SelfCheckpointing(nn.Module):
    """Blocks with the flag Hugging Face models set on ``gradient_checkpointing_enable()``."""

    def __init__(self, own: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.blocks[0].gradient_checkpointing = own  # type: ignore[assignment]
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("own", [True, False])
def test_plan_wrap_warns_when_the_model_checkpoints_its_own_blocks(own: bool) -> None:
    """The configuration's checkpointing recomputes on top of the model's own, and what a study chooses
    for it then changes nothing but time: plan.wrap says so, with the fix; a model without it is quiet."""
    import warnings

    import autobalance as ab

    plan = ab.plan(micro_batch=2, device="cpu", checkpoint=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan.wrap(_SelfCheckpointing(own))
    said = [str(w.message) for w in caught if "checkpoint their own blocks" in str(w.message)]
    if own:
        assert len(said) == 1 and "blocks.0 checkpoint their own blocks" in said[0], said
        assert "model.gradient_checkpointing_disable()" in said[0] and "plan(checkpoint=N)" in said[0]
    else:
        assert said == []


def test_a_hugging_face_models_own_checkpointing_is_seen() -> None:
    """The flag is the one transformers really sets (the duck typing holds for the installed version)."""
    transformers = pytest.importorskip("transformers")
    from autobalance.runtime._checkpoint import own_checkpointing

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=16,
                                                                  n_layer=2, n_head=2))
    assert own_checkpointing(model) == []
    model.gradient_checkpointing_enable()
    assert own_checkpointing(model) != []
    model.gradient_checkpointing_disable()
    assert own_checkpointing(model) == []
