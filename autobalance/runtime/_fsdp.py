"""Parameter sharding with FSDP2 (``torch.distributed.fsdp.fully_shard``): what ``plan.wrap`` does
instead of DDP when the configuration's ``param_sharding`` is on.

- ``embeddings``: each embedding-like module (:func:`find_embeddings`) is its own unit, sharded
  evenly over the ranks; the root (everything else) goes through FSDP2 on a (ranks, 1) mesh, i.e.
  replicated by FSDP2 itself (its gradients all-reduced, averaged over the ranks, as DDP does).
- ``blocks``: the embedding-like modules, every repeated block (checkpointed ones in their wrapper)
  and the root, each its own unit, all sharded over the ranks.

The whole model goes through FSDP2 either way (no DDP, no hand-made all-reduce). What stays exact:

- **Weighting.** FSDP2 averages gradients over the ranks (reduce-scatter, or all-reduce on the
  replicated root, divided by the world size) as DDP does, so ``plan.backward``'s loss weights
  (``world_size * count / step_total``, :mod:`~autobalance.runtime._weighting`) make the update the
  mean-loss gradient over the whole global batch for any split, token counts (``count=``) included.
- **Micro-steps.** Gradient sync is off on every micro-step but the last
  (``set_requires_gradient_sync``: the unsharded gradients accumulate locally, as under ``no_sync``);
  every rank runs the same number of micro-steps, full steps by the configuration's form and the
  epoch's partial last step by the schedule (:func:`~autobalance.runtime._sampler.epoch_schedule`):
  each forward all-gathers, so a rank with one micro-step fewer would leave the others waiting.
- **Same start.** Every parameter and buffer is broadcast from rank 0 before sharding (DDP does the
  same when it wraps), so a script that seeds ranks differently still trains one model.
- **Clipping** by the global norm (:func:`clip_grad_norm`): squares of the sharded gradients' local
  shards summed over the ranks (one scalar all-reduce), the replicated ones counted once.
- **Mixed precision.** bf16: a ``MixedPrecisionPolicy`` gathering bf16 weights and reducing fp32
  gradients (the step keeps fp32 weights, as under autocast); fp32: none. fp16 is refused by the
  configuration.
- **Compile.** Regional compilation of the blocks composes with ``embeddings`` (the blocks are no
  FSDP2 unit: the compiled regions hold no FSDP2 hook); whole-model compilation, or any with
  ``blocks``, is refused by the configuration (not supported here).

Saving: :func:`full_state_dict` gathers the model's and optimizer's full state onto rank 0 (CPU),
in the plain format keyed by parameter names (``torch.distributed.checkpoint.state_dict``), and
:func:`load_full_state_dict` loads it from rank 0 into a sharded, DDP or plain model: a sharded run
resumes sharded or unsharded, and the other way round.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from autobalance._errors import ConfigError

if TYPE_CHECKING:
    from autobalance._config import BalanceConfig
    from autobalance.runtime._checkpoint import BlockRun

__all__ = [
    "EMBEDDING_FRACTION",
    "ShardedModel",
    "clip_grad_norm",
    "find_embeddings",
    "full_state_dict",
    "full_tensor",
    "load_full_state_dict",
    "local_nbytes",
    "shard_model",
]

EMBEDDING_FRACTION = 0.25
"""An embedding-like module is found when it holds at least this fraction of the largest one's
parameters (a GPT's token embedding and head, not its position embedding)."""


def local_nbytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of ``tensor``: its local shard for a DTensor."""
    local = getattr(tensor, "_local_tensor", tensor)
    return int(local.numel() * local.element_size())


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered (a collective: every rank calls it), else itself."""
    gather = getattr(tensor, "full_tensor", None)
    return gather() if callable(gather) else tensor


def _tied(model: nn.Module) -> set[int]:
    """Ids of the parameters that more than one module holds (tied weights)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {k for k, n in owners.items() if n > 1}


def find_embeddings(model: nn.Module, blocks: BlockRun, names: Sequence[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The embedding-like modules: those ``names`` gives (dotted paths), else every ``nn.Embedding``
    / ``nn.EmbeddingBag`` and every ``nn.Linear`` with a vocabulary-sized side (an output head:
    ``out_features`` or ``in_features`` equal to an embedding's ``num_embeddings``), outside the
    repeated blocks, holding at least :data:`EMBEDDING_FRACTION` of the largest one's parameters.
    A module whose parameter another module also holds (a head tied to its embedding) stays with the
    root: FSDP2 needs a shared parameter in one unit."""
    tied = _tied(model)
    if names is not None:
        found = []
        for name in names:
            try:
                module = model.get_submodule(name)
            except AttributeError:
                raise ConfigError(f"embeddings={list(names)} names {name!r}, not a submodule of "
                                  f"{type(model).__name__}; name modules such as 'tok_emb' or 'lm_head'.") from None
            if any(id(p) in tied for p in module.parameters()):
                raise ConfigError(f"embeddings={list(names)} names {name!r}, whose weight another module shares "
                                  "(tied); leave it out (it is sharded with the root under param_sharding='blocks').")
            found.append((name, module))
        return found
    inside = {id(m) for block in blocks for m in block.modules()}
    embeddings = [(n, m) for n, m in model.named_modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and id(m) not in inside]
    vocab = {m.num_embeddings for _, m in embeddings}
    heads = [(n, m) for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and id(m) not in inside and (m.out_features in vocab or m.in_features in vocab)]
    candidates = embeddings + heads
    if not candidates:
        return []
    largest = max(sum(p.numel() for p in m.parameters()) for _, m in candidates)  # tied ones too: the scale
    return sorted(((n, m) for n, m in candidates
                   if sum(p.numel() for p in m.parameters()) >= EMBEDDING_FRACTION * largest
                   and not any(id(p) in tied for p in m.parameters())),
                  key=lambda item: list(dict(model.named_modules())).index(item[0]))


class ShardedModel:
    """What sharding did to one rank's model (the report's ``model.param_sharding``)."""

    def __init__(self, *, root: nn.Module, mode: str, units: list[str], sharded_bytes: int, world_size: int,
                 largest_unit_bytes: int) -> None:
        self.root = root
        """The model FSDP2 made the root unit (``set_requires_gradient_sync`` is called on it)."""
        self.mode = mode
        self.units = units
        """The sharded units' module names (``""``: the root)."""
        self.sharded_bytes = sharded_bytes
        """Bytes of the parameters sharded over the ranks (their whole size; each rank holds ``1 / world``)."""
        self.world_size = world_size
        self.largest_unit_bytes = largest_unit_bytes
        """The largest sharded unit's parameter bytes (gathered whole while it computes)."""

    def set_sync(self, sync: bool) -> None:
        """Reduce the gradients after this micro-step's backward (the step's last), or accumulate them."""
        self.root.set_requires_gradient_sync(sync)  # type: ignore[operator]

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "units": self.units, "sharded_bytes": self.sharded_bytes,
                "world_size": self.world_size, "largest_unit_bytes": self.largest_unit_bytes}


def watch_storage_resizes() -> None:
    """FSDP2 frees and re-allocates each unit's gathered weights by resizing their storage in place
    (its ``alloc_storage`` / ``free_storage``), which no dispatch mode sees: wrapped here (once per
    process) to tell every active CPU tracker, so live-tensor peaks on CPU count gathered weights only
    while they exist. A torch without those functions leaves the tracker counting them as live."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    except ImportError:  # pragma: no cover - another torch layout
        return
    if getattr(_fsdp_param.free_storage, "_autobalance_watch", False):
        return
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from autobalance.runtime._memory import CpuMemoryTracker

    def tell(tensor: torch.Tensor) -> None:
        for mode in _get_current_dispatch_mode_stack():
            if isinstance(mode, CpuMemoryTracker):
                mode.resized(tensor)

    def watched(original: Any) -> Any:
        def resize(tensor: torch.Tensor) -> None:
            original(tensor)
            tell(tensor)

        resize._autobalance_watch = True  # type: ignore[attr-defined]
        return resize

    alloc, free = watched(_fsdp_param.alloc_storage), watched(_fsdp_param.free_storage)
    _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc, free
    if hasattr(_fsdp_param_group, "alloc_storage"):
        _fsdp_param_group.alloc_storage = alloc


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def shard_model(model: nn.Module, *, config: BalanceConfig, blocks: BlockRun, embeddings: Sequence[str] | None,
                device: torch.device) -> ShardedModel:
    """Apply ``config.param_sharding`` to ``model`` (on ``device``, blocks already checkpointed) in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():  # one rank (the plan starts no group for it): a group of one, for FSDP2
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    world = dist.get_world_size()
    watch_storage_resizes()
    with torch.no_grad():  # one model on every rank, as DDP makes it
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if config.dtype == "bf16" else MixedPrecisionPolicy())
    mesh = init_device_mesh(device.type, (world,))
    keep = set(config.keep_gathered)
    from autobalance.runtime._with_loss import ModelWithLoss

    found = find_embeddings(model.model if isinstance(model, ModelWithLoss) else model, blocks, embeddings)
    units: list[str] = []
    sizes: list[int] = []
    for name, module in found:
        sizes.append(_param_bytes(module))
        fully_shard(module, mesh=mesh, reshard_after_forward="embeddings" not in keep, mp_policy=policy)
        units.append(name)
    sharded = sum(sizes)
    if config.param_sharding == "blocks":
        names = {id(m): n for n, m in model.named_modules()}
        for block in blocks:
            sizes.append(_param_bytes(block))
            fully_shard(block, mesh=mesh, reshard_after_forward="blocks" not in keep, mp_policy=policy)
            units.append(names.get(id(block), "?"))
        fully_shard(model, mesh=mesh, mp_policy=policy)
        units.append("")
        sharded = _param_bytes(model)
        sizes.append(sharded - sum(sizes))
    else:
        replicate = init_device_mesh(device.type, (world, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=replicate, mp_policy=policy)
    return ShardedModel(root=model, mode=config.param_sharding, units=units, sharded_bytes=sharded,
                        world_size=world, largest_unit_bytes=max(sizes, default=0))


def _sharded_over(tensor: Any) -> int:
    """Over how many ranks a DTensor is split (1: every rank holds it whole)."""
    from torch.distributed.tensor import Shard

    mesh, count = tensor.device_mesh, 1
    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            count *= mesh.size(dim)
    return count


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for any mix of sharded (DTensor) and whole gradients:
    the global 2-norm over every gradient, then every gradient scaled by ``max_norm / (norm + 1e-6)``
    when that is below 1. Sharded gradients' squares are summed over the ranks (one all-reduce);
    replicated ones (the same on every rank) are counted once."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    if not any(hasattr(g, "_local_tensor") for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    locals_ = [getattr(g, "_local_tensor", g) for g in grads]
    device = locals_[0].device  # summed where the gradients are: one transfer at the end, not one a tensor
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    whole = torch.zeros((), dtype=torch.float64, device=device)
    for g, local in zip(grads, locals_, strict=True):
        square = local.detach().double().pow(2).sum().to(device)
        if hasattr(g, "_local_tensor") and _sharded_over(g) > 1:
            sharded += square
        else:
            whole += square
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
        summed = sharded.to(comm)
        dist.all_reduce(summed)
        sharded = summed.to(device)
    total = (sharded + whole).sqrt().float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for local in locals_:
        local.mul_(coef.to(local.device, local.dtype))
    return total


def full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """The model's (and optimizer's) full state on rank 0, on the CPU, keyed by parameter names (the
    other ranks get empty dicts); a collective: every rank calls it. Sharded, DDP or plain model."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out: dict[str, Any] = {"model": get_model_state_dict(model, options=options)}
    if optimizer is not None:
        out["optimizer"] = get_optimizer_state_dict(model, optimizer, options=options)
    return out


def load_full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    """Load :func:`full_state_dict`'s result, read on rank 0 (the other ranks may pass ``{}``), into
    ``model`` (sharded, DDP or plain) and ``optimizer``; a collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed)
    set_model_state_dict(model, state.get("model", {}), options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state.get("optimizer", {}), options=options)
