"""Known-wrong runtimes, injected into a test's training ranks from outside autobalance.

``autobalance verify`` (and the tune/promote gate built on it) must reject a runtime that computes
the wrong step. The broken variants live here, in the tests, not behind switches in the package:
a test puts this directory first on ``PYTHONPATH`` and names the bug in ``TESTS_INJECT_BUG``; Python
imports this ``sitecustomize`` at start-up in every process of the job, and in the training ranks
(``RANK`` set by torchrun) it patches the runtime before the script runs:

- ``loss-weighting``: ``plan.backward`` no longer weights a micro-batch's mean loss by its share of
  the global batch (each rank's mean counts the same, whatever its share: wrong for uneven splits);
- ``no-rng-preserve``: blocks are checkpointed without preserving the RNG state (the recomputation
  draws other dropout masks: wrong gradients whenever dropout is on);
- ``micro-step-weights``: each micro-batch of a rank weighs as the mean of that rank's micro-batches
  in the step, not by its own size (the rank's share stays right: exact for equal micro-batches,
  wrong for an any split such as 6,6,5,5,5,5);
- ``no-keep-buffers``: checkpointed blocks get no buffer protection (``_keep_buffers`` gives no
  context): the recomputation in the backward runs BatchNorm's forward again and updates its
  running statistics and ``num_batches_tracked`` twice per step (gradients unchanged).
"""

from __future__ import annotations

import os

BUGS = ("loss-weighting", "no-rng-preserve", "micro-step-weights", "no-keep-buffers")


def _inject(bug: str) -> None:
    if bug == "loss-weighting":
        from autobalance.runtime._plan import Plan

        Plan._loss_weight = lambda self: 1.0  # type: ignore[method-assign]
    elif bug == "no-rng-preserve":
        import autobalance.runtime._checkpoint as checkpoint

        checkpoint._PRESERVE_RNG_STATE = False
    elif bug == "micro-step-weights":
        from autobalance.runtime._weighting import StepWeights

        def mean_weight(self, micro_index: int) -> float:
            mean = sum(self._counts) / len(self._counts)
            return self.world_size * mean / self._total

        StepWeights.weight = mean_weight  # type: ignore[method-assign]
    elif bug == "no-keep-buffers":
        import autobalance.runtime._checkpoint as checkpoint

        checkpoint._keep_buffers = lambda block: None
    else:
        raise SystemExit(f"TESTS_INJECT_BUG={bug!r} is unknown; use one of {', '.join(BUGS)}.")


_bug = os.environ.get("TESTS_INJECT_BUG")
if _bug and os.environ.get("RANK") is not None:
    _inject(_bug)

