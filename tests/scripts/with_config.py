"""Run a training script with a given configuration (outside any study): ``autobalance.plan`` gets
``config=`` from argv[1] (JSON), whatever the script passes; argv[2:] are the script and its arguments.
A memory cap comes from ``AUTOBALANCE_MEMORY_CAP_BYTES`` as for any run."""

from __future__ import annotations

import runpy
import sys
from typing import Any

import autobalance

config, script, *args = sys.argv[1:]
own = autobalance.plan


def plan(**kwargs: Any) -> autobalance.Plan:
    return own(**{**kwargs, "config": config})


autobalance.plan = plan  # type: ignore[assignment]
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
