"""Issue 33, mixed GPUs: a rank's busy time measured, the emulated slow rank, the speed-aware
step-time model and solver, the configuration following the device, and what the views show."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autobalance._errors import UsageError
from autobalance.protocol import RankReport, Status, report_problem
from autobalance.runtime._emulate import emulated_ms_per_sample
from tests.conftest import REPO, torchrun


def _ok_report(**extra: object) -> dict:
    return {"status": "ok", "rank": 0, "world_size": 2, "step_time_s": 0.1, "memory": {"peak_device": 1.0},
            "device": {"type": "cpu"}, **extra}


def test_report_busy_and_wait_are_optional_and_validated() -> None:
    assert report_problem(_ok_report()) is None  # a report from before: still parses
    assert RankReport.from_dict(_ok_report()).busy_time_s is None
    rep = RankReport.from_dict(_ok_report(busy_time_s=0.05, allreduce_wait_s=0.02))
    assert (rep.busy_time_s, rep.allreduce_wait_s, rep.status) == (0.05, 0.02, Status.OK)
    assert rep.to_dict()["busy_time_s"] == 0.05
    assert "busy_time_s" in (report_problem(_ok_report(busy_time_s=-1.0)) or "")
    assert "allreduce_wait_s" in (report_problem(_ok_report(allreduce_wait_s="x")) or "")


def test_emulated_ms_per_sample_parses_one_value_or_one_per_rank() -> None:
    assert emulated_ms_per_sample(None, 1) == 0.0
    assert emulated_ms_per_sample("2.5", 1) == 2.5
    assert emulated_ms_per_sample("0,4", 0) == 0.0 and emulated_ms_per_sample("0,4", 1) == 4.0
    for bad in ("x", "1,-2", "1,nan"):
        with pytest.raises(UsageError, match="AUTOBALANCE_EMULATE_MS_PER_SAMPLE"):
            emulated_ms_per_sample(bad, 1)
    with pytest.raises(UsageError, match="no entry for rank 2"):
        emulated_ms_per_sample("1,2", 2)


@pytest.mark.slow
def test_slow_rank_update_exact_and_busy_time_names_it(tmp_path: Path) -> None:
    """2 gloo ranks, rank 1 sleeping 10 ms per sample (deterministic, no CPU taken): with the busy
    meter's hooks on (a trial) every step of an epoch equals one process's update (fp32, 1e-6 on the
    gradient), for splits that give the slow rank fewer samples; rank 1's busy time is the larger
    (it holds at least its sleeps: 12 x 10 ms per step) and rank 0 is the one that waits."""
    out = tmp_path / "slow.json"
    proc = torchrun([str(REPO / "tests/dist_scripts/slow_rank_check.py"), str(out)],
                    env={"AUTOBALANCE_EMULATE_MS_PER_SAMPLE": "0,10"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for case in r["cases"]:
        assert max(case["grad_errors"]) <= 1e-6, case
        assert max(case["rel_errors"]) <= 1e-5, case
        assert case["allreduce_calls"] == [1] * len(case["step_totals"]), case
        assert case["samples_seen"] == case["distinct_samples"] == case["num_samples"], case
    for (busy0, busy1), (wait0, wait1), least in zip(r["busy"], r["wait"], (0.12, 0.08), strict=True):
        full = slice(0, 2)  # the two full steps (the third is the epoch's short one)
        assert min(busy1[full]) >= 0.95 * least, (busy0, busy1)  # its sleeps alone
        assert sum(busy1) > sum(busy0), (busy0, busy1)
        assert sum(wait0) > sum(wait1), (wait0, wait1)
