"""``plan.wrap()``'s pipeline: validate, checkpoint the chosen blocks, move, record, wrap in DDP (or,
with ``param_sharding`` on, shard with FSDP2: :mod:`~autobalance.runtime._fsdp`).

The parts' ``on_wrap`` / ``on_model_moved`` / ``on_wrapped`` hooks are called at their fixed points
(:mod:`~autobalance.runtime._parts`); ``plan.model``, ``plan.ddp`` and ``plan.model_info`` are set
here, ``plan.model`` before ``on_wrapped`` (the compile part reads it there); ``plan.sharded`` when sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from autobalance._errors import ConfigError
from autobalance.runtime._batch_dependent import batch_dependent_modules, dropout_modules
from autobalance.runtime._checkpoint import BlockRun, checkpoint_model, find_blocks
from autobalance.runtime._with_loss import ModelWithLoss

if TYPE_CHECKING:
    from autobalance.runtime._parts import Part
    from autobalance.runtime._plan import Plan

__all__ = ["embedding_facts", "model_facts", "wrap_model"]


def wrap_model(
    plan: Plan,
    model: nn.Module,
    *,
    parts: Sequence[Part],
    blocks: str | None,
    find_unused_parameters: bool,
    loss: Callable[..., torch.Tensor] | None,
    embeddings: Sequence[str] | None = None,
) -> nn.Module:
    """What :meth:`Plan.wrap` does (see its docstring); returns what the script trains."""
    config = plan.config
    path, block_list = find_blocks(model, blocks or plan.blocks_path)
    config.validate_for(world_size=plan.world_size, num_layers=len(block_list))
    for part in parts:
        part.on_wrap(plan, model)
    checkpoint_model(model, block_list, config.checkpoint, plan.rank)
    plan.block_run = block_list
    model = model.to(plan.device)
    for part in parts:
        part.on_model_moved(plan, model)
    plan.model_info = model_facts(model, blocks_path=path, num_blocks=len(block_list), compile=config.compile,
                                  find_unused_parameters=find_unused_parameters, loss_in_model=loss is not None)
    plan.model_info.update(embedding_facts(model, block_list, embeddings))
    plan.meter.on_model_moved(model)
    if loss is not None:
        model = ModelWithLoss(model, loss)
    plan.model = model
    wrapped: nn.Module = model
    if config.param_sharding != "off":
        from autobalance.runtime._fsdp import shard_model

        if find_unused_parameters:
            raise ConfigError(f"find_unused_parameters=True with param_sharding={config.param_sharding!r}: FSDP2 "
                              "reduces whatever gradients there are; drop the argument or use param_sharding='off'.")
        plan.sharded = shard_model(model, config=config, blocks=block_list, embeddings=embeddings, device=plan.device)
        plan.model_info["param_sharding"] = plan.sharded.to_dict()
    elif plan.world_size > 1 and dist.is_initialized():
        plan.ddp = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[plan.device.index] if plan.device.type == "cuda" else None,
            bucket_cap_mb=config.bucket_cap_mb,
            gradient_as_bucket_view=config.gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
        )
        wrapped = plan.ddp
    for part in parts:
        part.on_wrapped(plan, wrapped)
    return wrapped


def model_facts(
    model: nn.Module, *, blocks_path: str, num_blocks: int, compile: str, find_unused_parameters: bool,
    loss_in_model: bool,
) -> dict[str, Any]:
    """The report's ``model``: the blocks found, the parameters, and how the model was wrapped."""
    params = list(model.parameters())
    return {
        "blocks_path": blocks_path,
        "num_blocks": num_blocks,
        "num_parameters": sum(p.numel() for p in params),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "find_unused_parameters": find_unused_parameters,
        "compile": compile,
        "batch_dependent": batch_dependent_modules(model),
        "dropout_modules": sum(1 for m in dropout_modules(model) if isinstance(m.p, float) and m.p > 0),
        "loss_in_model": loss_in_model,
    }


def embedding_facts(model: nn.Module, blocks: BlockRun, names: Sequence[str] | None) -> dict[str, Any]:
    """The report's figures for parameter sharding (``model.embedding_bytes`` ...): the embedding-like
    modules' parameter bytes (:func:`~autobalance.runtime._fsdp.find_embeddings`), the largest of
    them, and the largest repeated block's; what the search predicts a sharding saves from."""
    from autobalance.runtime._fsdp import find_embeddings

    def size(module: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    found = find_embeddings(model, blocks, names)
    return {"embeddings": [name for name, _ in found],
            "embedding_bytes": sum(size(m) for _, m in found),
            "largest_embedding_bytes": max((size(m) for _, m in found), default=0),
            "largest_block_bytes": max((size(b) for b in blocks), default=0)}
