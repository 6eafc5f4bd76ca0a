"""Run one trial as one torchrun job: start, watch, time out, kill the whole tree, classify."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autobalance import _env
from autobalance._errors import LaunchError
from autobalance.launcher._outcome import TrialOutcome, classify, read_reports
from autobalance.launcher._procs import (
    become_subreaper,
    interrupts_deferred,
    kill_trial_processes,
    parent_death_signal,
)
from autobalance.protocol import Status

__all__ = ["TrialLaunch", "build_command", "child_setup", "run_trial"]

# After one rank reported a failure, torchrun normally tears the job down within seconds; if a
# peer is stuck in a collective and torchrun does not, the launcher kills the job itself.
_FAILURE_GRACE_S = 15.0

TORCHRUN = "autobalance.launcher._torchrun_main"
"""The module the launcher runs torchrun as (``python -m``): torchrun itself, without the teardown."""


@dataclass(kw_only=True)
class TrialLaunch:
    """Everything needed to start one trial."""

    script: str
    """The user's training script."""
    script_args: list[str] = field(default_factory=list)
    """Arguments passed to the script."""
    nproc_per_node: int
    """Processes (ranks) per node."""
    nnodes: int = 1
    """Nodes in the job (each node runs its own torchrun joining one rendezvous)."""
    node_rank: int | None = None
    """This node's rank in a static multi-node job (None: let the rendezvous assign it)."""
    rdzv_endpoint: str | None = None
    """``HOST:PORT`` of the c10d rendezvous; None on one node (``--standalone``)."""
    rdzv_id: str | None = None
    """Rendezvous id shared by the nodes of one trial (default: the trial id)."""
    torchrun_args: list[str] = field(default_factory=list)
    """Extra torchrun options passed through verbatim."""
    device: str = "cpu"
    """``cpu`` or ``cuda``."""
    config_json: str | None = None
    """The configuration (None: the script's own defaults, i.e. the baseline)."""
    global_batch: int | None = None
    """Global batch the baseline must use (None: the script's)."""
    steps: int = 3
    """Measured optimizer steps."""
    warmup: int = 1
    """Warm-up optimizer steps (not timed)."""
    measure_s: float = 0.0
    """Measure for about this long (more than ``steps`` measured steps, at most ``max_steps``); 0: exactly ``steps``."""
    max_steps: int = 50
    """Upper bound on measured steps when ``measure_s`` is set."""
    memory_cap_bytes: list[int] | None = None
    """Per-rank memory cap (one entry = all ranks)."""
    trial_dir: str
    """Directory for reports and logs."""
    timeout_s: float = 300.0
    """Hard wall-clock limit for the whole job."""
    pg_timeout_s: int = 60
    """Process-group timeout inside the ranks."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment (e.g. CUDA_VISIBLE_DEVICES for parallel trials)."""
    cpus: list[int] | None = None
    """CPU cores the job is pinned to (``sched_setaffinity`` before torchrun starts; its workers
    inherit it); None: not pinned."""
    log_dir: str | None = None
    """Where torchrun's log and the per-rank logs go (default: the trial directory; each node of a
    multi-node trial has its own, since the trial directory is shared)."""
    trial_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Marks every process of the trial."""

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def logs_at(self) -> str:
        return self.log_dir or self.trial_dir

    def trial_env(self) -> _env.TrialEnv:
        """The variables this trial sets for itself alone (see :class:`autobalance._env.TrialEnv`)."""
        return _env.TrialEnv(trial_dir=self.trial_dir, config_json=self.config_json, global_batch=self.global_batch,
                             steps=self.steps, warmup=self.warmup, measure_s=self.measure_s, max_steps=self.max_steps,
                             memory_cap_bytes=tuple(self.memory_cap_bytes) if self.memory_cap_bytes else None)

    def shared(self) -> dict[str, Any]:
        """What every node of a multi-node trial runs alike (sent to the other nodes as JSON)."""
        return {name: getattr(self, name) for name in SHARED_FIELDS}

    @classmethod
    def joining(cls, shared: dict[str, Any], **node: Any) -> TrialLaunch:
        """This node's part of a trial another node coordinates: the fields of :meth:`shared` as
        received (missing ones at their defaults), and this node's own (script, rendezvous,
        directories; a value given here wins)."""
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name in SHARED_FIELDS}
        values = {name: shared.get(name, defaults[name]) for name in SHARED_FIELDS}
        caps = values["memory_cap_bytes"]
        values.update(device=str(values["device"]), steps=int(values["steps"]), warmup=int(values["warmup"]),
                      measure_s=float(values["measure_s"]), max_steps=int(values["max_steps"]),
                      memory_cap_bytes=[int(c) for c in caps] if caps else None,
                      timeout_s=float(values["timeout_s"]), pg_timeout_s=int(values["pg_timeout_s"]))
        return cls(**{**values, **node})


SHARED_FIELDS = ("device", "config_json", "global_batch", "steps", "warmup", "measure_s", "max_steps",
                 "memory_cap_bytes", "timeout_s", "pg_timeout_s")
"""The fields of :class:`TrialLaunch` every node of a trial shares."""


def child_setup(launch: TrialLaunch) -> Callable[[], None]:
    """``preexec_fn`` of a trial's torchrun: die with the tuner; pinned to ``launch.cpus``."""
    cpus = list(launch.cpus or [])

    def setup() -> None:
        parent_death_signal()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def build_command(launch: TrialLaunch) -> list[str]:
    """torchrun's command line (``python -m torch.distributed.run`` through
    :mod:`autobalance.launcher._torchrun_main`, which skips the interpreter's teardown) ``... script
    args``: standalone on one node, else joining the c10d rendezvous at ``rdzv_endpoint``."""
    cmd = [sys.executable, "-m", TORCHRUN, "--nproc-per-node", str(launch.nproc_per_node),
           "--max-restarts", "0", "--log-dir", os.path.join(launch.logs_at, "logs"), "--redirects", "3"]
    if launch.nnodes == 1 and launch.rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(launch.nnodes), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", launch.rdzv_endpoint or "127.0.0.1:29400",
                "--rdzv-id", launch.rdzv_id or launch.trial_id]
        if launch.node_rank is not None:
            cmd += ["--node-rank", str(launch.node_rank)]
    return [*cmd, *launch.torchrun_args, launch.script, *launch.script_args]


def trial_environment(launch: TrialLaunch) -> dict[str, str]:
    """The parent's environment (NCCL/NVLink settings included) plus the trial's variables."""
    env = dict(os.environ)
    env.update(launch.env)
    # a trial never reads the store: the storage URL (and any password in it) stays out of the job;
    # the trial's own variables are only those it sets (an unset one is unset, not the parent's)
    dropped = {*_env.TrialEnv.NAMES, _env.STUDY, _env.CONFIG_FILE, _env.STORAGE}
    env = {name: value for name, value in env.items() if name not in dropped}
    env.update({
        _env.TRIAL_ID: launch.trial_id,
        _env.DEVICE: launch.device,
        _env.PG_TIMEOUT_S: str(launch.pg_timeout_s),
        "PYTHONUNBUFFERED": "1",
    })
    env.update(launch.trial_env().to_env())
    return env


def unwritable_trial_dir(launch: TrialLaunch, exc: OSError) -> TrialOutcome:
    """The outcome of a trial whose directory cannot be created or written (nothing was started)."""
    return TrialOutcome(
        status=Status.CRASH, trial_dir=launch.trial_dir,
        reason=f"could not write the trial directory {launch.trial_dir} ({exc.strerror or exc}); nothing was "
               "started. Check that --runs-dir is writable and its disk is not full",
    )


def run_trial(
    launch: TrialLaunch,
    *,
    poll_s: float = 0.1,
    on_poll: Callable[[float], bool | None] | None = None,
) -> TrialOutcome:
    """Run the job to completion, timeout or interruption; no process of it survives this call.

    ``on_poll(elapsed)`` returning True stops the job early (status ``pruned``).
    ``KeyboardInterrupt`` during the wait kills the job, then propagates with the outcome attached
    as ``exc.outcome``.
    """
    start = time.monotonic()
    try:
        os.makedirs(launch.trial_dir, exist_ok=True)
        os.makedirs(launch.logs_at, exist_ok=True)
        log = open(os.path.join(launch.logs_at, "torchrun.log"), "wb")  # noqa: SIM115
    except OSError as exc:
        return unwritable_trial_dir(launch, exc)
    become_subreaper()
    with log:
        try:
            proc = subprocess.Popen(
                build_command(launch), env=trial_environment(launch), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=child_setup(launch),
                cwd=os.getcwd(),
            )
        except OSError as exc:
            raise LaunchError(f"could not start torchrun ({exc}); check that torch is installed for {sys.executable}.") from exc
    timed_out = interrupted = pruned = False
    failure_seen_at: float | None = None
    try:
        while proc.poll() is None:
            elapsed = time.monotonic() - start
            if elapsed > launch.timeout_s:
                timed_out = True
                break
            if on_poll is not None and on_poll(elapsed):
                pruned = True
                break
            if failure_seen_at is None:
                reports, _ = read_reports(launch.trial_dir, launch.world_size)
                if any(r.status in (Status.OOM, Status.ERROR) for r in reports.values()):
                    failure_seen_at = time.monotonic()
            elif time.monotonic() - failure_seen_at > _FAILURE_GRACE_S:
                break
            time.sleep(poll_s)
    except KeyboardInterrupt as exc:
        interrupted = True
        with interrupts_deferred():  # a second Ctrl-C must not cut the kill short
            leftover = kill_trial_processes(launch.trial_id, roots=(proc.pid,))
            proc.wait(timeout=10)
        outcome = classify(trial_dir=launch.trial_dir, world_size=launch.world_size, returncode=proc.returncode,
                           timed_out=False, interrupted=True, wall_s=time.monotonic() - start,
                           timeout_s=launch.timeout_s)
        outcome.leftover_pids = leftover
        exc.outcome = outcome  # type: ignore[attr-defined]
        raise
    with interrupts_deferred():
        leftover = kill_trial_processes(launch.trial_id, roots=(proc.pid,) if proc.poll() is None else (),
                                        grace_s=5.0)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    outcome = classify(
        trial_dir=launch.trial_dir, world_size=launch.world_size,
        returncode=None if timed_out else proc.returncode, timed_out=timed_out, interrupted=interrupted,
        wall_s=time.monotonic() - start, timeout_s=launch.timeout_s, pruned=pruned,
    )
    outcome.leftover_pids = leftover
    return outcome
