"""Layers whose train-mode step depends on the batch: BatchNorm and its kind, anything whose forward
updates buffers (running statistics).

For such a model the micro-batch a sample lands in changes the step: BatchNorm normalises with the
micro-batch's statistics, and running statistics are updated once per forward (so per micro-batch,
from this rank's samples only). An uneven split or another accumulation count therefore trains
differently, and is verified in train mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autobalance.runtime._parts import Part

if TYPE_CHECKING:
    from autobalance.runtime._plan import Plan

__all__ = ["BatchDependence", "BufferWatch", "batch_dependent_module_list", "batch_dependent_modules", "dropout_modules"]

_RUNNING_PREFIX = "running_"
_COUNTER = "num_batches_tracked"


def _describe(name: str, module: nn.Module) -> str:
    return f"{name or '(the model)'} ({type(module).__name__})"


def _batch_dependent(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.instancenorm import _InstanceNorm

    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm) or (isinstance(module, _InstanceNorm) and module.track_running_stats):
            yield name, module
            continue
        own = [n for n, _ in module.named_buffers(recurse=False)]
        if any(n.startswith(_RUNNING_PREFIX) or n == _COUNTER for n in own):
            yield name, module


def batch_dependent_modules(model: nn.Module) -> list[str]:
    """``"path (Type)"`` of each module known to depend on the batch in train mode: BatchNorm
    (``_BatchNorm``: 1d/2d/3d, lazy, SyncBatchNorm), InstanceNorm with running statistics, and any
    module with a ``running_*`` or ``num_batches_tracked`` buffer of its own."""
    return [_describe(name, module) for name, module in _batch_dependent(model)]


def batch_dependent_module_list(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`batch_dependent_modules` names."""
    return [module for _, module in _batch_dependent(model)]


def dropout_modules(model: nn.Module) -> Iterator[nn.Module]:
    """The model's dropout layers (``nn.Dropout`` and its kind)."""
    from torch.nn.modules.dropout import _DropoutNd

    for module in model.modules():
        if isinstance(module, _DropoutNd):
            yield module


class BufferWatch:
    """Finds modules whose forward writes their own buffers, whatever their type: the version
    counter of each buffer is read before and after the module's forward (so DDP's broadcast of
    buffers, which happens before, is not counted). Watch one step (eager only), then ``close``."""

    def __init__(self, model: nn.Module) -> None:
        self.found: list[str] = []
        self._before: dict[int, list[int]] = {}
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            buffers = [b for b in module.buffers(recurse=False) if isinstance(b, torch.Tensor)]
            if not buffers:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre(module, buffers)))
            self._handles.append(module.register_forward_hook(self._post(name, module, buffers)))

    def _pre(self, module: nn.Module, buffers: list[torch.Tensor]) -> Any:
        def hook(mod: nn.Module, args: Any) -> None:
            self._before[id(module)] = [b._version for b in buffers]

        return hook

    def _post(self, name: str, module: nn.Module, buffers: list[torch.Tensor]) -> Any:
        label = _describe(name, module)

        def hook(mod: nn.Module, args: Any, output: Any) -> None:
            before = self._before.pop(id(module), None)
            if before is not None and label not in self.found and [b._version for b in buffers] != before:
                self.found.append(label)

        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class BatchDependence(Part):
    """A trial's part (eager only: hooks would be traced into a compiled graph): watches the first
    step with :class:`BufferWatch` and adds the modules it caught to the report's
    ``model.batch_dependent`` (next to those :func:`batch_dependent_modules` knows by type)."""

    def __init__(self) -> None:
        self._watch: BufferWatch | None = None

    def on_wrapped(self, plan: Plan, wrapped: nn.Module) -> None:
        if plan.model is not None:
            self._watch = BufferWatch(plan.model)

    def after_step(self, plan: Plan) -> None:
        watch, self._watch = self._watch, None
        if watch is None:
            return
        watch.close()
        known = plan.model_info.setdefault("batch_dependent", [])
        known.extend(x for x in watch.found if x not in known)
