"""Verification runs (``autobalance verify``): one optimizer step, its inputs and its result saved.

A trial whose directory holds ``verify.json`` (see :data:`autobalance._env.VERIFY_FILE`) is a
verification run. Every run of one verification starts from the same weights (the first run saves
them, the others load them on rank 0 before DDP broadcasts them), takes the first global batch of
the same permutation (the uneven sampler's first step is the first ``global_batch`` samples of the
epoch's permutation whatever the split) and, after the first optimizer step, rank 0 saves the
averaged gradients (unscaled), the updated parameters and the buffers. The tuner compares them.

With dropout off the model runs in **train mode with every dropout probability at 0**: each dropout
module's ``p`` is set to 0 (libraries that read ``.p`` see it) and a torch-function mode
(:class:`NoDropout`) turns the probability of functional dropout (``F.dropout`` and its kind, the
``dropout_p`` of ``F.scaled_dot_product_attention``) to 0 during each micro-step, so a term the model
computes only ``if self.training`` (a mixture-of-experts balancing loss) is part of the step verified,
and each sample's computation does not depend on random masks. Batch-dependent layers (BatchNorm and
its kind, see :mod:`autobalance.runtime._batch_dependent`) train as they do in training
(``allow_batch_dependent``: those layers alone in eval mode, on their running statistics: the user
accepts that a split changes their batch statistics). Whether any dropout was seen (a module with
``p > 0`` or a functional call with a probability above 0) is saved with the step: without dropout,
recomputation has no random masks to replay.

Every fp32 verification run holds full fp32 precision: TF32 matmuls and convolutions and
reduced-precision reductions are turned off when the model is wrapped and again at every step and
micro-step (a script may turn TF32 on after ``plan()``; nanoGPT does so at its top). A bf16 or fp16
run keeps the script's own settings, as production runs it: its check compares it with the
baseline in the same dtype and settings (within a multiple of the baseline's own error, far above
TF32's), and a compiled one then builds the same graphs as the study's trial of it, which the
study's Inductor cache serves (the precision flags are part of the cache key). Measured on one H200 (a ~270M GPT,
``benchmarks/2026-12-03-h200/verify_floor.json``): with TF32 on, two runs of the *same* configuration
differ by 1.1e-4 in their gradients, two correct arrangements by 1.1-1.5e-4 and a 1e-3 reweighting of
one micro-batch by 7.1e-4, too close to tell apart; with TF32 off: 4.6e-7, 1.1-3.1e-6 and 7.1e-4.

A floor run (``reverse``) takes every micro-batch's samples in reverse order: the same samples in the
same micro-batches, so the same loss weighting whatever the loss, only another summation order. Its
distance from the same configuration in order is the rounding floor the verifier's bound comes from.

A script that unscales the gradients itself (``plan.scaler.unscale_(optimizer)`` before clipping, as
PyTorch's AMP recipe does) has them captured at scale 1 (they are not divided by the scale twice).

An fp16 step that overflows (the GradScaler skips it) is not the step to verify: the run restores
its buffers and runs the same micro-batches again at the scale the scaler has lowered to, until a
step is taken (at most :data:`MAX_OVERFLOW_RETRIES` times); the saved step says how often.

Only tensors are written (``torch.save`` of dicts of tensors) and they are read back with
``torch.load(weights_only=True)``; the sample indices go to JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autobalance import _env
from autobalance._errors import ConfigError
from autobalance.runtime._fsdp import full_tensor
from autobalance.runtime._parts import Part
from autobalance.runtime._precision import already_unscaled

if TYPE_CHECKING:
    from autobalance.runtime._plan import Plan

__all__ = ["INIT_FILE", "MAX_OVERFLOW_RETRIES", "SEED", "STEP_FILE", "STEP_JSON", "NoDropout", "VerifyRun",
           "gradients", "hold_full_precision", "param_name", "precision_flags", "restore_precision_flags"]

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


def _functional_dropouts() -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Functional dropout whose probability is the second positional argument (``p``), and
    ``F.scaled_dot_product_attention`` (``dropout_p``, the fifth)."""
    import torch.nn.functional as F

    return ((F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
             torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout),
            (F.scaled_dot_product_attention,))


class NoDropout(TorchFunctionMode):
    """Functional dropout with its probability turned to 0 (the module's ``training`` flag left as it
    is); counts the calls that asked for more than 0 in :attr:`seen` (eager calls only: inside
    ``torch.compile``'s tracing the mode is traced like the functions it wraps, and a counter it
    changed would become a guard that fails at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0
        self._dropouts, self._attention = _functional_dropouts()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in self._dropouts:
            name, where = "p", 1
        elif func in self._attention:
            name, where = "dropout_p", 4
        else:
            return func(*args, **kwargs)
        asked = kwargs.get(name, args[where] if len(args) > where else 0.0)
        if name in kwargs:
            kwargs[name] = 0.0
        elif len(args) > where:
            args = (*args[:where], 0.0, *args[where + 1:])
        if asked and not torch.compiler.is_compiling():
            self.seen += 1
        return func(*args, **kwargs)


_PRECISION_FLAGS = (("matmul", "allow_tf32"), ("cudnn", "allow_tf32"),
                    ("matmul", "allow_fp16_reduced_precision_reduction"),
                    ("matmul", "allow_bf16_reduced_precision_reduction"))
"""The process-wide reduced-precision switches: TF32 (matmuls, cuDNN) and fp16/bf16 reductions."""


def _owner(where: str) -> Any:
    return torch.backends.cuda.matmul if where == "matmul" else torch.backends.cudnn


def hold_full_precision() -> dict[str, bool]:
    """Turn TF32 (matmuls, cuDNN) and reduced-precision fp16/bf16 reductions off; returns which of
    them the script had turned on beyond torch's defaults (``tf32_matmul``: torch's default is off;
    cuDNN's TF32 and the reduced-precision reductions are on by default and held off silently)."""
    changed = False
    for where, attr in _PRECISION_FLAGS:
        try:
            if getattr(_owner(where), attr):
                changed = changed or (where, attr) == ("matmul", "allow_tf32")
                setattr(_owner(where), attr, False)
        except (AttributeError, RuntimeError):  # a flag this torch lacks, or one set through its newer API
            continue
    try:
        changed = changed or torch.get_float32_matmul_precision() != "highest"
        torch.set_float32_matmul_precision("highest")
    except RuntimeError:
        pass
    return {"tf32_matmul": changed}


def precision_flags() -> dict[str, Any]:
    """The process-wide precision settings a run may change (those :func:`hold_full_precision`
    turns off, and the float32 matmul precision): a warm worker snapshots them when it starts and
    puts them back before each run (:func:`restore_precision_flags`)."""
    flags: dict[str, Any] = {}
    for where, attr in _PRECISION_FLAGS:
        with contextlib.suppress(AttributeError, RuntimeError):
            flags[f"{where}.{attr}"] = getattr(_owner(where), attr)
    flags["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    return flags


def restore_precision_flags(flags: dict[str, Any]) -> None:
    """Put back what :func:`precision_flags` saw: a verification run's full fp32 precision (or a
    script's TF32) must not carry over to the next run in the same warm worker (the flags are part
    of Inductor's cache key, and of the numerics)."""
    for where, attr in _PRECISION_FLAGS:
        key = f"{where}.{attr}"
        if key in flags:
            with contextlib.suppress(AttributeError, RuntimeError):
                if getattr(_owner(where), attr) != flags[key]:
                    setattr(_owner(where), attr, flags[key])
    with contextlib.suppress(RuntimeError):
        torch.set_float32_matmul_precision(flags["float32_matmul_precision"])


class VerifyRun(Part):
    """What a verification run does beyond an ordinary trial (a part of its plan)."""

    def __init__(self, *, trial_dir: str, dropout: str, init: str | None, allow_batch_dependent: bool = False,
                 reverse: bool = False, eager_blocks: list[list[int]] | None = None) -> None:
        self.trial_dir = trial_dir
        self.eager_blocks = eager_blocks
        """Per rank, the blocks a regional compile leaves eager although this run does not checkpoint
        them: the rng-replay reference of a configuration whose checkpointed blocks run eagerly (compiled
        dropout draws other masks than eager dropout). None: as the configuration says."""
        self.dropout = dropout
        self.init = init
        self.allow_batch_dependent = allow_batch_dependent
        self.reverse = reverse
        """A floor run: each micro-batch's samples in reverse order (see the module doc)."""
        self.no_dropout = NoDropout()
        self.dropout_modules = 0
        """Dropout modules with ``p > 0`` (their ``p`` is 0 in a dropout-off run)."""
        self.script_precision: dict[str, bool] = {}
        """Which reduced-precision settings the script had on (held off in this run)."""
        self.holds_precision = True
        """Whether this run holds full fp32 precision (an fp32 run; set when the model is wrapped)."""
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
        self.init_s: float | None = None
        """Seconds rank 0 took to load (or save) the starting weights."""

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
        reverse = spec.get("reverse", False) if isinstance(spec, dict) else None
        eager = spec.get("eager_blocks") if isinstance(spec, dict) else None
        eager_ok = eager is None or (isinstance(eager, list) and all(
            isinstance(r, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in r) for r in eager))
        if (dropout not in ("off", "on") or not (init is None or isinstance(init, str)) or not isinstance(allow, bool)
                or not isinstance(reverse, bool) or not eager_ok):
            raise ConfigError(f"{path}={spec!r} is not a verification request; rerun autobalance verify.")
        return cls(trial_dir=trial_dir, dropout=dropout, init=init, allow_batch_dependent=allow, reverse=reverse,
                   eager_blocks=eager)

    def _hold_precision(self) -> None:
        if not self.holds_precision:
            return
        was = hold_full_precision()
        for key, on in was.items():
            self.script_precision[key] = self.script_precision.get(key, False) or on

    # ------------------------------------------------------------------ hooks called by Plan
    def on_wrap(self, plan: Plan, model: nn.Module) -> None:
        """Same starting weights in every run: load them (rank 0; DDP broadcasts) or save them."""
        from autobalance.runtime._batch_dependent import batch_dependent_modules

        self.batch_dependent = batch_dependent_modules(model)
        self.holds_precision = plan.config.dtype == "fp32"
        self._hold_precision()
        if plan.rank == 0:
            started = time.monotonic()
            if self.init:
                state = torch.load(self.init, map_location="cpu", weights_only=True)
                model.load_state_dict(state, strict=True)
            else:
                state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                torch.save(state, os.path.join(self.trial_dir, INIT_FILE))
            self.init_s = time.monotonic() - started
        self.set_mode(model)

    def on_micro_step(self, plan: Plan) -> Any:
        """Full precision held, the mode set; with dropout off, functional dropout at probability 0
        for the micro-step (its forward, backward and any recomputation in it)."""
        self._hold_precision()
        self.set_mode(plan.model)
        return self.no_dropout if self.dropout == "off" else contextlib.nullcontext()

    def set_mode(self, model: nn.Module | None) -> None:
        """``dropout: off``: train mode with every dropout module's ``p`` at 0 (a term computed only
        ``if self.training`` is verified); batch-dependent layers allowed to change in eval mode."""
        if model is None or self.dropout != "off":
            return
        from autobalance.runtime._batch_dependent import (
            batch_dependent_module_list,
            dropout_modules,
        )

        model.train()
        for module in dropout_modules(model):
            p = getattr(module, "p", 0.0)
            if isinstance(p, float) and p > 0:
                self.dropout_modules += 1
                module.p = 0.0  # type: ignore[assignment]
        if self.allow_batch_dependent:
            for module in batch_dependent_module_list(model):
                module.eval()

    @property
    def train_mode(self) -> bool:
        """Whether batch-dependent layers train as they do in training (their batch statistics)."""
        return not self.allow_batch_dependent

    @property
    def dropout_seen(self) -> bool:
        """Whether the model asked for dropout (a module with ``p > 0``, or a functional call)."""
        return self.dropout_modules > 0 or self.no_dropout.seen > 0

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
        self._hold_precision()
        if not self.saved:  # the first step, or the same step again after an overflow: same seeds
            self.on_first_step(rank=plan.rank, model=plan.model)

    def before_optimizer_step(self, plan: Plan, optimizer: torch.optim.Optimizer) -> None:
        """The first step's averaged gradients, before clipping and the update change them."""
        if plan.model is not None and not self.saved:
            self._scale = float(plan.scaler.get_scale()) if plan.scaler is not None else 1.0
            # a script that unscaled them itself (scaler.unscale_ before clipping): already at scale 1
            unscaled = plan.scaler is None or already_unscaled(plan.scaler, optimizer)
            self._grads = gradients(plan.model, scale=1.0 if unscaled else self._scale)

    def after_optimizer_step(self, plan: Plan, optimizer: torch.optim.Optimizer) -> None:
        grads, self._grads = self._grads, None
        if grads is None or plan.model is None:
            return
        if plan.scaler is not None and float(plan.scaler.get_scale()) < self._scale:
            self._overflowed = True  # the scaler found inf/nan, skipped the update and lowered its scale
            return
        self.save_step(model=plan.model, rank=plan.rank, grads=grads, layout=plan.layout.micro_batches,
                       info={"config": plan.config.to_dict(), "loss_weighting": True,
                             "framework": plan.model_info.get("framework"),
                             "training": plan.model.training, "scale": self._scale,
                             "dropout_seen": self.dropout_seen, "reverse": self.reverse,
                             "script_precision": {k: v for k, v in self.script_precision.items() if v}})
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
        """Rank 0 writes the step's gradients, updated parameters, buffers and sample indices (sharded
        parameters are gathered first, on every rank)."""
        sharded = any(hasattr(p, "_local_tensor") for p in model.parameters())
        if rank != 0 and not sharded:
            return
        started = time.monotonic()
        params = {param_name(n): full_tensor(p.detach()).float().cpu().clone() for n, p in model.named_parameters()}
        if rank != 0:
            return
        buffers = {param_name(n): b.detach().float().cpu().clone() for n, b in model.named_buffers()
                   if not b.is_complex()}
        tmp = os.path.join(self.trial_dir, STEP_FILE + ".tmp")
        torch.save({"grads": grads, "params": params, "buffers": buffers}, tmp)
        os.replace(tmp, os.path.join(self.trial_dir, STEP_FILE))
        with open(os.path.join(self.trial_dir, STEP_JSON), "w") as fh:
            json.dump({"init": self.init_s, "save": time.monotonic() - started, "micro_batches": layout,
                       "dropout": self.dropout, "train_mode": self.train_mode, "batch_dependent": self.batch_dependent, "allow_batch_dependent": self.allow_batch_dependent,
                       "overflow_skips": self.overflow_skips, **info}, fh)


def gradients(model: nn.Module, *, scale: float) -> dict[str, torch.Tensor]:
    """This rank's gradients (after DDP's average) divided by the loss scale, on the CPU in fp32."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[param_name(name)] = (full_tensor(p.grad.detach()).float() / scale).cpu()
    return out
