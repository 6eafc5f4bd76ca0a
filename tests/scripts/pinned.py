"""tests/scripts/faulty.py, after recording where this rank may run: its CPU affinity and
CUDA_VISIBLE_DEVICES go to ``<trial dir>/placement-rank<R>.json`` (parallel-trial tests)."""

from __future__ import annotations

import json
import os
import runpy

trial_dir = os.environ.get("AUTOBALANCE_TRIAL_DIR")
if trial_dir:
    with open(os.path.join(trial_dir, f"placement-rank{os.environ.get('RANK', '0')}.json"), "w") as fh:
        json.dump({"cpus": sorted(os.sched_getaffinity(0)), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   "pid": os.getpid()}, fh)

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "faulty.py"), run_name="__main__")
