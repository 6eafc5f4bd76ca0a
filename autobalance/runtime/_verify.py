"""Verification runs (``autobalance verify``): one optimizer step, its inputs and its result saved.

A trial whose directory holds ``verify.json`` (see :data:`autobalance._env.VERIFY_FILE`) is a
verification run. Every run of one verification starts from the same weights (the first run saves
them, the others load them on rank 0 before DDP broadcasts them), takes the first global batch of
the same permutation (the uneven sampler's first step is the first ``global_batch`` samples of the
epoch's permutation whatever the split) and, after the first optimizer step, rank 0 saves the
averaged gradients (unscaled) and the updated parameters. The tuner compares them.

Only tensors are written (``torch.save`` of dicts of tensors) and they are read back with
``torch.load(weights_only=True)``; the sample indices go to JSON.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from autobalance import _env
from autobalance._errors import ConfigError

__all__ = ["INIT_FILE", "SEED", "STEP_FILE", "STEP_JSON", "VerifyRun", "gradients", "param_name"]

INIT_FILE = "verify-init.pt"
STEP_FILE = "verify-step.pt"
STEP_JSON = "verify-step.json"
SEED = 1234
"""The global RNG is seeded with ``SEED + rank`` at the start of the first step."""
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def param_name(name: str) -> str:
    """A parameter's name without the prefixes of checkpoint or compile wrappers."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class VerifyRun:
    """What a verification run does beyond an ordinary trial."""

    def __init__(self, *, trial_dir: str, dropout: str, init: str | None) -> None:
        self.trial_dir = trial_dir
        self.dropout = dropout
        self.init = init

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
        if dropout not in ("off", "on") or not (init is None or isinstance(init, str)):
            raise ConfigError(f"{path}={spec!r} is not a verification request; rerun autobalance verify.")
        return cls(trial_dir=trial_dir, dropout=dropout, init=init)

    # ------------------------------------------------------------------ hooks called by Plan
    def on_wrap(self, model: nn.Module, *, rank: int) -> None:
        """Same starting weights in every run: load them (rank 0; DDP broadcasts) or save them."""
        if rank == 0:
            if self.init:
                state = torch.load(self.init, map_location="cpu", weights_only=True)
                model.load_state_dict(state, strict=True)
            else:
                state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                torch.save(state, os.path.join(self.trial_dir, INIT_FILE))
        self.set_mode(model)

    def set_mode(self, model: nn.Module | None) -> None:
        """``dropout: off``: eval mode (no dropout, BatchNorm on running statistics): each sample's
        computation no longer depends on which micro-batch it is in."""
        if model is not None and self.dropout == "off":
            model.eval()

    def on_first_step(self, *, rank: int) -> None:
        torch.manual_seed(SEED + rank)

    def save_step(self, *, model: nn.Module, rank: int, grads: dict[str, torch.Tensor],
                  layout: list[list[list[int]]], info: dict[str, Any]) -> None:
        """Rank 0 writes the step's gradients, updated parameters and sample indices."""
        if rank != 0:
            return
        params = {param_name(n): p.detach().float().cpu().clone() for n, p in model.named_parameters()}
        tmp = os.path.join(self.trial_dir, STEP_FILE + ".tmp")
        torch.save({"grads": grads, "params": params}, tmp)
        os.replace(tmp, os.path.join(self.trial_dir, STEP_FILE))
        with open(os.path.join(self.trial_dir, STEP_JSON), "w") as fh:
            json.dump({"micro_batches": layout, "dropout": self.dropout, **info}, fh)


def gradients(model: nn.Module, *, scale: float) -> dict[str, torch.Tensor]:
    """This rank's gradients (after DDP's average) divided by the loss scale, on the CPU in fp32."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[param_name(name)] = (p.grad.detach().float() / scale).cpu()
    return out
