"""The verifier: prove that a tuned configuration computes the update the script's own configuration
computes, before anyone trains with it.

Each figure is one relative L2 error over all parameters, ``|a - b| / |b|``: of the gradients (what
the configuration computes), of the updated parameters (what training continues from), of the update
(``updated - starting weights``) and of the buffers. Every run holds full fp32 precision (TF32 and
reduced-precision reductions off, even when the script turns them on: see
:mod:`autobalance.runtime._verify`) and runs in train mode with every dropout probability at 0.

0. **The floor** (``floor``): the fp32 reference against itself with each micro-batch's samples in
   reverse order: this model's rounding on this device (see :mod:`autobalance.verify._tolerance`).
   Part 1's bound is ``FLOOR_FACTOR`` times it, within ``[BOUND_MIN, BOUND_MAX]``.

1. **The configuration's math** (``equivalence``): the tuned configuration run in fp32 against the
   baseline configuration in fp32 (the baseline itself when it is fp32, else one more run of it in
   fp32), within the bound. A compiled configuration in bf16/fp16 is checked eager here (the split,
   accumulation, checkpointing and buckets are what weight the loss; its compiled graph is checked
   by part 2, cached from the study). A broken loss weighting (a sum-reduced loss, a token mean
   without ``count=``, a term over the micro-batch) fails here far above the floor and can never hide
   in bf16/fp16 rounding; a failure within ``ROUNDING_FACTOR`` times the floor is named rounding.
   Batch-dependent layers (BatchNorm) train as in training, running statistics included
   (``allow_batch_dependent``: those layers in eval mode).

2. **The dtype's effect** (``dtype``, tuned in bf16/fp16 only): the baseline configuration run in the
   tuned dtype against the fp32 reference (``noise``) must look like rounding (not above
   ``NOISE_LIMIT`` in gradients nor ``UPDATE_LIMIT`` in the update: else gradients clipped while
   scaled, or a scale removed twice); the tuned configuration in its dtype must then be within
   ``max(bound, NOISE_FACTOR x noise)`` of the fp32 reference.

3. **RNG replay** (only when the tuned configuration recomputes - checkpointed blocks, or compile with
   a budget below 1 - and the model has dropout): dropout on, the tuned configuration against itself
   without the recomputation. Recomputation must not change anything, buffers included.

An fp16 run whose first step overflows (the GradScaler skips it) runs that step again at the scale
the scaler settles on; the verdict says so.

What it cannot see: steps after the first, data other than the first global batch, and multi-node
configurations (verified on one node only when asked). Any run that fails, or takes other samples
than the baseline, fails the verification.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

from autobalance._config import BalanceConfig, split_evenly
from autobalance._errors import UsageError
from autobalance.protocol import Status
from autobalance.verify._result import (
    BUFFER_CAUSES,
    Check,
    Failure,
    Verification,
    fp32_causes,
    relative,
)
from autobalance.verify._runs import RunFailed, Runner, SharedRuns, StepResult, VerifyTarget
from autobalance.verify._tolerance import (
    FLOOR_FACTOR,
    NOISE_FACTOR,
    ROUNDING_FACTOR,
    bound_from_floor,
    floor_too_high,
    noise_problem,
    rounding_likely,
)

__all__ = ["Verifier", "recomputes", "without_recompute"]

_PRECISION_NAMES = {"tf32_matmul": "TF32 matmuls"}


def recomputes(config: BalanceConfig) -> bool:
    """Whether ``config`` recomputes activations (checkpointing, or a compile budget below 1)."""
    if any(config.checkpoint):
        return True
    return config.compile != "off" and any(b < 1.0 for b in (config.activation_budget or []))


def without_recompute(config: BalanceConfig) -> BalanceConfig:
    return dataclasses.replace(config, checkpoint=[[] for _ in config.micro_batches], activation_budget=None)


def eager_in_replay(config: BalanceConfig) -> list[list[int]] | None:
    """The blocks the rng-replay reference of ``config`` keeps eager: under a regional compile a
    checkpointed block runs eagerly (``runtime/_compile.py``), and compiled dropout draws other masks
    than eager dropout, so the reference without recomputation runs those blocks eagerly too (not
    checkpointed); None: nothing to keep eager."""
    if config.compile == "off" or config.compile_scope != "regional" or not any(config.checkpoint):
        return None
    return [list(blocks) for blocks in config.checkpoint]


def _eager_fp32(config: BalanceConfig) -> BalanceConfig:
    """``config`` in fp32; a compiled one in bf16/fp16 runs eager (part 1 checks the arrangement)."""
    if config.dtype != "fp32" and config.compile != "off":
        return dataclasses.replace(config, dtype="fp32", compile="off", compile_scope="whole", activation_budget=None)
    return dataclasses.replace(config, dtype="fp32")


class Verifier:
    """Launches the verification runs of one configuration and judges them (see the module doc)."""

    def __init__(self, target: VerifyTarget, *, note: Callable[[str], None] | None = None,
                 allow_batch_dependent: bool = False, shared: SharedRuns | None = None) -> None:
        self.target = target
        self.note = note or (lambda text: None)
        self.allow_batch_dependent = allow_batch_dependent
        self._owns_shared = shared is None
        self._shared = shared if shared is not None else SharedRuns()
        self._runner = Runner(target, shared=self._shared, allow_batch_dependent=allow_batch_dependent, note=self.note)
        self._floor: Check | None = None
        self._bound: tuple[float, float, float] | None = None

    def close(self) -> None:
        if self._owns_shared:
            self._shared.close()

    # ------------------------------------------------------------------ judging
    def _compare(self, name: str, a: StepResult, b: StepResult, tolerance: tuple[float, float, float] | None) -> Check:
        if set(a.grads) != set(b.grads) or set(a.params) != set(b.params):
            missing = sorted(set(a.grads) ^ set(b.grads))[:3] or sorted(set(a.params) ^ set(b.params))[:3]
            raise RunFailed(a.name, f"its parameters differ from the {b.name} run's (e.g. {missing})")
        if not b.grads:
            raise RunFailed(b.name, "no parameter had a gradient")
        grad_rel, worst = relative(a.grads, b.grads)
        init = self._shared.init
        upd_a = {k: v - init[k].float() for k, v in a.params.items() if k in init}
        upd_b = {k: v - init[k].float() for k, v in b.params.items() if k in init}
        update_rel, _ = relative(upd_a, upd_b)
        param_rel, _ = relative(a.params, b.params)
        shared = sorted(set(a.buffers) & set(b.buffers))
        buffer_rel, worst_buffer = relative({k: a.buffers[k] for k in shared}, {k: b.buffers[k] for k in shared})
        return Check(name=name, runs=(a.name, b.name), grad_rel=grad_rel, param_rel=param_rel, update_rel=update_rel,
                     buffer_rel=buffer_rel, tolerance=tolerance, worst=worst, worst_buffer=worst_buffer)

    def verify(self, tuned: BalanceConfig, *, baseline: BalanceConfig | None = None) -> Verification:
        """Run and judge; ``baseline``: the study's baseline configuration when known (a tuned
        configuration equal to it needs no proof)."""
        start = time.monotonic()
        if baseline is not None and baseline.to_dict() == tuned.to_dict():
            return Verification(passed=True, skipped=True, reason="the configuration is the script's own (nothing to verify)")
        os.makedirs(self.target.work_dir, exist_ok=True)
        checks: list[Check] = []
        try:
            result = self._verify(tuned, checks)
        except RunFailed as exc:
            result = Verification(passed=False, reason=f"{exc}", failure=Failure.RUN)
        finally:
            self.close()
        result.checks = checks
        result.runs = dict(self._runner.runs)
        result.seconds = dict(self._runner.seconds)
        result.wall_s = time.monotonic() - start
        if self._floor is not None and self._bound is not None:
            result.floor, result.bound = self._floor.grad_rel, self._bound[0]
        result.notes = self._notes()
        if result.notes and not result.skipped:
            result.reason += "; " + "; ".join(result.notes)
        return result

    def _notes(self) -> list[str]:
        notes = []
        results = self._runner.results
        skipped = [r for r in results if r.overflow_skips]
        if skipped:
            runs = ", ".join(f"{r.name} ({r.overflow_skips}x, then scale {r.info.get('scale', '?')})" for r in skipped)
            notes.append(f"fp16 overflow: the first step of the {runs} run(s) overflowed and the GradScaler skipped it; "
                         "it was run again at the scale the scaler settled on")
        dependent = next((r.info.get("batch_dependent") for r in results if r.info.get("batch_dependent")), None)
        if dependent:
            shown = ", ".join(dependent[:3]) + (f" and {len(dependent) - 3} more" if len(dependent) > 3 else "")
            if self.allow_batch_dependent:
                notes.append(f"batch-dependent layers ({shown}) verified in eval mode (allowed to change: "
                             "their batch statistics differ with the split)")
            else:
                notes.append(f"batch-dependent layers ({shown}) verified in train mode, running statistics included")
        held = sorted({k for r in results for k, on in (r.info.get("script_precision") or {}).items() if on})
        if held:
            notes.append(f"{', '.join(_PRECISION_NAMES.get(k, k) for k in held)} (set by the script) held off in the fp32 "
                         "verification runs, so rounding stays far below a wrong weighting")
        return notes

    def _run(self, name: str, config: BalanceConfig | None, *, dropout: str, global_batch: int,
             reverse: bool = False, eager_blocks: list[list[int]] | None = None) -> StepResult:
        return self._runner.run(name, config, dropout=dropout, global_batch=global_batch, reverse=reverse,
                                eager_blocks=eager_blocks)

    def _same_samples(self, run: StepResult, base: StepResult) -> None:
        if run.samples != base.samples:
            raise RunFailed(run.name, f"it took other samples than the baseline's first global batch "
                                      f"({len(run.samples)} vs {len(base.samples)} samples)")

    def _verify(self, tuned: BalanceConfig, checks: list[Check]) -> Verification:
        gb = tuned.global_batch
        try:
            base = self._run("baseline", None, dropout="off", global_batch=gb)
            note = ""
        except RunFailed as exc:
            fallback = self._fallback_reference(tuned)
            if fallback is None or Status.OOM not in str(exc):
                raise
            base = self._run("baseline-small", fallback, dropout="off", global_batch=gb)
            shape = (f"{fallback.micro_batches} x accumulation {fallback.accumulation}" if fallback.equal_micro_batches
                     else f"{fallback.split_text()}")
            note = f" (the script's own configuration ran out of memory; the reference is the even split {shape})"
        base_cfg = BalanceConfig.from_dict(base.config)
        if base_cfg.global_batch != gb:
            raise UsageError(
                f"the configuration's global_batch={gb} differs from the script's {base_cfg.global_batch}; "
                "verify a configuration of this script's study."
            )
        fp32_base = _eager_fp32(base_cfg)
        reference = base if base_cfg.dtype == "fp32" else self._run(
            "baseline-fp32", fp32_base, dropout="off", global_batch=gb)
        # part 0: the rounding floor of this model on this device
        floor_run = self._run("floor", fp32_base, dropout="off", global_batch=gb, reverse=True)
        self._same_samples(floor_run, base)
        floor = self._compare("floor", floor_run, reference, None)
        checks.append(floor)
        bound = bound_from_floor(floor)
        self._floor, self._bound = floor, bound
        limits = (f"bound {bound[0]:.1e} = {FLOOR_FACTOR:g}x the rounding floor {floor.grad_rel:.1e} measured "
                  "in this verification")
        if floor_too_high(floor):
            return Verification(passed=False, failure=Failure.FLOOR, reason=(
                f"the script's own step is not reproducible enough to verify: taking each micro-batch's samples in "
                f"reverse order changes its fp32 gradients by {floor.grad_rel:.1e} (a wrong weighting of 1e-3 would hide "
                "in that); make the step deterministic (torch.use_deterministic_algorithms(True), no atomics-based "
                f"kernels) and verify again{note}"))
        # part 1: the configuration's math, both in fp32
        math_cfg = _eager_fp32(tuned)
        math_run = self._run("tuned" if tuned.dtype == "fp32" else "tuned-fp32", math_cfg, dropout="off",
                             global_batch=gb)
        self._same_samples(math_run, base)
        equivalence = self._compare("equivalence", math_run, reference, bound)
        checks.append(equivalence)
        if not equivalence.passed:
            where = "" if tuned.dtype == "fp32" else " (both run in fp32)"
            if not equivalence.finite:
                failure, causes = Failure.MATH, "check the loss for inf/nan"
            elif equivalence.buffers_only:
                failure, causes = Failure.BUFFERS, BUFFER_CAUSES
            elif rounding_likely(equivalence, floor):
                failure = Failure.ROUNDING
                causes = (f"within {ROUNDING_FACTOR:g}x the floor, so rounding is the likely cause, not the loss: this "
                          "model's arrangements round further apart than its sample order does; verify again, and if "
                          "it fails again keep the script's split or make the step deterministic "
                          "(torch.use_deterministic_algorithms(True))")
            else:
                framework = next((r.info.get("framework") for r in self._runner.results if r.info.get("framework")),
                                 None)
                loss_causes = fp32_causes(framework if isinstance(framework, str) else None)
                failure, causes = Failure.MATH, loss_causes
                dependent = next((r.info.get("batch_dependent") for r in self._runner.results
                                  if r.info.get("batch_dependent")), None)
                if dependent and not self.allow_batch_dependent:  # the model's own layers: the first suspect
                    shown = ", ".join(dependent[:3]) + (f" and {len(dependent) - 3} more" if len(dependent) > 3 else "")
                    causes = (f"first suspect: the batch-dependent layers ({shown}) compute statistics over each "
                              "micro-batch in train mode, so another split changes the step: keep the script's split, "
                              "or accept the change with --allow-batch-dependent (verified in eval mode); other "
                              + loss_causes)
            return Verification(passed=False, failure=failure, reason=(
                f"its step differs from the baseline's{where}: {equivalence.figures()}, {limits}{note}; {causes}"))
        tolerance = bound
        precision: Check | None = None
        noise_grad = 0.0
        # part 2: the dtype's effect, against the baseline's own rounding
        if tuned.dtype != "fp32":
            same = base if base_cfg.dtype == tuned.dtype else self._run(
                f"baseline-{tuned.dtype}", dataclasses.replace(base_cfg, dtype=tuned.dtype), dropout="off",
                global_batch=gb)
            noise = self._compare("noise", same, reference, None)
            checks.append(noise)
            if not noise.finite:
                return Verification(passed=False, failure=Failure.BASELINE_PRECISION, reason=(
                    f"the script's own configuration in {tuned.dtype} has no finite step to compare with "
                    f"({noise.figures()}){note}"))
            noise_grad = noise.grad_rel
            problem = noise_problem(noise)
            if problem is not None:
                return Verification(passed=False, failure=Failure.BASELINE_PRECISION, reason=(
                    f"the script's own configuration in {tuned.dtype} does not compute its fp32 step: {problem}. That "
                    "is not rounding: gradients clipped while still scaled (clip_grad_norm_ before "
                    "plan.optimizer_step: pass plan.optimizer_step(optimizer, clip_grad_norm=...) instead, or call "
                    "plan.scaler.unscale_(optimizer) before clipping), or a loss scale applied or removed twice"
                    f"{note}"))
            tolerance = (max(bound[0], NOISE_FACTOR * noise.grad_rel), max(bound[1], NOISE_FACTOR * noise.param_rel),
                         max(bound[2], NOISE_FACTOR * noise.buffer_rel))
            run = self._run("tuned", tuned, dropout="off", global_batch=gb)
            self._same_samples(run, base)
            precision = self._compare("dtype", run, reference, tolerance)
            checks.append(precision)
            if not precision.passed:
                return Verification(passed=False, failure=Failure.DTYPE, reason=(
                    f"in {tuned.dtype} its step is further from the fp32 reference than {NOISE_FACTOR:g}x the "
                    f"baseline's own {tuned.dtype} error: {precision.figures()}{note}"))
        replayed = False
        if recomputes(tuned):
            if not any(r.info.get("dropout_seen") for r in self._runner.results):
                self.note("verify: no dropout in the model: recomputation has no random masks to replay")
            else:
                replay = self._run("tuned-dropout", tuned, dropout="on", global_batch=gb)
                plain = self._run("tuned-dropout-no-recompute", without_recompute(tuned), dropout="on", global_batch=gb,
                                  eager_blocks=eager_in_replay(tuned))
                check = self._compare("rng-replay", replay, plain, tolerance)
                checks.append(check)
                if not check.passed:
                    why = ("its recomputation updates buffers again (e.g. BatchNorm running statistics)"
                           if check.buffers_only else "dropout masks are not replayed")
                    return Verification(passed=False, failure=Failure.RNG_REPLAY, reason=(
                        f"with dropout, its recomputation changes the step relative to the same configuration without "
                        f"recomputation: {check.figures()}: {why}"))
                replayed = True
        if precision is None:
            what = (f"its step matches the baseline's (gradients {equivalence.grad_rel:.1e}, updated parameters "
                    f"{equivalence.param_rel:.1e} relative; {limits})")
        else:
            what = (f"in fp32 its step matches the baseline's (gradients {equivalence.grad_rel:.1e} relative; {limits}) "
                    f"and in {tuned.dtype} it is within {NOISE_FACTOR:g}x the baseline's own {tuned.dtype} error "
                    f"(gradients {precision.grad_rel:.1e}, the baseline's {noise_grad:.1e})")
        return Verification(passed=True, reason=(
            f"{what}{' and recomputation replays dropout' if replayed else ''}{note}"))

    @staticmethod
    def _fallback_reference(tuned: BalanceConfig) -> BalanceConfig | None:
        """An even split with micro-batches of one or two samples (a micro-step per sample on the
        rank with the most): the least memory a reference can take."""
        world, gb = tuned.world_size, tuned.global_batch
        if gb < world:
            return None
        return BalanceConfig.any_split(rank_samples=split_evenly(gb, [1.0] * world), accumulation=gb // world,
                                       dtype=tuned.dtype)
