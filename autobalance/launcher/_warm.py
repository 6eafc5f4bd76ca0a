"""Warm trials: torchrun is started once and its workers run one trial after another.

Each rank runs :mod:`autobalance.runtime._worker`, which keeps the process group, the CUDA
context and the imported modules. A trial is handed over as ``request-<N>.json`` in the pool
directory; the result is the same per-rank reports a cold trial writes. A trial that fails (OOM,
error, hang) poisons the group: the whole pool is killed (tree kill, as for cold trials) and the
next trial starts a fresh one.

A trial that succeeded can still end its pool: when a worker reports under ``warm.recycle`` that it
holds more than a fresh worker would (kernels of a compiled trial, tensors a script kept; see
:mod:`autobalance.runtime._carryover`), the pool is stopped after the trial and the next trial
starts a fresh one, so that no trial is charged for what earlier trials left behind.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import Any

from autobalance import _env
from autobalance._errors import LaunchError
from autobalance._files import write_json_atomic
from autobalance.launcher._outcome import TrialOutcome, classify, read_reports
from autobalance.launcher._procs import (
    become_subreaper,
    interrupts_deferred,
    kill_trial_processes,
)
from autobalance.launcher._torchrun import (
    TrialLaunch,
    build_command,
    child_setup,
    trial_environment,
    unwritable_trial_dir,
)
from autobalance.protocol import Status

__all__ = ["WarmPool", "cold_reason"]

_FAILURE_GRACE_S = 10.0
_PER_TRIAL_KEYS = (*_env.TrialEnv.NAMES, "PYTHONUNBUFFERED")
"""What a request sets for its trial alone (:class:`autobalance._env.TrialEnv`, and unbuffered output;
the pool's own environment has none of them): so one pool runs trials of different lengths and caps,
e.g. a study's trials and then its verification runs."""
_SAME_JOB_FIELDS = ("script", "script_args", "nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint",
                    "torchrun_args", "device", "pg_timeout_s", "env", "cpus")
"""The fields of :class:`TrialLaunch` a pool's workers were started with (see :meth:`WarmPool.serves`)."""
_FORKING = re.compile(r"\b(mp\.spawn|multiprocessing\.spawn|os\.fork|torch\.multiprocessing\.spawn)\b")


def cold_reason(script: str) -> str | None:
    """Why ``script`` cannot run warm (one line), or None. Scripts declare it with ``# autobalance: cold``."""
    try:
        with open(script, errors="replace") as fh:
            source = fh.read()
    except OSError:
        return None
    if "# autobalance: cold" in source:
        return f"{script} declares '# autobalance: cold'"
    match = _FORKING.search(source)
    if match:
        return f"{script} starts processes itself ({match.group(0)}), which a warm worker cannot re-run"
    return None


class WarmPool:
    """One long-lived torchrun job whose workers run trials on request."""

    def __init__(self, *, template: TrialLaunch, pool_dir: str, start_timeout_s: float = 300.0,
                 worker: tuple[str, ...] = ("-m", "autobalance.runtime._worker")) -> None:
        """``worker``: how torchrun starts each rank's worker (the CPU tests start one that installs a
        fake NVML first)."""
        self.template = template
        self.pool_dir = pool_dir
        self.start_timeout_s = start_timeout_s
        self.worker = tuple(worker)
        self.recycled: list[str] = []
        """Why the pool was restarted after a successful trial, one entry per restart."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.pool_id = ""
        self.seq = 0
        self.starts = 0
        self._dir = ""

    # ------------------------------------------------------------------ lifecycle
    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _start(self) -> None:
        become_subreaper()
        self.pool_id = uuid.uuid4().hex
        self._dir = os.path.join(self.pool_dir, f"pool-{self.starts:03d}-{self.pool_id[:8]}")
        os.makedirs(self._dir, exist_ok=True)
        self.starts += 1
        self.seq = 0
        t = self.template
        # the pool's torchrun: the template's, one node, running the warm worker around the script
        launch = dataclasses.replace(
            self.template, script=self.worker[0], script_args=[*self.worker[1:], t.script, *t.script_args],
            nnodes=1, node_rank=None, rdzv_endpoint=None, rdzv_id=None, config_json=None, global_batch=None,
            measure_s=0.0, trial_dir=self._dir, log_dir=None, env=dict(t.env), trial_id=self.pool_id,
        )
        env = trial_environment(launch)
        for key in _PER_TRIAL_KEYS:
            env.pop(key, None)
        env.update({_env.WARM: "1", _env.POOL_DIR: self._dir, "PYTHONUNBUFFERED": "1"})
        cmd = build_command(launch)
        with open(os.path.join(self._dir, "torchrun.log"), "wb") as log:
            try:
                self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True,
                                             preexec_fn=child_setup(launch))
            except OSError as exc:
                raise LaunchError(f"could not start the warm pool's torchrun ({exc}).") from exc

    def close(self, *, graceful: bool = True) -> None:
        """Stop the workers (they exit at the next poll) and make sure no process is left; without
        ``graceful`` (a failed or interrupted trial: workers may be stuck in a collective) kill at once."""
        if self.proc is None:
            return
        if self.alive and graceful:
            with open(os.path.join(self._dir, "stop"), "w"):
                pass
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        kill_trial_processes(self.pool_id, roots=(self.proc.pid,) if self.alive else (), grace_s=3.0)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None

    def serves(self, launch: TrialLaunch) -> bool:
        """Whether ``launch`` is the job this pool's workers run, apart from what a request sets per
        trial (configuration, steps, cap, directory): then :meth:`run` gives the same result a pool of
        its own would, without starting one."""
        return all(getattr(launch, name) == getattr(self.template, name) for name in _SAME_JOB_FIELDS)

    # ------------------------------------------------------------------ trials
    def run(self, launch: TrialLaunch, *, poll_s: float = 0.02,
            on_poll: Callable[[float], bool | None] | None = None) -> TrialOutcome:
        try:
            os.makedirs(launch.trial_dir, exist_ok=True)
        except OSError as exc:
            return unwritable_trial_dir(launch, exc)
        if not self.alive:
            if self.proc is not None:
                self.close(graceful=False)
            self._start()
        request: dict[str, Any] = {"env": {**launch.trial_env().to_env(), "PYTHONUNBUFFERED": "1"},
                                   "trial_id": launch.trial_id}
        path = os.path.join(self._dir, f"request-{self.seq}.json")
        write_json_atomic(path, request, fsync=False)
        self.seq += 1
        start = time.monotonic()
        # the trial's clock starts once every worker is up (a new pool gets start_timeout_s for that)
        ready_at: float | None = start if self._ready() else None
        timed_out = interrupted = pruned = False
        failed_at: float | None = None
        done = False
        try:
            while True:
                reports, problems = read_reports(launch.trial_dir, launch.world_size)
                if len(reports) == launch.world_size and all(r.status == Status.OK for r in reports.values()):
                    done = True
                    break
                if problems or any(r.status in (Status.OOM, Status.ERROR) for r in reports.values()):
                    failed_at = failed_at or time.monotonic()
                    if len(reports) + len(problems) == launch.world_size:
                        break  # every rank has answered: nothing more to wait for
                if not self.alive:
                    break
                if failed_at is not None and time.monotonic() - failed_at > _FAILURE_GRACE_S:
                    break
                now = time.monotonic()
                if ready_at is None and self._ready():
                    ready_at = now
                elapsed = now - start
                if now - (ready_at if ready_at is not None else start) > (
                        launch.timeout_s if ready_at is not None else self.start_timeout_s):
                    timed_out = True
                    break
                if on_poll is not None and on_poll(elapsed):
                    pruned = True
                    break
                time.sleep(poll_s)
        except KeyboardInterrupt as exc:
            with interrupts_deferred():
                self.close(graceful=False)
            outcome = classify(trial_dir=launch.trial_dir, world_size=launch.world_size, returncode=None,
                               timed_out=False, interrupted=True, wall_s=time.monotonic() - start,
                               timeout_s=launch.timeout_s)
            exc.outcome = outcome  # type: ignore[attr-defined]
            raise
        returncode: int | None = 0
        if not done:
            returncode = self.proc.poll() if self.proc is not None else None
            self._copy_logs(launch.trial_dir)
            with interrupts_deferred():
                self.close(graceful=False)
        outcome = classify(trial_dir=launch.trial_dir, world_size=launch.world_size,
                           returncode=None if timed_out else returncode, timed_out=timed_out,
                           interrupted=interrupted, wall_s=time.monotonic() - start, timeout_s=launch.timeout_s,
                           pruned=pruned)
        outcome.pool_start_s = max(0.0, (ready_at if ready_at is not None else time.monotonic()) - start)
        if done:
            reasons = sorted({str((rep.warm or {}).get("recycle")) for rep in outcome.reports.values()
                              if (rep.warm or {}).get("recycle")})
            if reasons:  # the next trial must not inherit what this one left: a fresh pool
                outcome.recycled = "; ".join(reasons)
                self.recycled.append(outcome.recycled)
                with interrupts_deferred():
                    self.close(graceful=True)
        return outcome

    def _ready(self) -> bool:
        """Every local worker has initialised its process group and waits for requests."""
        return all(os.path.exists(os.path.join(self._dir, f"ready-{r}"))
                   for r in range(self.template.nproc_per_node))

    def _copy_logs(self, trial_dir: str) -> None:
        """The pool's per-rank logs and torchrun's summary go with a failed trial (classify reads
        tracebacks and exit codes from them)."""
        for name in ("logs", "torchrun.log"):
            src = os.path.join(self._dir, name)
            dst = os.path.join(trial_dir, name)
            if os.path.exists(src) and not os.path.lexists(dst):
                try:
                    os.symlink(src, dst)
                except OSError:
                    pass
