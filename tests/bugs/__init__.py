"""Known-wrong runtimes for the tests (see ``sitecustomize.py`` here): :func:`inject` gives the
environment that makes a job's training ranks run one of them."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent


def inject(bug: str) -> dict[str, str]:
    """Environment for a CLI or trial whose ranks run with ``bug`` (``loss-weighting``, ``no-rng-preserve``,
    ``micro-step-weights``, ``no-keep-buffers``)."""
    path = [str(HERE), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {"PYTHONPATH": os.pathsep.join(path), "TESTS_INJECT_BUG": bug}
