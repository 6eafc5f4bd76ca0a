"""Where one rank's memory goes during the first optimizer step, and what the runtime can see of
the usual causes of imbalance (for ``autobalance diagnose``).

A :class:`~autobalance.runtime._parts.Part` of a trial's plan, called at the plan's fixed points; every figure is bytes of live
tensors on the rank's device (the CPU tracker on CPU, the CUDA caching allocator on CUDA):

- ``held_at_wrap``: live when ``plan.wrap()`` is entered (memory held before training, e.g. a
  model loaded onto the device early or rank-0 extras), ``model_on_device_at_wrap`` of which is
  the model's own parameters and buffers already on the device;
- ``parameters``, ``buffers``; ``ddp_buckets``: the DDP reducer's flat gradient buckets, one copy
  of the trainable parameters (``ddp_constructor_growth`` is what the constructor allocated, which
  on non-source ranks includes broadcast buffers that are freed later);
- ``gradients``: distinct gradient storages after the first backward;
- ``optimizer_state``: growth across the first ``optimizer.step()`` (``optimizer_state_tensors``:
  the bytes of the tensors in ``optimizer.state`` afterwards);
- ``activations_peak``: peak during the first forward minus what was live before it;
  ``first_backward_peak``: the same up to the end of the first backward (gradients included);
- ``live_after_step``: live after the latest optimizer step (gradients already set to None):
  subtracting parameters, buffers, DDP buckets and optimizer state leaves what the rank holds
  outside training state (``held_outside_training``): extras such as an EMA copy or a cache.

``torch.distributed._tools.mem_tracker.MemTracker`` is used for the category/module breakdown of
the first step when ``AUTOBALANCE_DIAGNOSE=1`` (it works with DDP, checkpoint wrappers and
autocast on this torch version). It only sees tensors created while it is active plus the model
and optimizer, so the extras held before training come from the live-byte figures above.

MemTracker supports one top-level call of a module per iteration: a script that calls its model
again before the first optimizer step (a no-grad pass for a teacher's target or an EMA's
evaluation, a second forward, accumulation over several micro-steps) makes its forward pre-hook raise
``NotImplementedError`` ("does not support memory tracking for multiple iterative calls") inside the
script's own forward, which ended the run. Its hooks are guarded: on that error the tracker stops
(its category peak then covers the step up to the second call) and the per-module rows fall back to
forward hooks measuring each module's live-memory growth across its forward, the largest over its
calls, merged with what MemTracker saw of the first call; ``note`` says so. Any other error of the
tracker's hooks drops the module breakdown (``error``) instead of the script's run.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autobalance.runtime._meter import MemoryMeter
from autobalance.runtime._parts import Part

if TYPE_CHECKING:
    from autobalance.runtime._plan import Plan

__all__ = ["Breakdown"]


def _storage_bytes(tensors: Any, device: torch.device) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = getattr(t, "_local_tensor", t)  # a DTensor (FSDP2): this rank's shard
        if t.device.type != device.type:
            continue
        try:
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                continue
            key = storage.data_ptr()  # raises for a storage FSDP2 resized to nothing
        except (NotImplementedError, RuntimeError):
            continue
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _contains_data_parallel(model: nn.Module) -> bool:
    return any(isinstance(m, nn.DataParallel) for m in model.modules())


def _autocast_state(device_type: str) -> dict[str, Any]:
    try:
        enabled = bool(torch.is_autocast_enabled(device_type))
        dtype = str(torch.get_autocast_dtype(device_type)).replace("torch.", "") if enabled else None
    except (TypeError, AttributeError, RuntimeError):
        return {"enabled": None, "dtype": None}
    return {"enabled": enabled, "dtype": dtype}


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        for item in value.values():
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


class Breakdown(Part):
    """Collects one rank's memory breakdown and flags; see the module docstring."""

    def __init__(self, *, device: torch.device, meter: MemoryMeter, diagnose: bool = False) -> None:
        """``diagnose``: a run of ``autobalance diagnose`` (``TrialEnv.diagnose``): add MemTracker's module rows."""
        self.device = device
        self.meter = meter
        self.tracker = meter.tracker
        self.figures: dict[str, int | None] = {}
        self.flags: dict[str, Any] = {}
        self.modules: list[dict[str, Any]] = []
        self.categories: dict[str, int] | None = None
        self.error: str | None = None
        self._fwd_started = self._bwd_done = self._step_done = False
        self._live_before_fwd = 0
        self._live_before_opt = 0
        self._live_before_ddp = 0
        self._trainable = 0
        self._wrapped: nn.Module | None = None
        self._memtracker: Any = None
        self._want_memtracker = diagnose
        self.note: str | None = None
        """Why the module rows are not MemTracker's alone (the model called more than once per step)."""
        self._module_hooks: list[Any] = []
        self._module_growth: dict[str, int] = {}

    # ------------------------------------------------------------------ measuring primitives
    @property
    def active(self) -> bool:
        return self.device.type == "cuda" or self.tracker is not None

    def live(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return int(self.tracker.live_bytes) if self.tracker is not None else 0

    def _start_window(self) -> None:
        if self.device.type == "cuda":
            self.meter.peak_floor = (int(torch.cuda.max_memory_allocated(self.device)),
                                     int(torch.cuda.max_memory_reserved(self.device)))
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.tracker is not None:
            self.tracker.start_window()

    def _window_peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(self.tracker.window_peak) if self.tracker is not None else 0

    # ------------------------------------------------------------------ hooks called by Plan
    def on_wrap(self, plan: Plan, model: nn.Module) -> None:
        self.flags["data_parallel"] = _contains_data_parallel(model)
        if not self.active:
            return
        self.figures["held_at_wrap"] = self.live()
        self.figures["model_on_device_at_wrap"] = _storage_bytes(
            [*model.parameters(), *model.buffers()], self.device)

    def on_model_moved(self, plan: Plan, model: nn.Module) -> None:
        self.figures["parameters"] = _storage_bytes(model.parameters(), self.device)
        self.figures["buffers"] = _storage_bytes(model.buffers(), self.device)
        self._trainable = _storage_bytes((p for p in model.parameters() if p.requires_grad), self.device)
        self._live_before_ddp = self.live() if self.active else 0

    def on_wrapped(self, plan: Plan, wrapped: nn.Module) -> None:
        compiled = plan.compile_state is not None
        if self.active:
            ddp = isinstance(wrapped, nn.parallel.DistributedDataParallel)
            self.figures["ddp_buckets"] = self._trainable if ddp else 0
            self.figures["ddp_constructor_growth"] = max(0, self.live() - self._live_before_ddp) if ddp else 0
        self.flags.update({
            "find_unused_parameters": plan.model_info["find_unused_parameters"],
            "num_blocks": plan.model_info["num_blocks"], "checkpointed_blocks": len(plan.config.checkpoint[plan.rank]),
            "micro_batch": plan.micro_batch, "compiled": compiled,
            "loss_in_model": bool(plan.model_info.get("loss_in_model")),
        })
        if compiled:
            self._want_memtracker = False  # a dispatch mode: Dynamo would not compile under it
        handles: list[Any] = []

        # eager only (never traced): at world size 1 the model is the compiled module and these hooks
        # run inside it; traced under verification's no-dropout mode with a dynamic batch dimension,
        # Dynamo answered the hook's numel() with a torch.Size (H200, benchmarks/2026-12-03-h200c)
        @torch._dynamo.disable  # type: ignore[untyped-decorator]
        def pre_hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
            handles[0].remove()
            self.flags["autocast"] = _autocast_state(self.device.type)
            first = _first_tensor(args) if args else _first_tensor(kwargs)
            self.flags["input_shape"] = list(first.shape) if first is not None else None
            self.flags["input_numel"] = int(first.numel()) if first is not None else None

        @torch._dynamo.disable  # type: ignore[untyped-decorator]
        def post_hook(_module: nn.Module, _args: Any, output: Any) -> None:
            handles[1].remove()
            out = _first_tensor(output)
            self.flags["output_dtype"] = str(out.dtype).replace("torch.", "") if out is not None else None
            self.flags["output_bytes"] = int(out.numel() * out.element_size()) if out is not None else None

        handles.append(wrapped.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(wrapped.register_forward_hook(post_hook))
        self._wrapped = wrapped

    def on_micro_step(self, plan: Plan) -> None:
        if self._fwd_started or not self.active:
            return None
        self._fwd_started = True
        self._live_before_fwd = self.live()
        self.figures["live_before_first_forward"] = self._live_before_fwd
        self._start_window()
        if self._want_memtracker and self._wrapped is not None:
            self._enter_memtracker()

    def before_backward(self, plan: Plan) -> None:
        if self._fwd_started and not self._bwd_done and self.active and "activations_peak" not in self.figures:
            self.figures["activations_peak"] = max(0, self._window_peak() - self._live_before_fwd)

    def after_backward(self, plan: Plan) -> None:
        model = plan.model
        if self._bwd_done or not self._fwd_started or not self.active:
            return
        self._bwd_done = True
        self.figures["first_backward_peak"] = max(0, self._window_peak() - self._live_before_fwd)
        if model is not None:
            self.figures["gradients"] = _storage_bytes(
                (p.grad for p in model.parameters() if p.grad is not None), self.device)

    def before_optimizer_step(self, plan: Plan, optimizer: torch.optim.Optimizer) -> None:
        if self._step_done or not self.active:
            return
        self._live_before_opt = self.live()
        if self._memtracker is not None:
            try:
                self._memtracker.track_external(optimizer)
            except Exception as exc:
                self._drop_memtracker(exc)

    def after_optimizer_step(self, plan: Plan, optimizer: torch.optim.Optimizer) -> None:
        if not self.active:
            return
        if not self._step_done:
            self._step_done = True
            self.figures["optimizer_state"] = max(0, self.live() - self._live_before_opt)
            self.figures["optimizer_state_tensors"] = _storage_bytes(
                (t for state in optimizer.state.values() for t in state.values()), self.device)
            self.figures["first_step_peak"] = max(0, self._window_peak() - self._live_before_fwd)
            self._exit_memtracker()
            self._remove_module_hooks()

    def after_step(self, plan: Plan) -> None:
        if self.active:
            self.figures["live_after_step"] = self.live()

    # ------------------------------------------------------------------ MemTracker
    def _enter_memtracker(self) -> None:
        try:
            from torch.distributed._tools.mem_tracker import MemTracker

            tracker = MemTracker()
            assert self._wrapped is not None
            tracker.track_external(self._wrapped)
            self._guard_hooks(tracker)
            tracker.__enter__()
            self._memtracker = tracker
        except Exception as exc:
            self._drop_memtracker(exc)

    def _guard_hooks(self, tracker: Any) -> None:
        """Wrap the module hooks MemTracker registers on entry (its bound methods, looked up then) so
        that an error in them ends the tracking, not the script's forward or backward."""
        for name in ("_pre_fw_hook", "_post_fw_hook", "_pre_bw_hook", "_post_bw_hook"):
            hook = getattr(tracker, name, None)
            if callable(hook):
                setattr(tracker, name, self._guarded(tracker, hook))

    def _guarded(self, tracker: Any, hook: Any) -> Any:
        def guarded(module: nn.Module, *args: Any) -> None:
            if self._memtracker is not tracker:
                return  # stopped: a hook the engine or a module call already holds
            try:
                hook(module, *args)
            except NotImplementedError as exc:
                if "multiple iterative calls" not in str(exc):
                    self._drop_memtracker(exc)
                    return
                self._called_again(module)
            except Exception as exc:
                self._drop_memtracker(exc)

        return guarded

    def _called_again(self, module: nn.Module) -> None:
        """The script calls ``module`` a second time before the first optimizer step: stop
        MemTracker (keeping what it saw of the first call) and measure the module rows with forward hooks."""
        self.note = (f"the script calls its {type(module).__name__} more than once before the first optimizer step "
                     "(a second forward, a no-grad pass, several micro-steps); PyTorch's MemTracker tracks one call "
                     "per step, so it stopped at the second call (its category peak covers the step up to there) and "
                     "the per-module rows are each module's live-memory growth across its forward, the largest "
                     "over its calls")
        self._exit_memtracker()
        if self._wrapped is None or not self.active:
            return
        root = type(self._wrapped).__name__
        for name, sub in self._wrapped.named_modules():
            fqn = f"{root}.{name}" if name else root
            if fqn.count(".") > 3:
                continue
            start: list[int] = []

            def pre(_m: nn.Module, _args: Any, start: list[int] = start) -> None:
                start.append(self.live())

            def post(_m: nn.Module, _args: Any, _out: Any, start: list[int] = start, fqn: str = fqn) -> None:
                if start:
                    grown = max(0, self.live() - start.pop())
                    self._module_growth[fqn] = max(self._module_growth.get(fqn, 0), grown)

            self._module_hooks.append(sub.register_forward_pre_hook(pre))
            self._module_hooks.append(sub.register_forward_hook(post, always_call=True))

    def _remove_module_hooks(self) -> None:
        hooks, self._module_hooks = self._module_hooks, []
        for handle in hooks:
            handle.remove()
        if not self._module_growth:
            return
        rows = {str(r["module"]): dict(r) for r in self.modules}
        for fqn, grown in self._module_growth.items():
            row = rows.setdefault(fqn, {"module": fqn, "forward_activations": 0, "local_peak": 0})
            row["forward_activations"] = max(int(row["forward_activations"]), grown)
        self.modules = sorted(rows.values(), key=lambda r: -int(r["forward_activations"]))[:8]

    def _exit_memtracker(self) -> None:
        tracker = self._memtracker
        if tracker is None:
            return
        self._memtracker = None
        try:
            tracker.__exit__(None, None, None)
            peak = tracker.get_tracker_snapshot("peak").get(self.device)
            if peak is None and self.device.type == "cuda":
                peak = next(iter(tracker.get_tracker_snapshot("peak").values()), None)
            if peak:
                self.categories = {str(getattr(k, "value", k)).lower(): int(v) for k, v in peak.items()}
            rows: list[dict[str, Any]] = []
            for stats in list(tracker.memory_tracking.values()):
                fqn = str(stats.mod_fqn)
                if fqn.count(".") > 3:
                    continue
                act = 0
                for state, snaps in stats.snapshots.items():
                    if "forward" not in str(getattr(state, "value", state)).lower():
                        continue
                    for snap in snaps:
                        for dev_snap in snap.values():
                            act = max(act, int(next((v for k, v in dev_snap.items()
                                                     if str(getattr(k, "value", k)) == "Activation"), 0)))
                rows.append({"module": fqn, "forward_activations": act,
                             "local_peak": int(max(stats.local_peak.values(), default=0))})
            rows.sort(key=lambda r: -int(r["forward_activations"]))
            self.modules = rows[:8]
        except Exception as exc:
            self._drop_memtracker(exc)

    def _drop_memtracker(self, exc: BaseException) -> None:
        self.error = f"MemTracker: {type(exc).__name__}: {exc}"[:300]
        tracker, self._memtracker = self._memtracker, None
        if tracker is not None:
            try:
                tracker.__exit__(None, None, None)
            except Exception:
                pass
        warnings.warn(f"autobalance: module breakdown unavailable ({self.error})", stacklevel=3)

    # ------------------------------------------------------------------ report
    def to_dict(self) -> dict[str, Any]:
        fig = dict(self.figures)
        after = fig.get("live_after_step")
        if after is not None:
            state = sum(int(fig.get(k) or 0) for k in ("parameters", "buffers", "ddp_buckets"))
            state += int(fig.get("optimizer_state_tensors") or fig.get("optimizer_state") or 0)
            fig["held_outside_training"] = max(0, after - state)
        held = fig.get("held_at_wrap")
        if held is not None:
            fig["held_before_wrap_excluding_model"] = max(0, held - int(fig.get("model_on_device_at_wrap") or 0))
        return {"bytes": fig, "flags": dict(self.flags), "memtracker_peak": self.categories,
                "modules": self.modules, "error": self.error, "note": self.note}
