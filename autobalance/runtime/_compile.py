"""``torch.compile`` of the wrapped model with this rank's activation-memory budget.

The model inside DDP is compiled in place (as ``nn.Module.compile`` does): ``plan.wrap()`` still
returns the ``DistributedDataParallel`` (``.module``, ``no_sync``, hooks and ``state_dict`` keys
unchanged). DDP's own forward runs eagerly (Dynamo graph-breaks in it anyway) and calls the model
inside its "active DDP module" context, so Dynamo's DDPOptimizer splits the compiled graph at the
bucket boundaries and the all-reduces overlap the backward as in eager mode - what
``torch.compile(ddp_model)`` does, without a wrapper type that changes ``state_dict`` keys.

The budget is ``torch._functorch.config.activation_memory_budget``, read by the min-cut
partitioner when the joint graph is partitioned, which happens lazily during the first forward
and backward; it is set per process before that (ranks may differ). Compilation happens in the
first optimizer step, which is timed as ``compile_s`` and not counted as a measured step.

A rank whose micro-steps have more than one size (an any split: ``6,6,5,5,5,5``) compiles **one
graph with a dynamic batch dimension** instead of one per size: before each call the tensors whose
first dimension is one of the rank's micro-step sizes are marked dynamic in that dimension
(``torch._dynamo.maybe_mark_dynamic``), so Dynamo traces once. Left to itself it would compile a
static graph for the first size and a dynamic one at the second size's recompile: two compiles for
what one serves (``benchmarks/compile_probe.py``; ``docs/compile.md`` has the measurement). A rank
with one size compiles a static graph, as before.

**Regional scope** (``compile_scope='regional'``, ``docs/compile.md``): instead of the whole model,
each repeated block that ``plan.wrap`` found (the blocks checkpointing uses) is compiled on its own,
as torchtitan's ``apply_compile`` and PyTorch's regional-compilation recipe do, and, when
``plan.wrap(model, loss=...)`` owns the loss, the loss as one tail region. Every block's compiled
function has the same code, and Dynamo treats the block's parameters as inputs (inlined built-in
modules), so identical blocks share one graph: the trial compiles one block and the tail, not the
model (on one H200 a third of the whole model's compile time: ``benchmarks/2026-12-04-h200``). The
rest (embeddings, final layers, head) runs eagerly; with the loss outside the model, or a framework
that calls the loss itself, the blocks alone are compiled (the report's ``compile.tail`` says so). A
block this rank checkpoints stays eager (checkpointed, not compiled: exact, and no second
recomputation on top of the budget's); compiled dropout draws other masks than eager dropout, so
verification's rng-replay reference (the configuration without recomputation) keeps those blocks
eager too (``VerifyRun.eager_blocks``). DDP's bucket-boundary graph splitting (DDPOptimizer) is off
inside a block: its gradients are ready when the block's compiled backward ends, which is the
overlap a block gives anyway, and a split would compile each block in pieces. The activation budget
is the process's, so it applies to every region.

The persistent caches are Inductor's: ``TORCHINDUCTOR_CACHE_DIR`` (the tuner sets one per study)
with the FX graph and AOTAutograd caches; hits and misses are read from Dynamo's counters.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autobalance._config import CUDA_GRAPH_MODES
from autobalance.runtime._parts import Part
from autobalance.runtime._with_loss import ModelWithLoss

if TYPE_CHECKING:
    from autobalance.runtime._plan import Plan

__all__ = ["DEFAULT_BACKEND", "CompileState"]

DEFAULT_BACKEND = "inductor"
_COUNTERS = (
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_miss"),
    ("inductor", "fxgraph_cache_bypass"),
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_miss"),
    ("aot_autograd", "autograd_cache_bypass"),
    ("stats", "unique_graphs"),
)


def _counters() -> dict[str, int]:
    try:
        from torch._dynamo.utils import counters
    except Exception:  # pragma: no cover - Dynamo unavailable
        return {}
    out = {f"{group}.{name}": int(counters[group][name]) for group, name in _COUNTERS}
    out["graph_breaks"] = int(sum(counters["graph_break"].values()))
    return out


class CompileState(Part):
    """How this rank compiles, and what compiling cost (a part of a compiled configuration's plan)."""

    def __init__(self, *, mode: str, budget: float | None, sizes: list[int] | None = None,
                 backend: str | None = None, scope: str = "whole") -> None:
        """``backend``: ``AUTOBALANCE_COMPILE_BACKEND`` (``TrialEnv.compile_backend``; None or empty: inductor)."""
        self.mode = mode
        self.scope = scope
        """``whole`` or ``regional`` (the configuration's ``compile_scope``)."""
        self.regions: dict[str, Any] = {}
        """Regional scope: what was compiled (``blocks``, ``checkpointed_eager``, ``tail``, ``note``)."""
        self.budget_requested = budget
        self.sizes = frozenset(sizes or ())
        """This rank's micro-step sizes."""
        self.dynamic_batch = len(self.sizes) > 1
        """Whether the batch dimension is compiled dynamic (the rank's micro-steps differ in size)."""
        self.backend = backend or DEFAULT_BACKEND
        self.budget_used: float | None = None
        self.compile_s: float | None = None
        self._before: dict[str, int] = {}
        self._after_first_step: dict[str, int] | None = None

    def _set_budget(self) -> dict[str, Any]:
        """Set this rank's budget; the ``torch.compile`` keyword arguments."""
        import torch._functorch.config as functorch_config

        if self.budget_requested is not None:
            functorch_config.activation_memory_budget = float(self.budget_requested)
        self.budget_used = float(functorch_config.activation_memory_budget)
        kwargs: dict[str, Any] = {"backend": self.backend}
        if self.backend == DEFAULT_BACKEND and self.mode != "default":
            kwargs["mode"] = self.mode
        self._before = _counters()
        return kwargs

    def apply(self, module: nn.Module) -> None:
        """Set this rank's budget and compile ``module`` (the model inside DDP) in place; Dynamo
        compiles on its first call."""
        self.compile_module(module, self._set_budget())

    def apply_regional(self, blocks: Sequence[nn.Module], tail: nn.Module | None, *,
                       framework: str | None = None, eager: Collection[int] = ()) -> None:
        """Set this rank's budget and compile each block of ``blocks`` that is not checkpointed, and
        ``tail`` (a :class:`ModelWithLoss`: its loss function) when given, each in place. No block:
        one warning line, and the model runs eagerly. ``framework``: the integration whose loop calls
        the loss (no tail; the report's ``tail`` names it). ``eager``: indices of blocks left eager
        although not checkpointed (a verification's rng-replay reference: ``VerifyRun.eager_blocks``)."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        kwargs = self._set_budget()
        compiled = checkpointed = kept = 0
        for index, block in enumerate(blocks):
            if isinstance(block, CheckpointWrapper):
                checkpointed += 1
                continue
            if index in eager:
                kept += 1
                continue
            self.compile_module(block, kwargs, ddp_split=False)
            compiled += 1
        tail_text = (f"none: the {framework} integration's loop computes the loss (the blocks alone are compiled)" if framework else
                     "none: the loss is computed outside the model (pass it as plan.wrap(model, loss=fn) to compile it)")
        if tail is not None and callable(getattr(tail, "loss_fn", None)):
            tail.loss_fn = self.compiled_function(tail.loss_fn, kwargs, ddp_split=False)
            tail_text = "the loss (plan.wrap(loss=...))"
        self.regions = {"blocks": compiled, "checkpointed_eager": checkpointed, "tail": tail_text}
        if kept:
            self.regions["eager_for_verification"] = kept
        if not blocks:
            self.regions["note"] = "no repeated blocks found: ran eagerly"
            warnings.warn(
                "autobalance: compile_scope='regional' but the model has no repeated blocks to compile; it runs "
                "eagerly. Name them with plan.wrap(model, blocks='path.to.blocks') (or the integration's blocks=), "
                "or use compile_scope='whole'.", stacklevel=2)

    def compiled_function(self, fn: Any, kwargs: dict[str, Any], *, ddp_split: bool = True) -> Any:
        """``fn`` compiled with ``kwargs``; a rank with micro-steps of several sizes marks the batch
        dimension dynamic before each call; ``ddp_split=False``: DDPOptimizer's bucket split off."""
        compiled = torch.compile(fn, **kwargs)
        if self.dynamic_batch:
            sizes = self.sizes
            mark = getattr(torch._dynamo, "maybe_mark_dynamic", None) or torch._dynamo.mark_dynamic
            inner = compiled

            def compiled(*args: Any, **kw: Any) -> Any:  # eager: marks before Dynamo sees the call
                for value in (*args, *kw.values()):
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) in sizes:
                        mark(value, 0)
                return inner(*args, **kw)
        if ddp_split:
            return compiled
        patch = torch._dynamo.config.patch(optimize_ddp=False)
        whole = compiled

        def unsplit(*args: Any, **kw: Any) -> Any:
            with patch:
                return whole(*args, **kw)
        return unsplit

    def compile_module(self, module: nn.Module, kwargs: dict[str, Any], *, ddp_split: bool = True) -> None:
        """Compile ``module`` in place (its ``_compiled_call_impl``, as ``nn.Module.compile`` does)."""
        call_impl = module._call_impl

        def call(*args: Any, **kw: Any) -> Any:  # a frame outside Dynamo's skip list, as torch.compile(module) adds
            return call_impl(*args, **kw)

        # nn.Module.compile() would compile _call_impl itself, a frame Dynamo skips: a model made only
        # of torch.nn modules (nn.Sequential of nn.Linear, ...) would then silently run eagerly
        module._compiled_call_impl = self.compiled_function(call, kwargs, ddp_split=ddp_split)

    # ------------------------------------------------------------------ hooks called by Plan
    def on_wrapped(self, plan: Plan, wrapped: nn.Module) -> None:
        if plan.model is None:
            return
        if self.scope == "regional":
            tail = plan.model if isinstance(plan.model, ModelWithLoss) else None
            eager = plan.verify.eager_blocks if plan.verify is not None else None
            self.apply_regional(list(plan.block_run or ()), tail, framework=plan.model_info.get("framework"),
                                eager=eager[plan.rank] if eager else ())
        else:
            self.apply(plan.model)  # in place, inside DDP (which stays as it is)

    def on_micro_step(self, plan: Plan) -> Any:
        """Dynamo does not compile under a dispatch mode: the CPU tracker steps aside. CUDA graphs
        (``reduce-overhead``): a new step of the graphs begins, and every gradient exists before the
        backward (see :meth:`keep_gradients`)."""
        if self.cuda_graphs and plan.model is not None:
            torch.compiler.cudagraph_mark_step_begin()
            self.keep_gradients(plan.model)
        return plan.meter.paused()

    @property
    def cuda_graphs(self) -> bool:
        """Whether this mode captures CUDA graphs."""
        return self.mode in CUDA_GRAPH_MODES

    @staticmethod
    def keep_gradients(model: nn.Module) -> int:
        """Give every trainable parameter without a gradient a zero one; returns how many.

        With CUDA graphs the backward's outputs live in the graphs' memory pool and the next replay
        overwrites them. A parameter whose ``.grad`` is None would take that output as its gradient
        (autograd's AccumulateGrad keeps the tensor it is given), and the next micro-step's replay
        would overwrite the gradient being accumulated; a gradient that already exists is added
        into, in place, so it survives. Measured on one H200 (``benchmarks/compile_probe.py``,
        gradients kept this way): the accumulated step's gradients match eager bf16's as closely as
        the default mode's (4.0e-3 relative, bf16 rounding), 4 x 8 at 152 ms instead of 269 ms."""
        made = 0
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
                    made += 1
        return made

    def after_backward(self, plan: Plan) -> None:
        """The gradients were made while the tracker was paused: count them now."""
        if plan.model is not None:
            plan.meter.track(p.grad for p in plan.model.parameters() if p.grad is not None)

    def step_timed(self, plan: Plan, seconds: float) -> bool:
        """The first step is where compilation happens: it is ``compile_s``, not a measured step."""
        if self.compile_s is not None:
            return False
        self.first_step_done(seconds)
        plan.meter.close_compile_step()  # the compiling step's peaks, apart from the steady state's
        return True

    def first_step_done(self, seconds: float) -> None:
        """The first optimizer step (where compilation happens) took ``seconds``."""
        import torch._functorch.config as functorch_config

        self.compile_s = seconds
        # what the partitioner read: a script that changed it after wrap() is visible here
        self.budget_used = float(functorch_config.activation_memory_budget)
        self._after_first_step = _counters()

    def to_dict(self, *, device_type: str) -> dict[str, Any]:
        now = _counters()
        first = self._after_first_step or now
        delta = {k: now.get(k, 0) - self._before.get(k, 0) for k in now}
        later = {k: now.get(k, 0) - first.get(k, 0) for k in now}
        inductor = getattr(getattr(torch, "_inductor", None), "config", None)
        return {
            "mode": self.mode,
            "scope": self.scope,
            **({"regions": dict(self.regions)} if self.scope == "regional" else {}),
            "backend": self.backend,
            "activation_budget": self.budget_used,
            "activation_budget_requested": self.budget_requested,
            "compile_s": self.compile_s,
            "dynamic_batch": self.dynamic_batch,
            "cache": {
                "fx_graph_hits": delta.get("inductor.fxgraph_cache_hit", 0),
                "fx_graph_misses": delta.get("inductor.fxgraph_cache_miss", 0),
                "fx_graph_bypasses": delta.get("inductor.fxgraph_cache_bypass", 0),
                "aot_autograd_hits": delta.get("aot_autograd.autograd_cache_hit", 0),
                "aot_autograd_misses": delta.get("aot_autograd.autograd_cache_miss", 0),
                "dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                "fx_graph_cache": bool(getattr(inductor, "fx_graph_cache", False)) if inductor else None,
            },
            "graphs": delta.get("stats.unique_graphs", 0),
            "graph_breaks": delta.get("graph_breaks", 0),
            "recompiles_after_first_step": later.get("stats.unique_graphs", 0),
            # on CPU the live-tensor tracker (a dispatch mode) would stop Dynamo from compiling, so it
            # is paused inside micro-steps: tensors allocated there (activations) are not counted
            "activations_measured": device_type == "cuda",
        }
