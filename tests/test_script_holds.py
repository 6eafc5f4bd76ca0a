"""The holds of the test scripts fail loudly when they give up (issue 22: wait on events and files,
not on luck): tests/scripts/faulty.py's AB_HOLD_FIRST_LAUNCH (tests/faults/test_concurrency.py) and
tests/scripts/pinned.py's AB_PINNED_OVERLAP (tests/test_scale_out.py). A hold that timed out and
carried on would let those tests pass without the order they check having happened."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tune_helpers import FAULTY, HOLD_TIMED_OUT, REPO, assert_no_hold_timed_out

PINNED = str(REPO / "tests" / "scripts" / "pinned.py")


def _run(script: str, trial_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    trial_dir.mkdir(parents=True)
    full = {k: v for k, v in os.environ.items() if not k.startswith(("AB_", "AUTOBALANCE_"))}
    full.update({"AUTOBALANCE_TRIAL_DIR": str(trial_dir), "RANK": "0", "AB_HOLD_TIMEOUT_S": "0.3", **env})
    return subprocess.run([sys.executable, script], env=full, capture_output=True, text=True, timeout=120)


def test_a_first_launch_hold_that_times_out_fails_the_trial_loudly(tmp_path: Path) -> None:
    """Fails if faulty.py's AB_HOLD_FIRST_LAUNCH gives up silently and the baseline carries on (the
    concurrency test would then pass on start-up timing, not on the other tuners having waited)."""
    trial = tmp_path / "runs" / "trial-0"
    out = _run(FAULTY, trial, AB_HOLD_FIRST_LAUNCH=f"{tmp_path}/worker*/stderr.log|Waiting for the baseline trial|3")
    line = (f"faulty.py: hold timed out: AB_HOLD_FIRST_LAUNCH: after 0.3 s, 0 of the 3 files matching "
            f"{tmp_path}/worker*/stderr.log contain 'Waiting for the baseline trial'")
    assert out.returncode == 3, out.stderr[-2000:]
    assert line in out.stderr
    assert (trial / HOLD_TIMED_OUT).read_text() == line + "\n"
    assert not list(trial.glob("rank*.json"))  # it never got as far as training


def test_an_overlap_hold_that_times_out_fails_the_trial_loudly(tmp_path: Path) -> None:
    """Fails if pinned.py's AB_PINNED_OVERLAP gives up silently and the trial runs alone (the
    parallel-trials test would then find an overlap, or not, by luck)."""
    first = tmp_path / "runs" / "trial-0001-1"
    first.mkdir(parents=True)
    (first / "placement-rank0.json").write_text("{}")
    trial = tmp_path / "runs" / "trial-0002-2"
    out = _run(PINNED, trial, AB_PINNED_OVERLAP="3")
    line = "pinned.py: hold timed out: AB_PINNED_OVERLAP: after 0.3 s, 2 of the 3 trials running at once have started"
    assert out.returncode == 3, out.stderr[-2000:]
    assert line in out.stderr and (trial / HOLD_TIMED_OUT).read_text() == line + "\n"


def test_the_runs_of_a_verification_never_hold(tmp_path: Path) -> None:
    """Fails if pinned.py holds a verification's runs ('baseline' then 'tuned' under
    verify-trialN-...): they are not trials running at once, so they would wait for an overlap that
    never comes (the cold parallel-trials test lost 120 s on each of three such runs, silently)."""
    verify = tmp_path / "runs" / "verify-trial1-1"
    (verify / "baseline").mkdir(parents=True)
    (verify / "baseline" / "placement-rank0.json").write_text("{}")
    out = _run(PINNED, verify / "tuned", AB_PINNED_OVERLAP="3", AUTOBALANCE_DEVICE="cpu", OMP_NUM_THREADS="1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert not (verify / "tuned" / HOLD_TIMED_OUT).exists() and (verify / "tuned" / "rank0.json").exists()


def test_the_tests_check_for_a_timed_out_hold_first(tmp_path: Path) -> None:
    """Fails if the check the hold tests call does not name the trial and the cause."""
    assert_no_hold_timed_out(tmp_path)
    trial = tmp_path / "worker0" / "autobalance_runs" / "s" / "trial-0"
    trial.mkdir(parents=True)
    (trial / HOLD_TIMED_OUT).write_text("faulty.py: hold timed out: AB_HOLD_FIRST_LAUNCH: after 45 s, 1 of the 3 ...\n")
    with pytest.raises(AssertionError, match=r"trial-0: faulty.py: hold timed out: AB_HOLD_FIRST_LAUNCH: after 45 s"):
        assert_no_hold_timed_out(tmp_path)
