"""What a verification says: one comparison of two runs (:class:`Check`), the verdict on one
configuration (:class:`Verification`) and why it failed (:class:`Failure`, the one enum of causes)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BUFFER_CAUSES", "FP32_CAUSES", "TOKEN_MEAN_FIXES", "Check", "Failure", "Verification", "fp32_causes",
           "relative"]


class Failure(enum.StrEnum):
    """Why a configuration failed verification (``Verification.failure``; ``None`` when it passed)."""

    RUN = "run"
    """A run failed or took other samples: nothing to compare."""
    FLOOR = "floor"
    """The rounding floor itself is above what can be verified (a non-deterministic step)."""
    ROUNDING = "rounding"
    """Part 1 failed by a small factor over the floor: rounding is the likely cause."""
    MATH = "math"
    """Part 1 failed far above the floor: the configuration computes another update."""
    BUFFERS = "buffers"
    """Part 1: gradients and parameters agree, buffers (running statistics) do not."""
    BASELINE_PRECISION = "baseline-precision"
    """The script's own configuration in bf16/fp16 is far from its fp32 step: not rounding."""
    DTYPE = "dtype"
    """Part 2: further from the fp32 reference than the baseline's own rounding allows."""
    RNG_REPLAY = "rng-replay"
    """Part 3: recomputation changes the step with dropout on."""


@dataclass(kw_only=True)
class Check:
    """One comparison of two runs."""

    name: str
    """``floor`` (the reference against itself with the samples of each micro-batch in reverse
    order), ``equivalence`` (the configuration's math, both in fp32), ``noise`` (how far the baseline
    itself is in mixed precision), ``dtype`` (the tuned configuration in its dtype) or ``rng-replay``."""
    runs: tuple[str, str]
    """(compared, reference)."""
    grad_rel: float
    param_rel: float
    """Of the updated parameters."""
    update_rel: float
    """Of the updates (``updated - starting weights``)."""
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


TOKEN_MEAN_FIXES = {
    "": "`plan.steps(loader, count=lambda batch: n_real_tokens)`",
    "lightning": "`return {\"loss\": loss, \"count\": n_real_tokens}` from training_step",
    "accelerate": "`balance.backward(loss, count=n_real_tokens)`",
    "hf": ("transformers' own token normalisation, which BalanceTrainer keeps: a model whose forward takes "
           "num_items_in_batch (or **kwargs), or compute_loss_func= in the trainer"),
}
"""What makes a token-mean loss exact for any split, by the loop that runs it ("": the runtime's own
``plan.steps``; else the integration, as the run's report names it)."""


def fp32_causes(framework: str | None = None) -> str:
    """What to say when the fp32 math differs far above the rounding floor; the token-mean fix named
    for the loop the script runs in (``framework``: ``lightning``, ``hf``, ``accelerate`` or None)."""
    fix = TOKEN_MEAN_FIXES.get(framework or "", TOKEN_MEAN_FIXES[""])
    return (
        "likely causes: a loss that is not a per-sample mean, so a sample's weight depends on its micro-batch: "
        f"a mean over tokens (padding, ignore_index) needs {fix}, "
        "a reduction='sum' loss must become the mean over the micro-batch's samples (README: Losses); a term "
        "computed over the whole micro-batch (a load-balancing loss of a mixture of experts, a contrastive loss "
        "over the batch), which no weighting makes split-independent: keep the script's own split; layers whose "
        "step depends on the batch that autobalance does not recognise (it knows BatchNorm and modules with "
        "running_* buffers)"
    )


FP32_CAUSES = fp32_causes()
"""What to say when the fp32 math of a ``plan.steps`` script differs far above the rounding floor."""

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
    failure: Failure | None = None
    """Why it failed (None: it passed)."""
    checks: list[Check] = field(default_factory=list)
    runs: dict[str, str] = field(default_factory=dict)
    """Run name -> its directory (reports, logs, saved tensors)."""
    wall_s: float = 0.0
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    """Run name -> where its time went (``run``: launch to exit; ``read``: loading its saved step;
    ``init`` / ``save``: the run's loading of the starting weights and writing of its step)."""
    skipped: bool = False
    """Nothing was run (e.g. the configuration is the script's own)."""
    notes: list[str] = field(default_factory=list)
    """What else the runs showed, in words (fp16 steps skipped for overflow, batch-dependent layers,
    TF32 held off)."""
    floor: float | None = None
    """The rounding floor of the gradients (the ``floor`` check), when measured."""
    bound: float | None = None
    """Part 1's bound on the gradients' relative error, from the floor."""

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "reason": self.reason, "skipped": self.skipped, "wall_s": round(self.wall_s, 2),
                "failure": self.failure.value if self.failure is not None else None,
                "floor": self.floor, "bound": self.bound,
                "checks": [c.to_dict() for c in self.checks], "runs": dict(self.runs), "seconds": dict(self.seconds),
                "notes": list(self.notes)}


def relative(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, str]:
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
