"""``autobalance.plan`` has the real signature of ``autobalance.runtime.plan`` (not ``**kwargs``), so an
IDE and a type checker see its parameters, and calls them through unchanged."""

from __future__ import annotations

import inspect

import autobalance
import autobalance.runtime


def test_plan_has_the_runtime_plans_signature():
    public = inspect.signature(autobalance.plan)
    real = inspect.signature(autobalance.runtime.plan)
    assert list(public.parameters) == list(real.parameters)
    for name, param in real.parameters.items():
        mine = public.parameters[name]
        assert (mine.kind, mine.default, str(mine.annotation)) == (param.kind, param.default, str(param.annotation)), name
    assert str(public.return_annotation) == str(real.return_annotation)


def test_plan_passes_every_parameter_through(monkeypatch):
    values = {name: object() for name in inspect.signature(autobalance.runtime.plan).parameters}
    seen = {}
    monkeypatch.setattr(autobalance.runtime, "plan", lambda **kw: seen.update(kw) or "plan")
    assert autobalance.plan(**values) == "plan"
    assert seen == values
