"""tests/scripts/faulty.py, after recording where this rank may run: its CPU affinity and
CUDA_VISIBLE_DEVICES go to ``<trial dir>/placement-rank<R>.json`` (parallel-trial tests).

AB_PINNED_OVERLAP=N: a trial that finds fewer than N placement files among its study's trials
(and is not the first trial) waits, up to 120 s, until N exist: with N = 3 the first two trials
after the baseline are certainly running at the same time (no reliance on timing luck).
"""

from __future__ import annotations

import glob
import json
import os
import runpy
import time

trial_dir = os.environ.get("AUTOBALANCE_TRIAL_DIR")
if trial_dir:
    with open(os.path.join(trial_dir, f"placement-rank{os.environ.get('RANK', '0')}.json"), "w") as fh:
        json.dump({"cpus": sorted(os.sched_getaffinity(0)), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   "pid": os.getpid()}, fh)
    overlap = int(os.environ.get("AB_PINNED_OVERLAP", "0"))
    pattern = os.path.join(os.path.dirname(trial_dir.rstrip("/")), "*", "placement-rank0.json")
    if overlap and len(glob.glob(pattern)) > 1:  # the baseline (alone at first) never waits
        deadline = time.monotonic() + 120
        while len(glob.glob(pattern)) < overlap and time.monotonic() < deadline:
            time.sleep(0.05)

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "faulty.py"), run_name="__main__")
