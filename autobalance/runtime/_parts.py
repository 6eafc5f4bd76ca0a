"""The optional parts of a :class:`~autobalance.runtime.Plan` and the fixed points where it calls them.

A part is one feature that only some runs have: the memory breakdown of a trial
(:mod:`~autobalance.runtime._breakdown`), a verification run (:mod:`~autobalance.runtime._verify`),
a compiled model (:mod:`~autobalance.runtime._compile`). The plan keeps the parts that are on in a
list, in a fixed order, and calls every hook of every part at the same points of its training-loop
API; a feature that is off is simply not in the list. Every hook does nothing by default, so a part
overrides only the points it needs:

==========================  ==========================================================================
hook                        called by the plan
==========================  ==========================================================================
``on_wrap``                 ``wrap()``: the configuration validated, before checkpointing and the move
``on_model_moved``          ``wrap()``: blocks checkpointed, model on the device, before DDP
``on_wrapped``              ``wrap()``: after DDP (``plan.model`` is the module inside it)
``on_step_start``           ``steps()``: a step's micro-batches fetched, before it is yielded
``on_micro_step``           ``micro_step()``: entered, before ``no_sync`` and autocast
``before_backward``         ``backward()``: before the weighted loss's backward
``after_backward``          ``backward()``: after it (gradients accumulated)
``before_optimizer_step``   ``optimizer_step()``: before clipping and ``optimizer.step()``
``after_optimizer_step``    ``optimizer_step()``: after ``optimizer.step()``, gradients still set
``repeat_step``             ``optimizer_step()``: gradients set to None; ``True`` runs the same
                            micro-batches again as the same step (not counted, not timed)
``after_step``              ``optimizer_step()``: gradients set to None, the step counted
``step_timed``              after a timed step: ``True`` claims its time (not a measured step)
``trial_done``              after a step: ``True`` ends the trial (its report is written)
==========================  ==========================================================================

Parts read the plan (``plan.model``, ``plan.rank``, ``plan.steps_done`` ...) and never call its hooks
themselves. Each part that adds figures to the rank's report is read by the report builder
(:func:`autobalance.runtime._report.build_report`), which keeps the report's format in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autobalance.runtime._plan import Plan

__all__ = ["Part"]


class Part:
    """One optional feature of a plan; see the module docstring for when each hook runs."""

    def on_wrap(self, plan: Plan, model: nn.Module) -> None:
        """``wrap()`` entered with ``model`` as the script gave it (configuration validated)."""

    def on_model_moved(self, plan: Plan, model: nn.Module) -> None:
        """Blocks checkpointed and the model on the plan's device; DDP not built yet."""

    def on_wrapped(self, plan: Plan, wrapped: nn.Module) -> None:
        """DDP built (``wrapped`` is what ``wrap()`` returns; ``plan.model`` the module inside)."""

    def on_step_start(self, plan: Plan) -> None:
        """An optimizer step's micro-batches are fetched; the script gets them next."""

    def on_micro_step(self, plan: Plan) -> Any:
        """``micro_step()`` entered; may return a context manager held around the micro-step."""
        return None

    def before_backward(self, plan: Plan) -> None:
        """Before the backward of one micro-batch's weighted loss."""

    def after_backward(self, plan: Plan) -> None:
        """After that backward: this micro-batch's gradients are accumulated."""

    def before_optimizer_step(self, plan: Plan, optimizer: torch.optim.Optimizer) -> None:
        """Before gradient clipping and ``optimizer.step()`` (DDP's averaged gradients are set)."""

    def after_optimizer_step(self, plan: Plan, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.step()``, before the gradients are set to None."""

    def repeat_step(self, plan: Plan) -> bool:
        """After the step (gradients set to None): ``True`` has ``steps()`` yield the same micro-batches
        again as the same step, which is then neither counted nor timed (an fp16 verification step
        that the GradScaler skipped)."""
        return False

    def after_step(self, plan: Plan) -> None:
        """The step is done: gradients set to None, ``plan.steps_done`` counts it."""

    def step_timed(self, plan: Plan, seconds: float) -> bool:
        """A step took ``seconds``; ``True`` claims that time (the step is not a measured one)."""
        return False

    def trial_done(self, plan: Plan) -> bool:
        """Asked after each step in a trial: ``True`` ends the trial now."""
        return False
