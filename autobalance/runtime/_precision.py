"""The plan's dtype: autocast, the fp16 GradScaler, and the optimizer step through it."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from autobalance._errors import ConfigError
from autobalance.runtime._fsdp import clip_grad_norm as clip_grad_norm_sharded

__all__ = ["TORCH_DTYPES", "already_unscaled", "autocast", "check_dtype_supported", "make_scaler", "scaled_backward", "step_optimizer"]

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_dtype_supported(dtype: str, device: torch.device) -> None:
    """Refuse bf16 on a GPU without it (torch would fall back silently or fail deep inside a kernel)."""
    if dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"dtype='bf16' but {torch.cuda.get_device_name(device)} has no bf16 support; use 'fp16' or 'fp32'."
        )


def make_scaler(dtype: str, device: torch.device) -> Any:
    """A GradScaler for fp16 (its gradients underflow without one); None for the other dtypes."""
    return torch.amp.GradScaler(device.type) if dtype == "fp16" else None


def autocast(dtype: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast to ``dtype`` (nothing for fp32)."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=TORCH_DTYPES[dtype])


def scaled_backward(loss: torch.Tensor, *, scaler: Any, device: torch.device) -> None:
    """Backward of an already weighted loss, through the scaler when there is one, outside autocast."""
    with torch.autocast(device.type, enabled=False):
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()


def already_unscaled(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` was called since the last ``update()`` (a script that
    follows PyTorch's AMP recipe unscales before clipping): its gradients are at scale 1 now. Read from
    the scaler's per-optimizer stage (``torch.amp.grad_scaler.OptState``), the one place torch keeps it."""
    from torch.amp.grad_scaler import OptState

    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        return False
    state = states.get(id(optimizer))
    return isinstance(state, dict) and state.get("stage") is OptState.UNSCALED


def step_optimizer(optimizer: torch.optim.Optimizer, *, scaler: Any, clip_grad_norm: float | None) -> None:
    """Clip (on unscaled gradients) and step, through the scaler for fp16 (it skips overflowed steps).
    Gradients the script already unscaled (``plan.scaler.unscale_(optimizer)``) are not unscaled again."""
    if clip_grad_norm is not None:
        if scaler is not None and not already_unscaled(scaler, optimizer):
            scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_sharded(params, clip_grad_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
