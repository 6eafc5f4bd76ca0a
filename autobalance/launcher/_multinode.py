"""Multi-node trials: one torchrun per node, joined by torchrun's own c10d rendezvous.

The tuner runs on the *coordinating* node (``autobalance tune --nnodes N --rdzv-endpoint
HOST:PORT``); every other node runs ``autobalance worker`` with the same endpoint. For each trial
each node starts its own ``torchrun --nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT
--rdzv-id <trial>``; torchrun's rendezvous forms the job, assigns the ranks and sets up the process
group, exactly as in a hand-launched multi-node run.

The hand-off goes through the shared filesystem that holds ``--runs-dir`` (NFS, Lustre, ...;
it must be mounted on every node): the coordinator publishes each trial's request in a *hub*
directory, the ranks of every node write their reports into the (shared) trial directory, and the
coordinator collects all ``world_size`` of them. Files, not a network service: nothing else to
open in a firewall than what torchrun needs anyway (the rendezvous port, the process group's
ports), nothing to keep alive between trials, and the trial directory already is where the reports
of one-node trials go. The hub, ``<runs-dir>/multinode/<HOST_PORT>/``::

    coordinator.json      the tuner's session id and a beat counter (bumped every second)
    workers/<wid>.json    one per worker node: host, pid, nproc-per-node, script sha256, beat
    current.json          the current trial: rdzv id, config JSON, trial dir, steps, ..., the
                          worker nodes chosen for it
    stop                  the study is over (names the session): workers exit

and in each trial directory (shared): ``node-<wid>.json`` (a worker started / refused / finished the
trial, with its torchrun exit code), ``cancel`` (the trial is over for the coordinator: timeout,
pruned, interrupted or done; every worker kills whatever of the trial is still running there),
``rank<R>.json`` (the reports) and ``node-<wid>/`` (that node's torchrun and per-rank logs).

Liveness is judged from beat counters *changing*, as seen by the reader's own clock, never from
file times: node clocks need not agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from autobalance._errors import LaunchError
from autobalance._files import script_sha256, write_json_atomic
from autobalance.launcher._outcome import TrialOutcome, classify, read_reports
from autobalance.launcher._torchrun import TrialLaunch, run_trial, unwritable_trial_dir
from autobalance.protocol import Status

__all__ = ["Coordinator", "hub_dir", "never_host_the_store", "run_worker"]

BEAT_S = 1.0
"""How often the coordinator and the workers bump their beat counters."""
STALE_S = 20.0
"""A beat counter that has not changed for this long belongs to a node that is gone."""
REPORT_GRACE_S = 30.0
"""After the local torchrun ended, how long to wait for other nodes' reports to become visible
(a shared filesystem's attribute cache may hide new files for a while)."""
NODE_FAILED_GRACE_S = 15.0
"""A worker node's torchrun failed while this node's still runs: kill after this long."""
DONE_GRACE_S = 20.0
"""The coordinator's cancel came after every rank reported (the trial is over): how long a worker
lets its own torchrun finish its exit barrier before killing it."""
CANCEL_WAIT_S = 10.0
"""A worker's torchrun failed on its own: how long to look for the coordinator's cancel that explains it."""
WAIT_ENV = "AUTOBALANCE_NODES_WAIT_S"
"""How long the coordinator waits for the worker nodes before giving up (default 600 s)."""


def hub_dir(runs_dir: str, rdzv_endpoint: str) -> str:
    """The hand-off directory of the coordinator and workers that share ``rdzv_endpoint``."""
    key = re.sub(r"[^A-Za-z0-9_.-]", "_", rdzv_endpoint)
    return os.path.join(os.path.abspath(runs_dir), "multinode", key)


def _write_json(path: str, data: dict[str, Any]) -> None:
    write_json_atomic(path, data, fsync=False)


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _touch(path: str) -> None:
    with contextlib.suppress(OSError), open(path, "w"):
        pass


class _Beats:
    """When each beat counter was last seen to change (by this process's monotonic clock)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[Any, float]] = {}

    def see(self, key: str, value: Any) -> None:
        now = time.monotonic()
        old = self._seen.get(key)
        if old is None:
            # first sight: not known to be alive until the counter moves
            self._seen[key] = (value, now - STALE_S - 1)
        elif old[0] != value:
            self._seen[key] = (value, now)

    def age(self, key: str) -> float:
        old = self._seen.get(key)
        return float("inf") if old is None else time.monotonic() - old[1]

    def alive(self, key: str, *, stale_s: float = STALE_S) -> bool:
        return self.age(key) <= stale_s


# ============================================================================ the coordinator
class Coordinator:
    """The tuner's side: publishes each trial, runs this node's part, collects every node's reports."""

    def __init__(self, *, runs_dir: str, rdzv_endpoint: str, nnodes: int, nproc_per_node: int,
                 script: str, script_args: list[str], note: Callable[[str], None] | None = None,
                 wait_s: float | None = None) -> None:
        self.runs_dir = os.path.abspath(runs_dir)
        self.endpoint = rdzv_endpoint
        self.nnodes = nnodes
        self.nproc_per_node = nproc_per_node
        self.script_sha = script_sha256(script)
        self.script_args = list(script_args)
        self.note = note or (lambda text: None)
        self.wait_s = wait_s if wait_s is not None else float(os.environ.get(WAIT_ENV) or 600)
        self.hub = hub_dir(runs_dir, rdzv_endpoint)
        self.session = uuid.uuid4().hex
        self.seq = 0
        self._beat = 0
        self._beats = _Beats()
        self._workers: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        try:
            os.makedirs(os.path.join(self.hub, "workers"), exist_ok=True)
        except OSError as exc:
            raise LaunchError(f"could not create the multi-node hand-off directory {self.hub} "
                              f"({exc.strerror or exc}); --runs-dir must be writable") from None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.hub, "stop"))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.hub, "current.json"))
        self._tick()
        self._thread = threading.Thread(target=self._run, name="autobalance-coordinator", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """The study is over: workers that served this session exit."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with contextlib.suppress(OSError):
            _write_json(os.path.join(self.hub, "stop"), {"session": self.session})

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            with contextlib.suppress(Exception):
                self._tick()

    def _tick(self) -> None:
        self._beat += 1
        _write_json(os.path.join(self.hub, "coordinator.json"),
                    {"session": self.session, "beat": self._beat, "host": socket.gethostname(),
                     "pid": os.getpid(), "endpoint": self.endpoint, "nnodes": self.nnodes})
        workers: dict[str, dict[str, Any]] = {}
        with contextlib.suppress(OSError):
            for name in os.listdir(os.path.join(self.hub, "workers")):
                if name.endswith(".json"):
                    info = _read_json(os.path.join(self.hub, "workers", name))
                    if info is not None and isinstance(info.get("wid"), str):
                        workers[info["wid"]] = info
        with self._lock:
            for wid, info in workers.items():
                self._beats.see(wid, info.get("beat"))
            self._workers = workers

    def live_workers(self) -> list[dict[str, Any]]:
        with self._lock:
            live = [w for wid, w in self._workers.items() if self._beats.alive(wid)]
        rank = lambda w: (w["node_rank"] if isinstance(w.get("node_rank"), int) else 1 << 30, w["wid"])  # noqa: E731
        return sorted(live, key=rank)

    def _mismatch(self, worker: dict[str, Any]) -> str | None:
        where = f"the worker on {worker.get('host')} (pid {worker.get('pid')})"
        if worker.get("nnodes") != self.nnodes:
            return f"{where} was started with --nnodes {worker.get('nnodes')}, the study uses {self.nnodes}"
        if worker.get("nproc_per_node") != self.nproc_per_node:
            return (f"{where} runs --nproc-per-node {worker.get('nproc_per_node')}, the study "
                    f"{self.nproc_per_node}; every node must run the same number of ranks")
        if worker.get("script_sha256") != self.script_sha:
            return f"{where} runs another version of the training script (its sha256 differs); deploy the same file"
        if list(worker.get("script_args") or []) != self.script_args:
            return f"{where} passes other script arguments ({worker.get('script_args')} vs {self.script_args})"
        return None

    def wait_for_workers(self, count: int) -> list[dict[str, Any]]:
        """The first ``count`` live worker nodes; waits for them (a note once), raises after ``wait_s``."""
        deadline = time.monotonic() + self.wait_s
        noted = False
        while True:
            live = self.live_workers()
            for w in live:
                problem = self._mismatch(w)
                if problem is not None:
                    raise LaunchError(f"{problem}. Restart that worker with the tune command's settings.")
            if len(live) >= count:
                return live[:count]
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"{len(live)} of the {count} worker node(s) this study needs joined within {self.wait_s:g}s. "
                    f"Start `autobalance worker --rdzv-endpoint {self.endpoint} --nnodes {self.nnodes} "
                    f"--nproc-per-node {self.nproc_per_node} --runs-dir <the same shared directory> SCRIPT` "
                    f"on each other node (hand-off directory: {self.hub})."
                )
            if not noted:
                self.note(f"Waiting for {count - len(live)} worker node(s) to join (autobalance worker "
                          f"--rdzv-endpoint {self.endpoint}; hand-off directory {self.hub}).")
                noted = True
            time.sleep(0.25)

    # ------------------------------------------------------------------ one trial
    def run(self, launch: TrialLaunch, *, on_poll: Callable[[float], bool | None] | None = None) -> TrialOutcome:
        """Run one trial on every node; the outcome covers all ``world_size`` ranks."""
        nodes = self.wait_for_workers(self.nnodes - 1)
        try:
            os.makedirs(launch.trial_dir, exist_ok=True)
        except OSError as exc:
            return unwritable_trial_dir(launch, exc)
        self.seq += 1
        rel = os.path.relpath(launch.trial_dir, self.runs_dir)
        request = {
            "session": self.session, "seq": self.seq, "rdzv_id": launch.rdzv_id or launch.trial_id,
            "trial_id": launch.trial_id, "trial_dir": launch.trial_dir if rel.startswith("..") else rel,
            "nodes": [w["wid"] for w in nodes], "nnodes": launch.nnodes, "nproc_per_node": launch.nproc_per_node,
            **launch.shared(), "script_sha256": self.script_sha, "script_args": self.script_args,
        }
        _write_json(os.path.join(self.hub, "current.json"), request)
        aborted: list[tuple[str, str]] = []
        failed_at: dict[str, float] = {}

        def poll(elapsed: float) -> bool:
            if on_poll is not None and on_poll(elapsed):
                return True
            problem = self._node_problem(launch.trial_dir, nodes, failed_at)
            if problem is not None:
                aborted.append(problem)
                return True
            return False

        try:
            outcome = run_trial(launch, on_poll=poll, poll_s=0.2)
        finally:
            _touch(os.path.join(launch.trial_dir, "cancel"))
        if aborted:
            reason, tail = aborted[0]
            return dataclasses.replace(outcome, status=Status.CRASH, reason=reason[:300], traceback=tail)
        if outcome.status == Status.TIMEOUT:
            started = [w for w in nodes if (self._node_state(launch.trial_dir, w) or {}).get("status")
                       in ("started", "finished")]
            if len(started) < len(nodes):
                missing = [w.get("host", "?") for w in nodes if w not in started]
                return dataclasses.replace(outcome, status=Status.CRASH, reason=(
                    f"worker node(s) {', '.join(missing)} did not start the trial within --trial-timeout "
                    f"{launch.timeout_s:g}s; the ranks that did waited at the rendezvous")[:300])
            return outcome
        if outcome.status in (Status.INTERRUPTED, Status.PRUNED) or len(outcome.reports) == launch.world_size:
            return outcome
        return self._late_reports(launch, outcome)

    def _late_reports(self, launch: TrialLaunch, outcome: TrialOutcome) -> TrialOutcome:
        """This node's torchrun ended (after its exit barrier: every node's ranks are done) but some
        reports are not visible yet: wait for the shared filesystem, then judge again."""
        deadline = time.monotonic() + REPORT_GRACE_S
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                os.listdir(launch.trial_dir)  # revalidates the directory on NFS
            reports, problems = read_reports(launch.trial_dir, launch.world_size)
            if len(reports) + len(problems) == launch.world_size:
                break
            time.sleep(0.5)
        again = classify(trial_dir=launch.trial_dir, world_size=launch.world_size, returncode=outcome.returncode,
                         timed_out=False, interrupted=False, wall_s=outcome.wall_s, timeout_s=launch.timeout_s)
        again.leftover_pids = outcome.leftover_pids
        return again

    @staticmethod
    def _node_state(trial_dir: str, worker: dict[str, Any]) -> dict[str, Any] | None:
        return _read_json(os.path.join(trial_dir, f"node-{worker['wid']}.json"))

    def _node_problem(self, trial_dir: str, nodes: list[dict[str, Any]],
                      failed_at: dict[str, float]) -> tuple[str, str] | None:
        """Why this trial cannot succeed because of another node (reason, log tail), or None."""
        for w in nodes:
            host = w.get("host", "?")
            state = self._node_state(trial_dir, w) or {}
            if state.get("status") == "refused":
                return f"the worker on {host} refused the trial: {state.get('reason', '')}", ""
            if state.get("status") == "finished" and state.get("returncode") not in (0, None):
                first = failed_at.setdefault(w["wid"], time.monotonic())
                if time.monotonic() - first > NODE_FAILED_GRACE_S:
                    reports, _ = read_reports(trial_dir, self.nnodes * self.nproc_per_node)
                    missing = sorted(set(range(self.nnodes * self.nproc_per_node)) - set(reports))
                    return (f"the ranks on {host} failed (torchrun exit code {state.get('returncode')}); "
                            f"ranks {missing} did not report", str(state.get("log_tail", "")))
            if state.get("stopped") == "the worker was interrupted":
                return f"the worker on {host} was interrupted during the trial", ""
            with self._lock:
                alive = self._beats.alive(w["wid"]) and w["wid"] in self._workers
            if not alive:
                return f"the worker on {host} stopped (it left, or no heartbeat for {STALE_S:g}s)", ""
        return None


# ============================================================================ the worker
def run_worker(*, script: str, script_args: list[str], runs_dir: str, rdzv_endpoint: str, nnodes: int,
               nproc_per_node: int, node_rank: int | None = None, torchrun_args: list[str] | None = None,
               idle_timeout_s: float = 600.0, say: Callable[[str], None] = print) -> int:
    """Serve trials of the coordinator on ``rdzv_endpoint`` until it says the study is over
    (returns 0), no coordinator is seen for ``idle_timeout_s`` (0) or the worker is interrupted
    (KeyboardInterrupt propagates after the running trial was killed)."""
    hub = hub_dir(runs_dir, rdzv_endpoint)
    os.makedirs(os.path.join(hub, "workers"), exist_ok=True)
    host = socket.gethostname()
    wid = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', host)}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    info: dict[str, Any] = {"wid": wid, "host": host, "pid": os.getpid(), "nnodes": nnodes, "nproc_per_node": nproc_per_node,
            "node_rank": node_rank, "script_sha256": script_sha256(script), "script_args": list(script_args),
            "endpoint": rdzv_endpoint, "beat": 0}
    path = os.path.join(hub, "workers", f"{wid}.json")
    stop = threading.Event()

    def beat() -> None:
        while True:
            info["beat"] = int(info["beat"]) + 1
            with contextlib.suppress(OSError):
                _write_json(path, info)
            if stop.wait(BEAT_S):
                return

    beater = threading.Thread(target=beat, name="autobalance-worker-beat", daemon=True)
    beater.start()
    say(f"autobalance worker {wid}: waiting for trials of the coordinator on {rdzv_endpoint} (hand-off {hub})")
    coordinator = _Beats()
    served: set[str] = set()
    last: tuple[str, int] | None = None
    idle_since = time.monotonic()
    trials = 0
    try:
        while True:
            coord = _read_json(os.path.join(hub, "coordinator.json")) or {}
            session = str(coord.get("session", ""))
            if session:
                coordinator.see(session, coord.get("beat"))
                if coordinator.alive(session):
                    served.add(session)
                    idle_since = time.monotonic()
            ended = _read_json(os.path.join(hub, "stop"))
            if ended is not None and ended.get("session") in served and ended.get("session") == session:
                say(f"autobalance worker {wid}: the study is over ({trials} trial(s) served)")
                return 0
            if time.monotonic() - idle_since > idle_timeout_s:
                say(f"autobalance worker {wid}: no coordinator for {idle_timeout_s:g}s; exiting "
                    f"({trials} trial(s) served)")
                return 0
            request = _read_json(os.path.join(hub, "current.json"))
            if (request is not None and session and request.get("session") == session and session in served
                    and (session, request.get("seq")) != last and wid in (request.get("nodes") or [])):
                last = (session, int(request.get("seq") or 0))
                trials += 1
                _serve(request, hub=hub, wid=wid, host=host, info=info, script=script, script_args=script_args,
                       runs_dir=runs_dir, endpoint=rdzv_endpoint, node_rank=node_rank,
                       torchrun_args=list(torchrun_args or []), coordinator=coordinator, say=say)
                idle_since = time.monotonic()
                continue
            time.sleep(0.2)
    finally:
        stop.set()
        beater.join(timeout=5)
        with contextlib.suppress(OSError):
            os.unlink(path)


def never_host_the_store(torchrun_args: list[str]) -> list[str]:
    """A worker node's torchrun options with ``is_host=false`` added to its ``--rdzv-conf``.

    The c10d rendezvous store lives in the torchrun agent that first binds the endpoint's port when
    the endpoint names its own machine (torch's heuristic, else the first one to try). That is the
    coordinator's node (the endpoint is its address): a worker that hosted it instead - both nodes
    on one machine, or a worker on the endpoint's host - would take the store with it when its
    torchrun exits, and a worker's torchrun can outlive its trial by a few seconds (its exit barrier,
    the kill after a cancel), while the next trial's agents already use the store. A user's own
    ``is_host`` is kept."""
    args = list(torchrun_args)
    for i, arg in enumerate(args):
        name, eq, conf = arg.partition("=")
        if name not in ("--rdzv-conf", "--rdzv_conf"):
            continue
        if not eq:  # the value is the next option
            if i + 1 < len(args) and "is_host" not in args[i + 1]:
                args[i + 1] = f"{args[i + 1]},is_host=false"
            return args
        if "is_host" not in conf:
            args[i] = f"{name}={conf},is_host=false" if conf else f"{name}=is_host=false"
        return args
    return ["--rdzv-conf", "is_host=false", *args]


def _serve(request: dict[str, Any], *, hub: str, wid: str, host: str, info: dict[str, Any], script: str,
           script_args: list[str], runs_dir: str, endpoint: str, node_rank: int | None, torchrun_args: list[str],
           coordinator: _Beats, say: Callable[[str], None]) -> None:
    """Run this node's part of one trial (returns once it is over, killed or refused)."""
    rel = str(request.get("trial_dir", ""))
    trial_dir = rel if os.path.isabs(rel) else os.path.join(os.path.abspath(runs_dir), rel)
    state_path = os.path.join(trial_dir, f"node-{wid}.json")
    cancel = os.path.join(trial_dir, "cancel")
    if os.path.exists(cancel):
        return  # over before this worker saw it
    problems = []
    if request.get("nproc_per_node") != info["nproc_per_node"] or request.get("nnodes") != info["nnodes"]:
        problems.append(f"it asks for {request.get('nnodes')} nodes x {request.get('nproc_per_node')} ranks, this "
                        f"worker runs {info['nnodes']} x {info['nproc_per_node']}")
    if request.get("script_sha256") != info["script_sha256"]:
        problems.append("this node's training script differs from the coordinator's (sha256)")
    if list(request.get("script_args") or []) != list(script_args):
        problems.append(f"this node passes other script arguments ({script_args})")
    if problems:
        with contextlib.suppress(OSError):
            _write_json(state_path, {"status": "refused", "host": host, "reason": "; ".join(problems)})
        say(f"autobalance worker {wid}: refused trial {request.get('seq')}: {'; '.join(problems)}")
        return
    session = str(request.get("session"))
    launch = TrialLaunch.joining(
        request, script=script, script_args=list(script_args), nproc_per_node=int(info["nproc_per_node"]),
        nnodes=int(info["nnodes"]), node_rank=node_rank, rdzv_endpoint=endpoint, rdzv_id=str(request["rdzv_id"]),
        torchrun_args=never_host_the_store(torchrun_args), trial_dir=trial_dir,
        log_dir=os.path.join(trial_dir, f"node-{wid}"),
        # the coordinator's cancel ends the trial; this limit only backs it up
        timeout_s=float(request.get("timeout_s", 300)) + 60, trial_id=f"{request.get('trial_id')}-{wid}",
    )
    with contextlib.suppress(OSError):
        _write_json(state_path, {"status": "started", "host": host, "pid": os.getpid()})
    say(f"autobalance worker {wid}: trial {request.get('seq')} ({trial_dir})")
    stopped: list[str] = []

    world_size = int(info["nnodes"]) * int(info["nproc_per_node"])
    done_seen: list[float] = []

    def on_poll(elapsed: float) -> bool:
        if os.path.exists(cancel):
            # the coordinator's torchrun may end a moment before this one: a finished trial is not killed
            if not done_seen and len(read_reports(trial_dir, world_size)[0]) == world_size:
                done_seen.append(time.monotonic())
            if not done_seen or time.monotonic() - done_seen[0] > DONE_GRACE_S:
                stopped.append("cancelled by the coordinator")
                return True
            return False
        coord = _read_json(os.path.join(hub, "coordinator.json")) or {}
        if coord.get("session") == session:
            coordinator.see(session, coord.get("beat"))
        ended = _read_json(os.path.join(hub, "stop"))
        if (ended or {}).get("session") == session:
            stopped.append("the study is over")
            return True
        if not coordinator.alive(session):
            stopped.append(f"the coordinator stopped (no heartbeat for {STALE_S:g}s)")
            return True
        return False

    try:
        outcome = run_trial(launch, on_poll=on_poll, poll_s=0.25)
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):
            _write_json(state_path, {"status": "finished", "host": host, "returncode": None,
                                     "stopped": "the worker was interrupted"})
        raise
    if not stopped and outcome.returncode != 0:
        # the coordinator killed its side first (timeout, its own failure), and this node's torchrun
        # lost the rendezvous before the cancel was seen: the cancel is the cause, not this node
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline and not os.path.exists(cancel):
            time.sleep(0.2)
        if os.path.exists(cancel):
            stopped.append("cancelled by the coordinator")
    tail = ""
    with contextlib.suppress(OSError), open(os.path.join(launch.logs_at, "torchrun.log"), errors="replace") as fh:
        tail = fh.read()[-3000:]
    returncode = outcome.returncode if not stopped else None
    with contextlib.suppress(OSError):
        _write_json(state_path, {"status": "finished", "host": host, "returncode": returncode,
                                 "stopped": stopped[0] if stopped else None, "wall_s": round(outcome.wall_s, 3),
                                 "leftover_pids": outcome.leftover_pids, "log_tail": tail})
    say(f"autobalance worker {wid}: trial {request.get('seq')} ended"
        + (f" ({stopped[0]})" if stopped else f" (torchrun exit code {returncode})"))
