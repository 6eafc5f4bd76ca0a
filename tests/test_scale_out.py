"""Scaling out (issue 8): multi-node trials through torchrun's c10d rendezvous (2 "nodes" x 2
ranks on loopback, gloo) and several trials at once on disjoint CPU core sets; slot planning.

The end-to-end tests run the real ``autobalance tune`` / ``autobalance worker`` commands. Several
tuners on one study (SQLite, PostgreSQL) are covered by tests/faults/test_concurrency.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from optuna.trial import TrialState

from autobalance._errors import UsageError
from autobalance.tuner._launching import Slot, plan_slots
from tests.tune_helpers import (
    FAULTY,
    REPO,
    assert_no_hold_timed_out,
    ctrl_c_reaches_it,
    load,
    processes_with,
)

PINNED = str(REPO / "tests" / "scripts" / "pinned.py")
COMMON = ["--device", "cpu", "--strategy", "optuna", "--seed", "0", "--prune-factor", "0", "--steps", "2",
          "--warmup", "1", "--study-name", "s"]


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "AB_FAULT_COUNTER": str(tmp_path / "launches")}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _no_processes(marker: Path, within: float = 30.0) -> list[int]:
    deadline = time.monotonic() + within
    left = processes_with(str(marker))
    while left and time.monotonic() < deadline:
        time.sleep(0.3)
        left = processes_with(str(marker))
    return left


# --------------------------------------------------------------------------- slot planning
def test_gpu_slots_are_disjoint_groups_of_the_visible_gpus() -> None:
    slots = plan_slots(device="cuda", nproc_per_node=1, nnodes=1, gpus_per_trial=1, cpus_per_trial=None,
                       gpus=["0", "1", "2"])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots] == ["0", "1", "2"]
    slots = plan_slots(device="cuda", nproc_per_node=2, nnodes=1, gpus_per_trial=2, cpus_per_trial=None,
                       gpus=["GPU-a", "GPU-b", "GPU-c", "GPU-d", "GPU-e"])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots] == ["GPU-a,GPU-b", "GPU-c,GPU-d"]  # floor(5 / 2)
    assert all(s.cpus is None for s in slots)
    assert "GPUs GPU-a,GPU-b" in slots[0].describe()


def test_cpu_slots_are_disjoint_core_sets() -> None:
    slots = plan_slots(device="cpu", nproc_per_node=2, nnodes=1, gpus_per_trial=None, cpus_per_trial=3,
                       cpus=[0, 1, 2, 3, 4, 5, 6])
    assert [s.cpus for s in slots] == [(0, 1, 2), (3, 4, 5)]
    assert slots[1].describe() == "slot 1: cores 3-5"
    both = plan_slots(device="cuda", nproc_per_node=1, nnodes=1, gpus_per_trial=1, cpus_per_trial=2,
                      gpus=["0", "1", "2", "3"], cpus=[0, 1, 2, 3, 4, 5])
    assert [(s.env["CUDA_VISIBLE_DEVICES"], s.cpus) for s in both] == [("0", (0, 1)), ("1", (2, 3)), ("2", (4, 5))]
    assert plan_slots(device="cpu", nproc_per_node=2, nnodes=1, gpus_per_trial=None, cpus_per_trial=None) == [Slot(0)]


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"device": "cpu", "gpus_per_trial": 1}, "--cpus-per-trial"),
    ({"device": "cuda", "gpus_per_trial": 1, "nproc_per_node": 2}, "each rank needs its own GPU"),
    ({"device": "cuda", "gpus_per_trial": 4}, "only 2 GPU(s) are visible"),
    ({"device": "cpu", "cpus_per_trial": 9}, "only 2 core(s)"),
    ({"device": "cpu", "cpus_per_trial": 1, "nnodes": 2}, "--nnodes"),
])
def test_bad_slot_flags_are_usage_errors(kwargs: dict[str, object], words: str) -> None:
    args: dict[str, object] = {"nproc_per_node": 1, "nnodes": 1, "gpus_per_trial": None, "cpus_per_trial": None,
                               "gpus": ["0", "1"], "cpus": [0, 1], **kwargs}
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        plan_slots(**args)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- multi-node trials
def _fake_worker(hub: Path, stop: threading.Event, **info: object) -> threading.Thread:
    """A worker registration whose beat counter moves (as ``autobalance worker`` writes it)."""
    (hub / "workers").mkdir(parents=True, exist_ok=True)

    def beat() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            (hub / "workers" / "w.json.tmp").write_text(json.dumps({"wid": "w", "host": "nodeX", "pid": 1, **info,
                                                                    "beat": n}))
            os.replace(hub / "workers" / "w.json.tmp", hub / "workers" / "w.json")
            stop.wait(0.3)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(("info", "words"), [
    ({"nnodes": 2, "nproc_per_node": 2, "script_sha256": "0" * 64, "script_args": []}, "another version"),
    ({"nnodes": 2, "nproc_per_node": 4, "script_sha256": None, "script_args": []}, "--nproc-per-node 4"),
    (None, "1 worker node"),
])
def test_the_coordinator_refuses_mismatched_workers_and_says_how_to_start_them(
        tmp_path: Path, info: dict[str, object] | None, words: str) -> None:
    from autobalance._errors import LaunchError
    from autobalance.launcher._multinode import Coordinator, hub_dir, script_sha256

    coordinator = Coordinator(runs_dir=str(tmp_path), rdzv_endpoint="127.0.0.1:1234", nnodes=2, nproc_per_node=2,
                              script=FAULTY, script_args=[], wait_s=4)
    stop = threading.Event()
    if info is not None:
        info = {**info, "script_sha256": info["script_sha256"] or script_sha256(FAULTY)}
        _fake_worker(Path(hub_dir(str(tmp_path), "127.0.0.1:1234")), stop, **info)
    coordinator.start()
    try:
        with pytest.raises(LaunchError, match=words.replace("(", r"\(")) as err:
            coordinator.wait_for_workers(1)
        if info is None:
            assert "autobalance worker --rdzv-endpoint 127.0.0.1:1234 --nnodes 2 --nproc-per-node 2" in str(err.value)
    finally:
        stop.set()
        coordinator.close()
    assert json.loads((Path(coordinator.hub) / "stop").read_text())["session"] == coordinator.session


@pytest.mark.parametrize(("given", "expected"), [
    ([], ["--rdzv-conf", "is_host=false"]),
    (["--rdzv-conf=timeout=900"], ["--rdzv-conf=timeout=900,is_host=false"]),
    (["--monitor-interval", "1", "--rdzv_conf", "read_timeout=90"],
     ["--monitor-interval", "1", "--rdzv_conf", "read_timeout=90,is_host=false"]),
    (["--rdzv-conf=is_host=true"], ["--rdzv-conf=is_host=true"]),
])
def test_a_worker_node_never_hosts_the_rendezvous_store(given: list[str], expected: list[str]) -> None:
    """On one machine (this loopback test, or a worker on the endpoint's host) torch lets any agent
    host the store; a worker's agent that did took the store away while the next trial used it."""
    from autobalance.launcher._multinode import never_host_the_store

    assert never_host_the_store(given) == expected


def _trial_logs(tmp_path: Path) -> str:
    """The tail of every torchrun and rank log of the study, for a failing assertion's message."""
    parts = []
    for path in sorted((tmp_path / "runs").rglob("*.log")):
        text = path.read_text(errors="replace")[-1500:]
        if text.strip():
            parts.append(f"--- {path.relative_to(tmp_path)}\n{text}")
    return "\n".join(parts)[-12000:]


def _two_node_study(tmp_path: Path, *, trials: int, trial_timeout: int,
                    env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], subprocess.Popen[str], str]:
    """``tune`` as "node 0" and ``autobalance worker`` as "node 1" on this machine, joined by a c10d
    rendezvous on 127.0.0.1: the finished tune, the worker (ended) and the worker's stderr."""
    runs = tmp_path / "runs"
    endpoint = f"127.0.0.1:{_free_port()}"
    (tmp_path / "node1").mkdir()
    worker = subprocess.Popen(
        [sys.executable, "-m", "autobalance", "worker", FAULTY, "--rdzv-endpoint", endpoint, "--nnodes", "2",
         "--nproc-per-node", "2", "--runs-dir", str(runs)],
        cwd=tmp_path / "node1", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        tune = subprocess.run(
            [sys.executable, "-m", "autobalance", "tune", FAULTY, "--trials", str(trials), "--nproc-per-node", "2",
             "--nnodes", "2", "--rdzv-endpoint", endpoint, "--runs-dir", str(runs), "--trial-timeout",
             str(trial_timeout), "--storage", f"sqlite:///{tmp_path / 'a.db'}", *COMMON],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        _out, err = worker.communicate(timeout=60)  # the coordinator's stop ends the worker
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    return tune, worker, err


@pytest.mark.slow
def test_two_nodes_on_loopback_every_rank_reports_and_a_hanging_trial_is_killed_on_every_node(tmp_path: Path) -> None:
    """A 3-trial study whose trials are 2 nodes x 2 ranks; trial 1 hangs on all 4 ranks: the
    coordinator's timeout kills its node's part and cancels the trial, the worker sees the cancel
    and kills its own, and the study goes on with the same worker. One study for both (each
    two-node study costs four torchrun agents and eight ranks on the 2-core CI machine)."""
    env = {**_env(tmp_path), "AB_FAULT": "hang_all", "AB_FAULT_ON_LAUNCH": "2", "AB_FAULT_ONCE": "1"}
    # 60 s, which the hang waits out: good trials took 12-15 s on the 2-core machine, but the first trial's
    # rendezvous of the two torchrun agents once took 18 s more (33 s in all, on an idle machine)
    tune, worker, err = _two_node_study(tmp_path, trials=3, trial_timeout=60, env=env)
    assert tune.returncode == 0, tune.stderr[-4000:]
    assert worker.returncode == 0, err[-4000:]
    assert "the study is over" in err
    trials = load(tmp_path / "a.db").get_trials()
    assert [t.user_attrs["status"] for t in trials] == ["ok", "timeout", "ok"], (
        [t.user_attrs.get("reason") for t in trials], err[-3000:], _trial_logs(tmp_path))
    hung = trials[1]
    assert "killed the whole job" in hung.user_attrs["reason"]
    nodes = [json.loads(p.read_text()) for p in Path(hung.user_attrs["trial_dir"]).glob("node-*.json")]
    assert [n.get("stopped") for n in nodes] == ["cancelled by the coordinator"]
    good = [trials[0], trials[2]]
    launched = [t for t in good if t.user_attrs.get("reused_from") is None]
    assert launched[0].number == 0
    for t in good:
        assert t.state == TrialState.COMPLETE, t.user_attrs.get("reason")
        assert len(t.user_attrs["peak_device_gib"]) == 4
        assert all(p is not None and p > 0 for p in t.user_attrs["peak_device_gib"])
        assert len(t.user_attrs["config"]["micro_batches"]) == 4
    for t in launched:
        trial_dir = Path(t.user_attrs["trial_dir"])
        reports = [json.loads((trial_dir / f"rank{r}.json").read_text()) for r in range(4)]
        assert [r["status"] for r in reports] == ["ok"] * 4
        assert {r["world_size"] for r in reports} == {4}
        nodes = [json.loads(p.read_text()) for p in trial_dir.glob("node-*.json")]
        assert [n["status"] for n in nodes] == ["finished"] and nodes[0]["returncode"] == 0
        assert (trial_dir / "cancel").exists()  # the coordinator closed the trial
        # each node kept its own torchrun log: this node's in the trial dir, the worker's in node-<id>/
        assert (trial_dir / "torchrun.log").exists() and list(trial_dir.glob("node-*/torchrun.log"))
    assert _no_processes(tmp_path) == []


# --------------------------------------------------------------------------- parallel trials
def _placements(trial_dir: str) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted(Path(trial_dir).glob("placement-rank*.json"))]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_two_trials_at_once_on_disjoint_cores(tmp_path: Path, mode: str) -> None:
    """--cpus-per-trial 1 on a 2-core affinity mask: 2 slots of 1-rank trials, each pinned to its core.
    Fails if two trials running at once share a core, or if none ran at once: the overlap is held
    for (pinned.py AB_PINNED_OVERLAP), and a hold that gave up fails first, naming itself."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    db = tmp_path / "a.db"
    cmd = [sys.executable, "-m", "autobalance", "tune", PINNED, "--trials", "3", "--nproc-per-node", "1",
           "--cpus-per-trial", "1", "--trial-timeout", "180", "--storage", f"sqlite:///{db}", *COMMON]
    if mode == "cold":
        cmd.append("--cold")
    # the tuner itself is limited to the 2 cores: its slots are one core each
    # the first two trials after the baseline wait for each other (tests/scripts/pinned.py): an overlap
    # is certain, not a matter of timing
    proc = subprocess.run(["taskset", "-c", ",".join(map(str, cores)), *cmd], cwd=tmp_path,
                          env={**_env(tmp_path), "AB_PINNED_OVERLAP": "3"}, capture_output=True, text=True, timeout=900)
    assert_no_hold_timed_out(tmp_path)  # the two trials after the baseline never ran at once
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "2 trials at a time" in proc.stderr
    everything = load(db).get_trials()
    # a slot that asked for a trial beyond the total at the same moment as the other records a
    # FAIL ``surplus`` trial without launching anything (see tests/faults/test_concurrency.py)
    trials = [t for t in everything if t.user_attrs.get("status") != "surplus"]
    assert all(t.state == TrialState.FAIL for t in everything if t not in trials)
    assert len(trials) == 3  # the baseline, then the two trials held until both run
    assert all(t.state == TrialState.COMPLETE and t.user_attrs["status"] == "ok" for t in trials)
    launched = [t for t in trials if t.user_attrs.get("reused_from") is None and not t.user_attrs["baseline"]]
    where = {}
    for t in launched:
        placement = _placements(t.user_attrs["trial_dir"])
        assert len(placement) == 1 and len(placement[0]["cpus"]) == 1  # type: ignore[arg-type]
        where[t.number] = placement[0]["cpus"][0]  # type: ignore[index]
    assert set(where.values()) == set(cores)  # both slots ran trials
    overlapping = [(a, b) for a in launched for b in launched if a.number < b.number
                   and a.datetime_start < b.datetime_complete and b.datetime_start < a.datetime_complete]
    assert overlapping, "no two trials ran at the same time"
    assert all(where[a.number] != where[b.number] for a, b in overlapping)  # concurrent trials: disjoint cores
    assert sorted(t.number for t in everything) == list(range(len(everything)))
    assert _no_processes(tmp_path) == []


@pytest.mark.slow
def test_interrupting_parallel_trials_kills_and_marks_every_running_one(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    db = tmp_path / "a.db"
    env = {**_env(tmp_path), "AB_FAULT": "hang_all", "AB_FAULT_ON_LAUNCH": "2"}
    cmd = [sys.executable, "-m", "autobalance", "tune", PINNED, "--trials", "5", "--nproc-per-node", "1",
           "--cpus-per-trial", "1", "--trial-timeout", "300", "--storage", f"sqlite:///{db}", *COMMON]
    proc = subprocess.Popen(["taskset", "-c", ",".join(map(str, cores)), *cmd], cwd=tmp_path, env=env, preexec_fn=ctrl_c_reaches_it,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        hanging: list[Path] = []
        while len(hanging) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)  # both slots' trials hang (a trial still starting up could end before the Ctrl-C)
            hanging = [p for p in (tmp_path / "autobalance_runs" / "s").glob("trial-*")
                       if (p / "hanging-rank0").exists() and not (p / "rank0.json").exists()]
        assert len(hanging) == 2, proc.stderr.read() if proc.poll() is not None else "trials did not start"
        proc.send_signal(2)  # Ctrl-C
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-4000:]
    trials = load(db).get_trials()
    interrupted = [t for t in trials if t.user_attrs.get("status") == "interrupted"]
    assert len(interrupted) == 2 and all(t.state == TrialState.FAIL for t in interrupted), err[-4000:]
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert _no_processes(tmp_path) == []
