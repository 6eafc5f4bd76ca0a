"""A trial's reason names the first failure in time, not torchrun's teardown (fast: the trial
directory is written by hand, in the form torchrun and the ranks leave it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from autobalance.launcher import classify
from autobalance.launcher._failure_order import failure_order, torchrun_failures


def entry(index: int, rank: int, code: int, pid: int, time: str = "2026-12-01_05:21:47",
          local_rank: int | None = None) -> str:
    signal = {-9: "  (SIGKILL)", -15: "  (SIGTERM)"}.get(code, "")
    local = rank if local_rank is None else local_rank
    return (f"[{index}]:\n  time      : {time}\n  host      : localhost\n  rank      : {rank} (local_rank: {local})\n"
            f"  exitcode  : {code} (pid: {pid}){signal}\n  error_file: <N/A>\n"
            f"  traceback : Signal {-code} received by PID {pid}\n")


def summary(failures: list[str], root: str, closing: list[int]) -> str:
    lines = [f"W1201 05:21:47.400000 26815 torch/distributed/elastic/multiprocessing/api.py:1029] "
             f"Sending process {pid} closing signal SIGTERM" for pid in closing]
    return "\n".join([
        *lines,
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "=" * 60, "/x/faulty.py FAILED", "-" * 60, "Failures:", *failures, "-" * 60,
        "Root Cause (first observed failure):", root, "=" * 60, ""])


def trial_dir(tmp_path: Path, log: str, reports: dict[int, dict] | None = None) -> str:
    d = tmp_path / "trial"
    d.mkdir()
    (d / "torchrun.log").write_text(log)
    for rank, rep in (reports or {}).items():
        (d / f"rank{rank}.json").write_text(json.dumps(rep))
    return str(d)


def crash(d: str, world: int = 2):
    return classify(trial_dir=d, world_size=world, returncode=1, timed_out=False, interrupted=False,
                    wall_s=1.0, timeout_s=60.0)


def test_the_rank_torchrun_terminated_is_not_the_cause(tmp_path):
    """Rank 1 is SIGKILLed; on a busy machine rank 0 has not yet noticed (no report) when torchrun
    sends it SIGTERM, and torch lists rank 0 first with the same second. Fails if the reason is
    picked by rank number ("rank 0 was killed by SIGTERM"), the flake of the fault test under load."""
    log = summary([entry(1, 0, -15, 101)], entry(0, 1, -9, 102), closing=[101])
    failures = torchrun_failures(log)
    assert failures is not None
    assert failures[0].torn_down and not failures[0].root_cause and failures[0].exitcode == -15
    assert not failures[1].torn_down and failures[1].root_cause and failures[1].exitcode == -9
    outcome = crash(trial_dir(tmp_path, log))
    assert outcome.status == "crash"
    assert outcome.failing_rank == 1
    assert outcome.reason.startswith("rank 1 was killed by SIGKILL (signal 9)"), outcome.reason
    assert outcome.reason.endswith("; ranks [0] were stopped by torchrun when it ended the job"), outcome.reason


def test_earlier_failure_time_wins_over_rank_number(tmp_path):
    """Two ranks died on their own (neither was torn down): the earlier time is the cause. Fails if
    rank order or torchrun's listing order decides."""
    log = summary([entry(1, 0, 1, 201, time="2026-12-01_05:21:49")],
                  entry(0, 2, -6, 203, time="2026-12-01_05:21:48"), closing=[])
    failures = torchrun_failures(log)
    assert failure_order([0, 1, 2], failures) == [2, 0, 1]
    outcome = crash(trial_dir(tmp_path, log), world=3)
    assert outcome.failing_rank == 2
    assert outcome.reason.startswith("rank 2 was killed by SIGABRT (signal 6)"), outcome.reason


def test_same_second_falls_back_to_torchruns_root_cause():
    log = summary([entry(1, 0, 1, 301)], entry(0, 1, 1, 302), closing=[])
    assert failure_order([0, 1], torchrun_failures(log)) == [1, 0]


def test_no_summary_keeps_rank_order():
    assert torchrun_failures("plain log, no failure") is None
    assert failure_order([1, 0], None) == [0, 1]


def test_the_first_oom_report_in_time_names_the_trial(tmp_path):
    """Both ranks ran out of memory; rank 1 wrote its report a second before rank 0. Fails if the
    reports are read in rank order."""
    def report(rank: int) -> dict:
        return {"status": "oom", "rank": rank, "error": f"OutOfMemoryError: rank {rank} at step 3"}

    d = trial_dir(tmp_path, "", {0: report(0), 1: report(1)})
    os.utime(os.path.join(d, "rank1.json"), ns=(1_000_000_000_000, 1_000_000_000_000))
    os.utime(os.path.join(d, "rank0.json"), ns=(1_001_000_000_000, 1_001_000_000_000))
    outcome = crash(d)
    assert outcome.status == "oom" and outcome.failing_rank == 1, outcome.reason
    assert "rank 1 ran out of memory" in outcome.reason


def test_a_rank_that_died_before_the_timeout_is_the_reason_not_the_timeout(tmp_path):
    """The job was killed at --trial-timeout, but torchrun had already seen rank 1 die by SIGKILL
    (its summary): the death came first. Fails if the timeout hides it. Without such a death (no
    summary) the trial is a timeout."""
    log = summary([entry(1, 0, -15, 101)], entry(0, 1, -9, 102), closing=[101])
    d = trial_dir(tmp_path, log)
    late = classify(trial_dir=d, world_size=2, returncode=None, timed_out=True, interrupted=False,
                    wall_s=61.0, timeout_s=60.0)
    assert late.status == "crash" and late.failing_rank == 1, late.reason
    assert late.reason.startswith("rank 1 was killed by SIGKILL"), late.reason
    (tmp_path / "trial" / "torchrun.log").write_text("no summary: torchrun was killed")
    hung = classify(trial_dir=d, world_size=2, returncode=None, timed_out=True, interrupted=False,
                    wall_s=61.0, timeout_s=60.0)
    assert hung.status == "timeout" and "--trial-timeout 60s" in hung.reason


PEER_FAILED = {"status": "peer_failed", "error": "Connection closed by peer", "world_size": 4}


def two_node_trial(tmp_path: Path, worker_log: str | None) -> str:
    """A 2 x 2 trial as the coordinator finds it: its own ranks 0 and 1 reported that they lost a peer
    and exited 1 (its torchrun lists them), the worker node's directory holds that node's torchrun log (or
    none yet) and its ranks' stderr under their local rank numbers."""
    d = trial_dir(tmp_path, summary([entry(1, 1, 1, 302)], entry(0, 0, 1, 301), closing=[]))
    node = Path(d) / "node-w1"
    for local in (0, 1):
        (node / "logs" / "run_x" / "attempt_0" / str(local)).mkdir(parents=True)
    rank2 = node / "logs" / "run_x" / "attempt_0" / "0" / "stderr.log"
    rank2.write_text('Traceback (most recent call last):\n  File "train.py", line 3\nRuntimeError: bad shard 7\n')
    if worker_log is not None:
        (node / "torchrun.log").write_text(worker_log)
    return d


def test_a_rank_on_another_node_is_judged_from_that_nodes_torchrun_log_and_its_own_stderr(tmp_path):
    """Rank 2 runs on the worker node as its local rank 0 and raised before it could report: the
    reason is its own error, read from the worker's log directory. Fails if only the coordinator's
    log is read (rank 2 was then said to have "finished normally (exit code 0)", CI's 2026-12-03
    misreport)."""
    log = summary([entry(1, 3, -15, 402, local_rank=1)], entry(0, 2, 1, 401, local_rank=0), closing=[402])
    d = two_node_trial(tmp_path, log)
    outcome = classify(trial_dir=d, world_size=4, returncode=0, timed_out=False, interrupted=False,
                       wall_s=1.0, timeout_s=60.0)
    assert outcome.status == "error", outcome.reason
    assert outcome.failing_rank == 2
    assert outcome.reason == "rank 2 failed before reporting: RuntimeError: bad shard 7", outcome.reason


def test_a_rank_on_another_node_without_a_summary_is_not_said_to_have_exited_0(tmp_path):
    d = two_node_trial(tmp_path, None)
    for rank in (0, 1):
        (Path(d) / f"rank{rank}.json").write_text(json.dumps({**PEER_FAILED, "rank": rank}))
    outcome = classify(trial_dir=d, world_size=4, returncode=0, timed_out=False, interrupted=False,
                       wall_s=1.0, timeout_s=60.0)
    assert outcome.status == "crash"
    assert outcome.failing_rank == 2
    assert "exit code 0" not in outcome.reason and "no node's torchrun listed it" in outcome.reason, outcome.reason


def test_a_timeout_stays_a_timeout_when_another_nodes_ranks_died_of_its_kill(tmp_path):
    """The coordinator's trial timed out and its torchrun was killed; in the seconds its kill takes, the
    worker node's ranks lose their peers and die, and that node's torchrun lists them as failed on their
    own. They died of the kill: the trial is a timeout. Fails if another node's summary counts as "a
    rank died first"."""
    log = summary([entry(1, 3, 1, 502, local_rank=1)], entry(0, 2, 1, 501, local_rank=0), closing=[])
    d = two_node_trial(tmp_path, log)
    (Path(d) / "torchrun.log").write_text("W1204 Received 15 death signal, shutting down workers\n")
    outcome = classify(trial_dir=d, world_size=4, returncode=None, timed_out=True, interrupted=False,
                       wall_s=61.0, timeout_s=60.0)
    assert outcome.status == "timeout", outcome.reason
    assert "killed the whole job" in outcome.reason
