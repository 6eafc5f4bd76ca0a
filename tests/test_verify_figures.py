"""How a verification check is put in words (in process, no runs): a parameter name is named only
when there is one, and a step whose gradients are not finite says so instead of a number."""

from __future__ import annotations

import math

import torch

from autobalance.verify import Check
from autobalance.verify import relative as _relative


def _check(grad_rel: float, worst: str) -> Check:
    return Check(name="equivalence", runs=("tuned-fp32", "baseline-fp32"), grad_rel=grad_rel, param_rel=4.13e-2,
                 update_rel=0.1, buffer_rel=0.0, tolerance=(1e-6, 1e-6, 1e-6), worst=worst)


def test_an_empty_parameter_name_is_never_printed():
    """Fails if ``figures`` prints ``worst parameter`` without a name (the issue's
    ``... worst parameter )``) or for gradients that are not finite."""
    assert "worst parameter" not in _check(2e-2, "").figures()
    assert _check(2e-2, "fc.weight").figures().endswith("(tolerance 1.0e-06; worst parameter fc.weight)")
    nan = _check(math.nan, "").figures()
    assert nan.startswith("gradients not finite (inf or nan) in the tuned-fp32 run") and "worst parameter" not in nan
    assert "worst parameter" not in _check(math.inf, "fc.weight").figures()


def test_a_non_finite_gradient_names_its_parameter():
    """Fails if a nan gradient leaves the worst parameter unnamed (nan compares false with every
    error, so a plain ``rel > worst`` never picks it)."""
    a = {"a.weight": torch.tensor([1.0]), "b.weight": torch.tensor([math.nan])}
    b = {"a.weight": torch.tensor([1.1]), "b.weight": torch.tensor([1.0])}
    rel, worst = _relative(a, b)
    assert math.isnan(rel) and worst == "b.weight"


def test_tensors_that_agree_name_no_parameter():
    """Fails if the first parameter is named as the "worst" when every gradient agrees exactly (a
    buffer-only failure used to blame ``body.layers.0.fc.bias``, whose gradient was exact)."""
    same = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    assert _relative(same, {k: v.clone() for k, v in same.items()}) == (0.0, "")
    assert _relative({"a": same["a"], "b": torch.tensor([3.3])}, same)[1] == "b"


def test_buffers_that_differ_alone_are_named_and_said_to_be_buffers():
    """Fails if a check whose gradients and parameters agree but whose buffers do not (a BatchNorm
    updated twice by its recomputation) is not told apart from a gradient failure, or if its worst
    buffer is not named."""
    check = Check(name="equivalence", runs=("tuned", "baseline"), grad_rel=0.0, param_rel=0.0, update_rel=0.0,
                  buffer_rel=0.193, tolerance=(1e-6, 1e-6, 1e-6), worst="",
                  worst_buffer="body.layers.0.norm.num_batches_tracked")
    assert not check.passed and check.buffers_only
    text = check.figures()
    assert "buffers 1.93e-01" in text and text.endswith("worst buffer body.layers.0.norm.num_batches_tracked)")
    assert "worst parameter" not in text
    assert not _check(2e-2, "fc.weight").buffers_only
    within = Check(name="equivalence", runs=("tuned", "baseline"), grad_rel=0.0, param_rel=0.0, update_rel=0.0,
                   buffer_rel=1e-8, tolerance=(1e-6, 1e-6, 1e-6), worst="", worst_buffer="n.running_mean")
    assert within.passed and not within.buffers_only and "worst buffer" not in within.figures()
