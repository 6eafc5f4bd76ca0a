"""Verification runs (``autobalance verify``): one optimizer step, its inputs and its result saved.

A trial whose directory holds ``verify.json`` (see :data:`autobalance._env.VERIFY_FILE`) is a
verification run. Every run of one verification starts from the same weights (the first run saves
them, the others load them on rank 0 before DDP broadcasts them), takes the first global batch of
the same permutation (the uneven sampler's first step is the first ``global_batch`` samples of the
epoch's permutation whatever the split) and, after the first optimizer step, rank 0 saves the
averaged gradients (unscaled), the updated parameters and the buffers. The tuner compares them.

The model runs in eval mode when dropout is off (each sample's computation no longer depends on its
micro-batch), unless it has batch-dependent layers (BatchNorm and its kind, see
:mod:`autobalance.runtime._batch_dependent`): then it runs in train mode with only its dropout
layers in eval mode, so the step verified is the step that trains (``allow_batch_dependent``: eval
mode, as for any model: the user accepts that a split changes their batch statistics).

An fp16 step that overflows (the GradScaler skips it) is not the step to verify: the run restores
its buffers and runs the same micro-batches again at the scale the scaler has lowered to, until a
step is taken (at most :data:`MAX_OVERFLOW_RETRIES` times); the saved step says how often.

Only tensors are written (``torch.save`` of dicts of tensors) and they are read back with
``torch.load(weights_only=True)``; the sample indices go to JSON.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autobalance import _env
from autobalance._errors import ConfigError
from autobalance.runtime._parts import Part

if TYPE_CHECKING:
    from autobalance.runtime._plan import Plan

__all__ = ["INIT_FILE", "MAX_OVERFLOW_RETRIES", "SEED", "STEP_FILE", "STEP_JSON", "VerifyRun", "gradients",
           "param_name"]

INIT_FILE = "verify-init.pt"
STEP_FILE = "verify-step.pt"
STEP_JSON = "verify-step.json"
SEED = 1234
"""The global RNG is seeded with ``SEED + rank`` at the start of the first step."""
MAX_OVERFLOW_RETRIES = 40
"""fp16: steps skipped for overflow before a verification run gives up (the scale halves each time)."""
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def param_name(name: str) -> str:
    """A parameter's name without the prefixes of checkpoint or compile wrappers."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class VerifyRun(Part):
    """What a verification run does beyond an ordinary trial (a part of its plan)."""

    def __init__(self, *, trial_dir: str, dropout: str, init: str | None, allow_batch_dependent: bool = False) -> None:
        self.trial_dir = trial_dir
        self.dropout = dropout
        self.init = init
        self.allow_batch_dependent = allow_batch_dependent
        self.batch_dependent: list[str] = []
        """The model's batch-dependent layers (found by :meth:`on_wrap`)."""
        self.overflow_skips = 0
        """fp16: steps the GradScaler skipped (overflow) before the verified one."""
        self._buffers: dict[str, torch.Tensor] = {}
        self._grads: dict[str, torch.Tensor] | None = None
        self._scale: float = 1.0
        self._overflowed = False
        self.saved = False
        """The step was saved: the run is done."""

    @classmethod
    def from_trial_dir(cls, trial_dir: str | None) -> VerifyRun | None:
        if not trial_dir:
            return None
        path = os.path.join(trial_dir, _env.VERIFY_FILE)
        if not os.path.isfile(path):
            return None
        try:
            with open(path) as fh:
                spec = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path} is not readable JSON ({exc}); rerun autobalance verify.") from None
        dropout = spec.get("dropout") if isinstance(spec, dict) else None
        init = spec.get("init") if isinstance(spec, dict) else None
        allow = spec.get("allow_batch_dependent", False) if isinstance(spec, dict) else None
        if dropout not in ("off", "on") or not (init is None or isinstance(init, str)) or not isinstance(allow, bool):
            raise ConfigError(f"{path}={spec!r} is not a verification request; rerun autobalance verify.")
        return cls(trial_dir=trial_dir, dropout=dropout, init=init, allow_batch_dependent=allow)

    @property
    def train_mode(self) -> bool:
        """Whether the verified step runs in train mode (dropout on, or batch-dependent layers)."""
        return self.dropout == "on" or (bool(self.batch_dependent) and not self.allow_batch_dependent)

    # ------------------------------------------------------------------ hooks called by Plan
    def on_wrap(self, plan: Plan, model: nn.Module) -> None:
        """Same starting weights in every run: load them (rank 0; DDP broadcasts) or save them."""
        from autobalance.runtime._batch_dependent import batch_dependent_modules

        self.batch_dependent = batch_dependent_modules(model)
        if plan.rank == 0:
            if self.init:
                state = torch.load(self.init, map_location="cpu", weights_only=True)
                model.load_state_dict(state, strict=True)
            else:
                state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                torch.save(state, os.path.join(self.trial_dir, INIT_FILE))
        self.set_mode(model)

    def on_micro_step(self, plan: Plan) -> None:
        self.set_mode(plan.model)

    def set_mode(self, model: nn.Module | None) -> None:
        """``dropout: off``: eval mode (no dropout, BatchNorm on running statistics): each sample's
        computation no longer depends on which micro-batch it is in; with batch-dependent layers
        (not allowed to change): train mode with the dropout layers alone in eval mode."""
        if model is None or self.dropout != "off":
            return
        if not self.train_mode:
            model.eval()
            return
        from autobalance.runtime._batch_dependent import dropout_modules

        model.train()
        for module in dropout_modules(model):
            module.eval()

    def on_first_step(self, *, rank: int, model: nn.Module | None = None) -> None:
        """Seed the RNG; keep the buffers as they are before the step (an overflowed fp16 step is
        run again from them)."""
        torch.manual_seed(SEED + rank)
        if model is not None and not self._buffers:
            self._buffers = {n: b.detach().clone() for n, b in model.named_buffers()}

    def on_overflow(self, *, model: nn.Module | None) -> None:
        """The step overflowed (fp16) and was skipped: put the buffers back before it is run again."""
        self.overflow_skips += 1
        if self.overflow_skips > MAX_OVERFLOW_RETRIES:
            raise ConfigError(
                f"every fp16 step overflowed: the GradScaler skipped {MAX_OVERFLOW_RETRIES} steps in a row "
                "(gradients inf or nan at every scale); check the loss for inf/nan, or verify in bf16 or fp32."
            )
        if model is not None:
            with torch.no_grad():
                for name, buf in model.named_buffers():
                    saved = self._buffers.get(name)
                    if saved is not None:
                        buf.copy_(saved)

    def on_step_start(self, plan: Plan) -> None:
        if not self.saved:  # the first step, or the same step again after an overflow: same seeds
            self.on_first_step(rank=plan.rank, model=plan.model)

    def before_optimizer_step(self, plan: Plan, optimizer: torch.optim.Optimizer) -> None:
        """The first step's averaged gradients, before clipping and the update change them."""
        if plan.model is not None and not self.saved:
            self._scale = float(plan.scaler.get_scale()) if plan.scaler is not None else 1.0
            self._grads = gradients(plan.model, scale=self._scale)

    def after_optimizer_step(self, plan: Plan, optimizer: torch.optim.Optimizer) -> None:
        grads, self._grads = self._grads, None
        if grads is None or plan.model is None:
            return
        if plan.scaler is not None and float(plan.scaler.get_scale()) < self._scale:
            self._overflowed = True  # the scaler found inf/nan, skipped the update and lowered its scale
            return
        self.save_step(model=plan.model, rank=plan.rank, grads=grads, layout=plan.layout.micro_batches,
                       info={"config": plan.config.to_dict(), "loss_weighting": True,
                             "training": plan.model.training, "scale": self._scale})
        self.saved = True

    def repeat_step(self, plan: Plan) -> bool:
        """An overflowed fp16 step: run it again (buffers restored) at the scaler's lower scale."""
        if not self._overflowed:
            return False
        self._overflowed = False
        self.on_overflow(model=plan.model)
        return True

    def trial_done(self, plan: Plan) -> bool:
        """A verification run is one optimizer step (saved)."""
        return self.saved

    def save_step(self, *, model: nn.Module, rank: int, grads: dict[str, torch.Tensor],
                  layout: list[list[list[int]]], info: dict[str, Any]) -> None:
        """Rank 0 writes the step's gradients, updated parameters, buffers and sample indices."""
        if rank != 0:
            return
        params = {param_name(n): p.detach().float().cpu().clone() for n, p in model.named_parameters()}
        buffers = {param_name(n): b.detach().float().cpu().clone() for n, b in model.named_buffers()
                   if not b.is_complex()}
        tmp = os.path.join(self.trial_dir, STEP_FILE + ".tmp")
        torch.save({"grads": grads, "params": params, "buffers": buffers}, tmp)
        os.replace(tmp, os.path.join(self.trial_dir, STEP_FILE))
        with open(os.path.join(self.trial_dir, STEP_JSON), "w") as fh:
            json.dump({"micro_batches": layout, "dropout": self.dropout, "train_mode": self.train_mode,
                       "batch_dependent": self.batch_dependent, "allow_batch_dependent": self.allow_batch_dependent,
                       "overflow_skips": self.overflow_skips, **info}, fh)


def gradients(model: nn.Module, *, scale: float) -> dict[str, torch.Tensor]:
    """This rank's gradients (after DDP's average) divided by the loss scale, on the CPU in fp32."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[param_name(name)] = (p.grad.detach().float() / scale).cpu()
    return out
