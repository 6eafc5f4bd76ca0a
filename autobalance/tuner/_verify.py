"""``autobalance verify``: prove that a tuned configuration computes the update the user's own
configuration computes, before anyone trains with it.

Every run is one optimizer step of the training script as a verification trial (see
:mod:`autobalance.runtime._verify`): the same starting weights (saved by the first run, loaded by
the others), the same global batch (the first ``global_batch`` samples of the epoch's permutation,
whatever the split), no memory cap. Rank 0 saves the averaged, unscaled gradients and the updated
parameters. Each figure is one relative L2 error over all parameters, ``|a - b| / |b|``: of the
gradients (what the configuration computes) and of the updated parameters (what training continues
from). The update itself (``updated - starting weights``) is reported too, for information only: an
optimizer such as Adam normalises every element on its first step, so elements whose gradient is
all cancellation (about 0) get updates of full size from rounding noise alone.

The rule, in two parts whatever the dtype:

1. **The configuration's math** (``equivalence``): the tuned configuration run in fp32 against the
   baseline configuration in fp32 (the baseline itself when it is fp32, else one more run of it in
   fp32): gradients, updated parameters and buffers within ``1e-6`` relative, always. The split,
   accumulation, checkpoint set or compile budget and buckets change nothing in exact arithmetic,
   so a broken loss weighting (a sum-reduced loss, a token mean) fails here and can never hide in
   bf16/fp16 rounding. Dropout is off: the model runs in eval mode, so each sample's computation
   does not depend on its micro-batch - except a model with batch-dependent layers (BatchNorm and
   its kind: see :mod:`autobalance.runtime._batch_dependent`), which runs in train mode (dropout
   layers alone in eval), so the step verified is the step that trains, running statistics
   included; ``allow_batch_dependent``: eval mode (the user accepts changed batch statistics).

2. **The dtype's effect** (``dtype``, tuned in bf16/fp16 only): the tuned configuration in its dtype
   against the same fp32 reference, within ``max(1e-6, NOISE_FACTOR x noise)``, where ``noise`` is
   the error of the baseline configuration run in the tuned dtype (the ``noise`` check): the
   rounding the user already accepts.

3. **RNG replay** (only when the tuned configuration recomputes: checkpointed blocks, or compile
   with a budget below 1). Dropout on (train mode, the global RNG seeded per rank at the first
   step): the tuned configuration against itself without the recomputation (no checkpointing,
   default budget), same split. Recomputation must not change anything, buffers included (a
   recomputed BatchNorm must not update its running statistics twice): within ``1e-6`` in fp32,
   the tolerance of part 2 otherwise. This catches checkpointing that does not replay dropout masks
   and partitioner bugs that recompute random ops with new random numbers.

An fp16 run whose first step overflows (the GradScaler skips it) runs that step again at the scale
the scaler settles on; the verdict says so.

What it cannot see: steps after the first (an optimizer or schedule that behaves differently
later), data other than the first global batch, a loss that differs between runs for reasons of
its own (non-deterministic ops fail part 1 rather than pass), and multi-node configurations
(verified on one node only when asked).

Any run that fails, or takes other samples than the baseline, fails the verification.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autobalance import _env
from autobalance._config import BalanceConfig, split_evenly
from autobalance._errors import UsageError
from autobalance.launcher import TrialLaunch, TrialOutcome, WarmPool, cold_reason, run_trial
from autobalance.protocol import (
    Status,
    StudyAttr,
    TrialAttr,
    best_trial,
    is_feasible,
    weighted_objective,
)
from autobalance.tuner._notes import write_notes

__all__ = [
    "BUFFER_CAUSES",
    "FP32_CAUSES",
    "FP32_TOLERANCE",
    "NOISE_FACTOR",
    "Check",
    "SharedRuns",
    "Verification",
    "Verifier",
    "VerifyTarget",
    "allows_batch_dependent",
    "recomputes",
]

FP32_TOLERANCE = 1e-6
NOISE_FACTOR = 4.0
"""Mixed precision: the tuned configuration may be this many times as far from the fp32 reference
as the baseline configuration is in the same dtype (different splits round different sums)."""

_INIT_FILE = "verify-init.pt"
_STEP_FILE = "verify-step.pt"
_STEP_JSON = "verify-step.json"


def recomputes(config: BalanceConfig) -> bool:
    """Whether ``config`` recomputes activations (checkpointing, or a compile budget below 1)."""
    if any(config.checkpoint):
        return True
    return config.compile != "off" and any(b < 1.0 for b in (config.activation_budget or []))


def without_recompute(config: BalanceConfig) -> BalanceConfig:
    return dataclasses.replace(config, checkpoint=[[] for _ in config.micro_batches], activation_budget=None)


@dataclass(kw_only=True)
class VerifyTarget:
    """Where and how the verification runs are launched (one node)."""

    script: str
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: int
    device: str = "cpu"
    torchrun_args: list[str] = field(default_factory=list)
    timeout_s: float = 300.0
    work_dir: str
    """Directory for the runs (created)."""
    cold: bool = False
    """One torchrun per run instead of a warm worker pool."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the runs (e.g. the study's Inductor cache)."""


@dataclass(kw_only=True)
class StepResult:
    name: str
    config: dict[str, Any]
    trial_dir: str
    grads: dict[str, Any]
    params: dict[str, Any]
    buffers: dict[str, Any]
    samples: list[int]
    info: dict[str, Any]

    @property
    def overflow_skips(self) -> int:
        return int(self.info.get("overflow_skips") or 0)


@dataclass(kw_only=True)
class Check:
    """One comparison of two runs."""

    name: str
    """``equivalence`` (the configuration's math, both in fp32), ``noise`` (how far the baseline
    itself is in mixed precision), ``dtype`` (the tuned configuration in its dtype) or ``rng-replay``."""
    runs: tuple[str, str]
    """(compared, reference)."""
    grad_rel: float
    param_rel: float
    """Of the updated parameters."""
    update_rel: float
    """Of the updates (``updated - starting weights``); informational."""
    buffer_rel: float
    """Of the buffers after the step (running statistics, ``num_batches_tracked``; 0 without buffers)."""
    tolerance: tuple[float, float, float] | None
    """(gradients, updated parameters, buffers); None: informational."""
    worst: str
    """The parameter with the largest relative gradient error (``""``: none stands out)."""
    worst_buffer: str = ""
    """The buffer with the largest relative error (``""``: none differs)."""

    @property
    def buffers_only(self) -> bool:
        """Gradients and updated parameters within tolerance, buffers not: a layer that updates its
        buffers in its forward ran another number of times, or on other samples."""
        return (self.tolerance is not None and not self.passed and self.grad_rel <= self.tolerance[0]
                and self.param_rel <= self.tolerance[1])

    @property
    def passed(self) -> bool:
        if self.tolerance is None:
            return True
        return (self.grad_rel <= self.tolerance[0] and self.param_rel <= self.tolerance[1]
                and self.buffer_rel <= self.tolerance[2])

    @property
    def finite(self) -> bool:
        return math.isfinite(self.grad_rel) and math.isfinite(self.param_rel)

    def figures(self) -> str:
        """``gradients 2.1e-02, parameters 3.0e-03, buffers 0.0e+00 relative (tolerance 1.0e-06; worst
        parameter fc.weight)`` - or, for runs whose gradients are not finite, says so."""
        if not math.isfinite(self.grad_rel):
            text = f"gradients not finite (inf or nan) in the {self.runs[0]} run"
        else:
            text = f"gradients {self.grad_rel:.2e}, parameters {self.param_rel:.2e}"
            if self.buffer_rel:
                text += f", buffers {self.buffer_rel:.2e}"
            text += " relative"
        extra = []
        if self.tolerance is not None:
            extra.append(f"tolerance {self.tolerance[0]:.1e}")
        if self.worst and math.isfinite(self.grad_rel):
            extra.append(f"worst parameter {self.worst}")
        if self.worst_buffer and self.tolerance is not None and self.buffer_rel > self.tolerance[2]:
            extra.append(f"worst buffer {self.worst_buffer}")
        return text + (f" ({'; '.join(extra)})" if extra else "")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "runs": list(self.runs), "grad_rel": _finite(self.grad_rel),
                "param_rel": _finite(self.param_rel), "update_rel": _finite(self.update_rel),
                "buffer_rel": _finite(self.buffer_rel), "tolerance": list(self.tolerance) if self.tolerance else None,
                "worst_parameter": self.worst or None, "worst_buffer": self.worst_buffer or None,
                "passed": self.passed}


FP32_CAUSES = (
    "likely causes: a loss that is not a per-sample mean, so a sample's weight depends on its micro-batch: "
    "a mean over tokens (padding, ignore_index) needs `plan.steps(loader, count=lambda batch: n_real_tokens)`, "
    "a reduction='sum' loss must become the mean over the micro-batch's samples (README: Losses); layers whose step depends on the batch that autobalance does not "
    "recognise (it knows BatchNorm and modules with running_* buffers); or non-deterministic ops "
    "(`autobalance verify --config` with the script's own configuration fails too)"
)
"""What to say when the fp32 math differs."""

BUFFER_CAUSES = (
    "only the buffers differ: a layer that updates its buffers in its forward (running statistics) ran another "
    "number of times or on other micro-batches (a recomputation that updates them again, or a split that changes "
    "what they average)"
)
"""What to say when gradients and parameters agree and the buffers do not."""


@dataclass(kw_only=True)
class Verification:
    """The verdict on one configuration."""

    passed: bool
    reason: str
    """One line: why it passed or failed."""
    checks: list[Check] = field(default_factory=list)
    runs: dict[str, str] = field(default_factory=dict)
    """Run name -> its directory (reports, logs, saved tensors)."""
    wall_s: float = 0.0
    skipped: bool = False
    """Nothing was run (e.g. the configuration is the script's own)."""
    notes: list[str] = field(default_factory=list)
    """What else the runs showed, in words (fp16 steps skipped for overflow, batch-dependent layers)."""

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "reason": self.reason, "skipped": self.skipped, "wall_s": round(self.wall_s, 2),
                "checks": [c.to_dict() for c in self.checks], "runs": dict(self.runs), "notes": list(self.notes)}


class _RunFailed(Exception):
    def __init__(self, name: str, text: str) -> None:
        super().__init__(f"the {name} run failed: {text}")
        self.name = name


class SharedRuns:
    """What the verifications of several configurations of one script share (``tune`` verifying its
    next-best candidates): one warm pool, the starting weights, and the runs that do not depend on
    the configuration (``baseline``, ``baseline-fp32``, ``baseline-<dtype>``, ``baseline-small``), each
    run once. The owner closes it; a :class:`Verifier` given one leaves it open.

    ``pool``: the study's warm pool, still running after its trials (``tune``): the runs use its
    workers when it :meth:`~autobalance.launcher.WarmPool.serves` them (no second start-up: torch,
    the process group, on a GPU the CUDA context), else a pool of their own. Whoever kept it closes
    it; :meth:`close` closes only a pool started here."""

    def __init__(self, *, pool: WarmPool | None = None) -> None:
        self.offered = pool
        self.pool: WarmPool | None = None
        self.init_path: str | None = None
        self.init: dict[str, Any] = {}
        self.baselines: dict[str, StepResult] = {}
        """Successful baseline runs by (name, configuration, dropout, global batch)."""

    def pool_for(self, launch: TrialLaunch, *, pool_dir: str, note: Callable[[str], None]) -> WarmPool:
        """The pool the verification runs use (see the class doc), chosen at the first run."""
        if self.pool is None:
            if self.offered is not None and self.offered.serves(launch):
                self.pool = self.offered
                note("verify: the runs use the study's warm workers (no new start-up)")
            else:
                self.pool = WarmPool(template=launch, pool_dir=pool_dir)
        return self.pool

    def close(self) -> None:
        if self.pool is not None and self.pool is not self.offered:
            self.pool.close()
        self.pool = None

    def __enter__(self) -> SharedRuns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Verifier:
    """Launches the verification runs of one configuration and judges them (see the module doc)."""

    def __init__(self, target: VerifyTarget, *, note: Callable[[str], None] | None = None,
                 allow_batch_dependent: bool = False, shared: SharedRuns | None = None) -> None:
        self.target = target
        self.note = note or (lambda text: None)
        self.allow_batch_dependent = allow_batch_dependent
        self._owns_shared = shared is None
        self._shared = shared if shared is not None else SharedRuns()
        self._runs: dict[str, str] = {}
        self._results: list[StepResult] = []

    # ------------------------------------------------------------------ running
    def _launch(self, launch: TrialLaunch) -> TrialOutcome:
        t = self.target
        if not t.cold and cold_reason(t.script) is None:
            pool = self._shared.pool_for(launch, pool_dir=os.path.join(t.work_dir, "pool"), note=self.note)
            return pool.run(launch)
        return run_trial(launch)

    def _run(self, name: str, config: BalanceConfig | None, *, dropout: str, global_batch: int) -> StepResult:
        key = f"{name}|{None if config is None else config.to_json()}|{dropout}|{global_batch}"
        done = self._shared.baselines.get(key)
        if done is not None:  # a baseline run of an earlier candidate: the same step
            self._runs[name] = done.trial_dir
            self._results.append(done)
            self.note(f"verify: {name} run (the earlier candidate's, in {done.trial_dir})")
            return done
        result = self._launch_run(name, config, dropout=dropout, global_batch=global_batch)
        if name.startswith("baseline"):
            self._shared.baselines[key] = result
        return result

    def _launch_run(self, name: str, config: BalanceConfig | None, *, dropout: str, global_batch: int) -> StepResult:
        t = self.target
        trial_dir = os.path.join(t.work_dir, name)
        os.makedirs(trial_dir, exist_ok=True)
        with open(os.path.join(trial_dir, _env.VERIFY_FILE), "w") as fh:
            json.dump({"dropout": dropout, "init": self._shared.init_path,
                       "allow_batch_dependent": self.allow_batch_dependent}, fh)
        self._runs[name] = trial_dir
        self.note(f"verify: {name} run ({'script defaults' if config is None else _short(config)}, dropout {dropout})")
        launch = TrialLaunch(
            script=t.script, script_args=list(t.script_args), nproc_per_node=t.nproc_per_node,
            torchrun_args=list(t.torchrun_args), device=t.device,
            config_json=None if config is None else config.to_json(),
            global_batch=global_batch if config is None else None, steps=1, warmup=0, trial_dir=trial_dir,
            timeout_s=t.timeout_s, pg_timeout_s=int(max(30, min(300, t.timeout_s / 2))), env=dict(t.env),
        )
        outcome = self._launch(launch)
        step_file = os.path.join(trial_dir, _STEP_FILE)
        if outcome.status != Status.OK or not os.path.isfile(step_file):
            text = f"{outcome.status}: {outcome.reason}" if outcome.status != Status.OK else "no step was saved"
            raise _RunFailed(name, f"{text} (logs in {trial_dir})")
        result = self._load(name, trial_dir)
        self._results.append(result)
        return result

    def _load(self, name: str, trial_dir: str) -> StepResult:
        import torch

        saved = torch.load(os.path.join(trial_dir, _STEP_FILE), map_location="cpu", weights_only=True)
        with open(os.path.join(trial_dir, _STEP_JSON)) as fh:
            info = json.load(fh)
        samples = sorted(int(i) for rank in info["micro_batches"] for mb in rank for i in mb)
        if self._shared.init_path is None:
            self._shared.init_path = os.path.join(trial_dir, _INIT_FILE)
            self._shared.init = torch.load(self._shared.init_path, map_location="cpu", weights_only=True)
        return StepResult(name=name, config=info["config"], trial_dir=trial_dir, grads=dict(saved["grads"]),
                          params=dict(saved["params"]), buffers=dict(saved.get("buffers") or {}), samples=samples,
                          info=info)

    def close(self) -> None:
        if self._owns_shared:
            self._shared.close()

    # ------------------------------------------------------------------ judging
    def _compare(self, name: str, a: StepResult, b: StepResult, tolerance: tuple[float, float, float] | None) -> Check:
        if set(a.grads) != set(b.grads) or set(a.params) != set(b.params):
            missing = sorted(set(a.grads) ^ set(b.grads))[:3] or sorted(set(a.params) ^ set(b.params))[:3]
            raise _RunFailed(a.name, f"its parameters differ from the {b.name} run's (e.g. {missing})")
        if not b.grads:
            raise _RunFailed(b.name, "no parameter had a gradient")
        grad_rel, worst = _relative(a.grads, b.grads)
        init = self._shared.init
        upd_a = {k: v - init[k].float() for k, v in a.params.items() if k in init}
        upd_b = {k: v - init[k].float() for k, v in b.params.items() if k in init}
        update_rel, _ = _relative(upd_a, upd_b)
        param_rel, _ = _relative(a.params, b.params)
        shared = sorted(set(a.buffers) & set(b.buffers))
        buffer_rel, worst_buffer = _relative({k: a.buffers[k] for k in shared}, {k: b.buffers[k] for k in shared})
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
        except _RunFailed as exc:
            result = Verification(passed=False, reason=f"{exc}")
        finally:
            self.close()
        result.checks = checks
        result.runs = dict(self._runs)
        result.wall_s = time.monotonic() - start
        result.notes = self._notes()
        if result.notes and not result.skipped:
            result.reason += "; " + "; ".join(result.notes)
        return result

    def _notes(self) -> list[str]:
        notes = []
        skipped = [r for r in self._results if r.overflow_skips]
        if skipped:
            runs = ", ".join(f"{r.name} ({r.overflow_skips}x, then scale {r.info.get('scale', '?')})" for r in skipped)
            notes.append(f"fp16 overflow: the first step of the {runs} run(s) overflowed and the GradScaler skipped it; "
                         "it was run again at the scale the scaler settled on")
        dependent = next((r.info.get("batch_dependent") for r in self._results if r.info.get("batch_dependent")), None)
        if dependent:
            shown = ", ".join(dependent[:3]) + (f" and {len(dependent) - 3} more" if len(dependent) > 3 else "")
            if self.allow_batch_dependent:
                notes.append(f"batch-dependent layers ({shown}) verified in eval mode (allowed to change: "
                             "their batch statistics differ with the split)")
            else:
                notes.append(f"batch-dependent layers ({shown}) verified in train mode, running statistics included")
        return notes

    def _verify(self, tuned: BalanceConfig, checks: list[Check]) -> Verification:
        gb = tuned.global_batch
        try:
            base = self._run("baseline", None, dropout="off", global_batch=gb)
            note = ""
        except _RunFailed as exc:
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
        reference = base if base_cfg.dtype == "fp32" else self._run(
            "baseline-fp32", dataclasses.replace(base_cfg, dtype="fp32"), dropout="off", global_batch=gb)
        exact = (FP32_TOLERANCE, FP32_TOLERANCE, FP32_TOLERANCE)
        # part 1: the configuration's math, both in fp32
        math_run = self._run("tuned" if tuned.dtype == "fp32" else "tuned-fp32",
                             dataclasses.replace(tuned, dtype="fp32"), dropout="off", global_batch=gb)
        self._same_samples(math_run, base)
        equivalence = self._compare("equivalence", math_run, reference, exact)
        checks.append(equivalence)
        if not equivalence.passed:
            where = "" if tuned.dtype == "fp32" else " (both run in fp32)"
            causes = (BUFFER_CAUSES if equivalence.buffers_only else FP32_CAUSES) if equivalence.finite \
                else "check the loss for inf/nan"
            return Verification(passed=False, reason=(
                f"its step differs from the baseline's{where}: {equivalence.figures()}{note}; {causes}"))
        tolerance = exact
        precision: Check | None = None
        # part 2: the dtype's effect, against the baseline's own rounding
        if tuned.dtype != "fp32":
            same = base if base_cfg.dtype == tuned.dtype else self._run(
                f"baseline-{tuned.dtype}", dataclasses.replace(base_cfg, dtype=tuned.dtype), dropout="off", global_batch=gb)
            noise = self._compare("noise", same, reference, None)
            checks.append(noise)
            if not noise.finite:
                return Verification(passed=False, reason=(
                    f"the script's own configuration in {tuned.dtype} has no finite step to compare with "
                    f"({noise.figures()}){note}"))
            tolerance = (max(FP32_TOLERANCE, NOISE_FACTOR * noise.grad_rel),
                         max(FP32_TOLERANCE, NOISE_FACTOR * noise.param_rel),
                         max(FP32_TOLERANCE, NOISE_FACTOR * noise.buffer_rel))
            run = self._run("tuned", tuned, dropout="off", global_batch=gb)
            self._same_samples(run, base)
            precision = self._compare("dtype", run, reference, tolerance)
            checks.append(precision)
            if not precision.passed:
                return Verification(passed=False, reason=(
                    f"in {tuned.dtype} its step is further from the fp32 reference than {NOISE_FACTOR:g}x the "
                    f"baseline's own {tuned.dtype} error: {precision.figures()}{note}"))
        if recomputes(tuned):
            replay = self._run("tuned-dropout", tuned, dropout="on", global_batch=gb)
            plain = self._run("tuned-dropout-no-recompute", without_recompute(tuned), dropout="on", global_batch=gb)
            check = self._compare("rng-replay", replay, plain, tolerance)
            checks.append(check)
            if not check.passed:
                why = ("its recomputation updates buffers again (e.g. BatchNorm running statistics)"
                       if check.buffers_only else "dropout masks are not replayed")
                return Verification(passed=False, reason=(
                    f"with dropout, its recomputation changes the step relative to the same configuration without "
                    f"recomputation: {check.figures()}: {why}"))
        if precision is None:
            what = (f"its step matches the baseline's (gradients {equivalence.grad_rel:.1e}, updated parameters "
                    f"{equivalence.param_rel:.1e} relative)")
        else:
            what = (f"in fp32 its step matches the baseline's (gradients {equivalence.grad_rel:.1e} relative) and in "
                    f"{tuned.dtype} it is within {NOISE_FACTOR:g}x the baseline's own {tuned.dtype} error (gradients "
                    f"{precision.grad_rel:.1e})")
        return Verification(passed=True, reason=(
            f"{what}{' and recomputation replays dropout' if recomputes(tuned) else ''}{note}"))

    def _same_samples(self, run: StepResult, base: StepResult) -> None:
        if run.samples != base.samples:
            raise _RunFailed(run.name, f"it took other samples than the baseline's first global batch "
                                       f"({len(run.samples)} vs {len(base.samples)} samples)")

    @staticmethod
    def _fallback_reference(tuned: BalanceConfig) -> BalanceConfig | None:
        """An even split with micro-batches of one or two samples (a micro-step per sample on the
        rank with the most): the least memory a reference can take."""
        world, gb = tuned.world_size, tuned.global_batch
        if gb < world:
            return None
        return BalanceConfig.any_split(rank_samples=split_evenly(gb, [1.0] * world), accumulation=gb // world,
                                       dtype=tuned.dtype)


def _relative(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, str]:
    """|a - b| / |b| over all tensors (float64 sums), and the name with the largest per-tensor error
    (inf/nan counts as the largest; ``""`` when no tensor differs)."""
    num = den = 0.0
    worst, worst_rel = "", 0.0
    for key in sorted(b):
        diff = float((a[key].double() - b[key].double()).pow(2).sum())
        ref = float(b[key].double().pow(2).sum())
        num += diff
        den += ref
        rel = math.sqrt(diff / ref) if ref > 0 else (0.0 if diff == 0 else math.inf)
        if not math.isfinite(rel) and math.isfinite(worst_rel):
            worst, worst_rel = key, math.inf
        elif rel > worst_rel:
            worst, worst_rel = key, rel
    if den == 0:
        return (0.0 if num == 0 else math.inf), worst
    return math.sqrt(num / den), worst


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _short(config: BalanceConfig) -> str:
    from autobalance._config import describe_config

    return describe_config(config)


# ---------------------------------------------------------------------- in the study
ATTR_VERIFY_PREFIX = StudyAttr.VERIFY_PREFIX
"""Study attribute ``autobalance:verify:<trial number>``: that trial's :meth:`Verification.to_dict`."""
ATTR_ALLOW_BATCH_DEPENDENT = StudyAttr.ALLOW_BATCH_DEPENDENT
"""Study attribute: True when the study was tuned with ``--allow-batch-dependent`` (its configurations
may change the train-mode step of batch-dependent layers, and are verified in eval mode)."""
MAX_CANDIDATES = 3
"""When the best configuration fails verification, the next best are tried (distinct configurations)."""


def target_for(settings: Any, *, label: str) -> VerifyTarget:
    """The verification runs of a tune run's study (its script, ranks, device, Inductor cache)."""
    from autobalance.tuner.search import compile_env

    work = os.path.abspath(os.path.join(settings.runs_dir, settings.study_name, f"verify-{label}-{int(time.time())}"))
    return VerifyTarget(script=settings.script, script_args=list(settings.script_args),
                        nproc_per_node=settings.nproc_per_node, device=settings.device,
                        torchrun_args=list(settings.torchrun_args), timeout_s=settings.trial_timeout, work_dir=work,
                        cold=settings.cold, env=compile_env(settings))


def allows_batch_dependent(study: Any) -> bool:
    """Whether ``study`` was tuned allowing changes to batch-dependent layers (``--allow-batch-dependent``)."""
    return bool(study.user_attrs.get(ATTR_ALLOW_BATCH_DEPENDENT, False))


def ranked_candidates(study: Any) -> list[Any]:
    """Feasible trials, best first (the order of ``best_trial``), one per configuration."""
    objective = study.user_attrs.get(StudyAttr.OBJECTIVE, {})
    feasible = [t for t in study.get_trials(deepcopy=False) if is_feasible(t)]
    feasible.sort(key=lambda t: (weighted_objective(t.values, objective), t.number))
    seen: set[str] = set()
    out = []
    for t in feasible:
        key = json.dumps(t.user_attrs.get(TrialAttr.CONFIG), sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def verify_for_saving(*, settings: Any, study: Any, best: Any, baseline: Any, notes: list[str],
                      note: Callable[[str], None] | None = None, pool: WarmPool | None = None) -> Any:
    """The trial to save: ``best`` if it passes verification, else the next best that does (up to
    :data:`MAX_CANDIDATES`); None when none does. Each verdict is kept as a study attribute, so a
    continued study does not verify the same trial twice; ``notes`` get one line per verdict.
    ``pool``: the study's warm pool (see :class:`SharedRuns`; the caller closes it)."""
    if settings.nnodes > 1:
        notes.append("Verification skipped (multi-node study): run `autobalance verify` on one node before "
                     "training with the saved configuration.")
        return best
    baseline_cfg = None
    if baseline is not None and baseline.user_attrs.get(TrialAttr.CONFIG):
        baseline_cfg = BalanceConfig.from_dict(baseline.user_attrs[TrialAttr.CONFIG])
    candidates = [best] + [t for t in ranked_candidates(study) if t.number != best.number]
    with SharedRuns(pool=pool) as shared:  # one pool and one run of each baseline for every candidate
        tried = 0
        for trial in candidates:
            if tried >= MAX_CANDIDATES:
                break
            previous = study.user_attrs.get(f"{ATTR_VERIFY_PREFIX}{trial.number}")
            if previous is not None and not previous.get("passed"):
                continue  # failed before: never saved
            if previous is not None:
                return trial
            tried += 1
            config = BalanceConfig.from_dict(trial.user_attrs[TrialAttr.CONFIG])
            verdict = Verifier(target_for(settings, label=f"trial{trial.number}"), note=note,
                               allow_batch_dependent=allows_batch_dependent(study), shared=shared).verify(
                config, baseline=baseline_cfg)
            study.set_user_attr(f"{ATTR_VERIFY_PREFIX}{trial.number}", verdict.to_dict())
            write_notes(study)  # the best trial's dashboard note gives the verdict
            if verdict.passed:
                if not verdict.skipped:
                    notes.append(f"Verified trial {trial.number}: {verdict.reason} ({verdict.wall_s:.0f} s).")
                return trial
            notes.append(f"Not saved: trial {trial.number} failed verification: {verdict.reason}.")
        return None


# ---------------------------------------------------------------------- the command
def load_config_file(path: str) -> BalanceConfig:
    """A configuration file: a BalanceConfig JSON object or a file written by ``autobalance export``."""
    try:
        with open(path) as fh:
            text = fh.read(2_000_000)
    except OSError as exc:
        raise UsageError(f"--config={path!r} cannot be read ({exc.strerror or exc}); pass a configuration JSON file.") from None
    try:
        data = json.loads(text)
    except ValueError:
        raise UsageError(f"--config={path!r} is not JSON; pass a file written by `autobalance export`.") from None
    if isinstance(data, dict) and "config" in data and isinstance(data["config"], dict):
        data = data["config"]
    return BalanceConfig.from_dict(data)


def run_verify_command(*, script: str, script_args: list[str], study_name: str | None, storage: str,
                       trial: int | None, config_file: str | None, nproc_per_node: int | None, device: str | None,
                       runs_dir: str, trial_timeout: float, cold: bool,
                       note: Callable[[str], None] | None = None) -> tuple[Verification, BalanceConfig, str]:
    """Verify a study's best trial (or ``trial``), or the configuration in ``config_file``.
    Returns the verdict, the configuration and what it was (for the output)."""
    if not script.endswith(".py") or not os.path.isfile(script):
        raise UsageError(f"SCRIPT={script!r} is not an existing Python file; pass the training script the study tuned.")
    if trial is not None and config_file is not None:
        raise UsageError("--trial and --config both given; verify either a study's trial or a configuration file.")
    if config_file is None and study_name is None:
        raise UsageError("nothing to verify: pass --study-name (its best trial, or --trial N) or --config FILE.")
    if trial is not None and trial < 0:
        raise UsageError(f"--trial={trial} is negative; pass a trial number of the study.")
    study = None
    env: dict[str, str] = {}
    if config_file is not None:
        config = load_config_file(config_file)
        what = f"the configuration in {config_file}"
        label = "file"
    else:
        from autobalance.store import load_study
        from autobalance.tuner.search import cache_dir
        study = load_study(study_name=str(study_name), storage_url=storage)
        trials = study.get_trials(deepcopy=False)
        if trial is not None:
            if trial >= len(trials) or not trials[trial].user_attrs.get(TrialAttr.CONFIG):
                raise UsageError(f"--trial={trial} is not a trial of {study_name!r} with a configuration; list them with "
                                 f"`autobalance trials --study-name {study_name}`.")
            chosen = trials[trial]
        else:
            found = best_trial(study)
            if found is None:
                raise UsageError(f"study {study_name!r} has no feasible trial yet; pass --trial N or run more trials.")
            chosen = found
        config = BalanceConfig.from_dict(chosen.user_attrs[TrialAttr.CONFIG])
        what = f"trial {chosen.number} of '{study_name}'"
        label = f"trial{chosen.number}"
        device = device or (study.user_attrs.get(StudyAttr.DEVICE) or {}).get("type")
        if config.compile != "off" and not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
            env = {"TORCHINDUCTOR_CACHE_DIR": cache_dir(runs_dir, str(study_name)),  # the study's own cache
                   "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
                   "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    nproc = nproc_per_node or config.world_size
    if nproc != config.world_size:
        raise UsageError(f"--nproc-per-node={nproc} but {what} has {config.world_size} ranks; verify on one node "
                         f"with --nproc-per-node {config.world_size}.")
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device={device!r} is unknown; use cpu or cuda.")
    name = study_name or "verify"
    work = os.path.abspath(os.path.join(runs_dir, name, f"verify-{label}-{int(time.time())}"))
    target = VerifyTarget(script=script, script_args=script_args, nproc_per_node=nproc, device=device,
                          timeout_s=trial_timeout, work_dir=work, cold=cold, env=env)
    allow = allows_batch_dependent(study) if study is not None else False
    verdict = Verifier(target, note=note, allow_batch_dependent=allow).verify(config)  # always run, even the script's own
    if study is not None:
        study.set_user_attr(f"{ATTR_VERIFY_PREFIX}{label[len('trial'):]}", verdict.to_dict())
        write_notes(study)
    return verdict, config, what
