"""tests/scripts/faulty.py, after recording where this rank may run: its CPU affinity and
CUDA_VISIBLE_DEVICES go to ``<trial dir>/placement-rank<R>.json`` (parallel-trial tests).

AB_PINNED_OVERLAP=N: a trial that finds fewer than N placement files among its study's trials
(and is not the first trial; a verification's runs never wait) waits, up to 120 s (AB_HOLD_TIMEOUT_S to change it), until N exist:
with N = 3 the first two trials after the baseline are certainly running at the same time (no
reliance on timing luck). If they never do, the trial fails loudly (tests/scripts/_hold.py:
``<trial dir>/hold-timed-out.txt``, a line on stderr, exit code 3) instead of running alone.
"""

from __future__ import annotations

import glob
import json
import os
import runpy
import time

from _hold import hold_timed_out  # tests/scripts/_hold.py, beside this script

FAULTY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faulty.py")
trial_dir = os.environ.get("AUTOBALANCE_TRIAL_DIR")
if trial_dir:
    with open(os.path.join(trial_dir, f"placement-rank{os.environ.get('RANK', '0')}.json"), "w") as fh:
        json.dump({"cpus": sorted(os.sched_getaffinity(0)), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   "pid": os.getpid()}, fh)
    overlap = int(os.environ.get("AB_PINNED_OVERLAP", "0"))
    # the study's trials only (trial-NNNN-...): the runs of a verification ('baseline', 'tuned' under
    # verify-trialN-...) are not trials running at once and never wait
    study_trial = os.path.basename(trial_dir.rstrip("/")).startswith("trial-")
    pattern = os.path.join(os.path.dirname(trial_dir.rstrip("/")), "trial-*", "placement-rank0.json")
    if overlap and study_trial and len(glob.glob(pattern)) > 1:  # the baseline (alone at first) never waits
        timeout = float(os.environ.get("AB_HOLD_TIMEOUT_S", "120"))
        deadline = time.monotonic() + timeout
        while (n := len(glob.glob(pattern))) < overlap:
            if time.monotonic() >= deadline:
                hold_timed_out("pinned.py", f"AB_PINNED_OVERLAP: after {timeout:g} s, {n} of the "
                                                      f"{overlap} trials running at once have started")
            time.sleep(0.05)

runpy.run_path(FAULTY, run_name="__main__")
