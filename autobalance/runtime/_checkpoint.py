"""Find a model's repeated blocks and activation-checkpoint a chosen subset of them."""

from __future__ import annotations

import os
from collections import Counter

from torch import nn

from autobalance import _env
from autobalance._errors import ConfigError

__all__ = ["apply_checkpointing", "find_blocks"]


def find_blocks(model: nn.Module, path: str | None = None) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks: the ``ModuleList`` at ``path``, or the largest one whose
    children all have the same type (e.g. a transformer's layers)."""
    if path is not None:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            raise ConfigError(
                f"blocks={path!r} is not a submodule of {type(model).__name__}; name a ModuleList "
                "such as 'transformer.h'."
            ) from None
        if not isinstance(found, (nn.ModuleList, nn.Sequential)):
            raise ConfigError(
                f"blocks={path!r} is a {type(found).__name__}, not a ModuleList; name the list of blocks."
            )
        return path, found  # type: ignore[return-value]
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        types = Counter(type(child) for child in module)
        if len(types) != 1:
            continue
        if best is None or len(module) > len(best[1]):
            best = (name, module)
    if best is None:
        return "", nn.ModuleList()
    return best


def apply_checkpointing(blocks: nn.ModuleList, indices: list[int]) -> None:
    """Wrap ``blocks[i]`` for each index in PyTorch's non-reentrant checkpoint wrapper.

    Non-reentrant checkpointing with ``preserve_rng_state=True`` replays dropout exactly; the
    wrapper strips its prefix from ``state_dict`` keys, so saved checkpoints stay compatible.
    """
    if not indices:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        checkpoint_wrapper,
    )

    preserve_rng = os.environ.get(_env.TEST_NO_RNG_PRESERVE) != "1"  # test-only: a known-wrong runtime
    for index in indices:
        if index >= len(blocks):
            raise ConfigError(
                f"checkpoint index {index} is out of range for {len(blocks)} blocks; use 0..{len(blocks) - 1}."
            )
        if isinstance(blocks[index], CheckpointWrapper):
            continue
        blocks[index] = checkpoint_wrapper(
            blocks[index], checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=preserve_rng
        )
