"""Launching a trial: the slot it runs in, its warm pool (or a cold torchrun, or the multi-node
hand-off), its heartbeat in the storage and early stopping (pruning).

**Slots.** Several trials at once on one host, one *slot* per concurrent trial: a tuner thread that
asks Optuna (the TPE sampler's constant liar spreads concurrent asks) and launches on the slot's
devices. With ``--gpus-per-trial`` K, slot ``i``'s ``CUDA_VISIBLE_DEVICES`` is the ``i``-th group of
K visible GPUs (the tuner's own entries when set: indices, UUIDs or MIG ids alike); with
``--cpus-per-trial`` K, its torchrun is pinned to the ``i``-th group of K cores of the tuner's
affinity mask (``sched_setaffinity`` between fork and exec: every rank inherits it). One-node
trials use ``torchrun --standalone`` (a free port per job): concurrent trials never share a
rendezvous.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import optuna

from autobalance._config import BalanceConfig
from autobalance._errors import UsageError
from autobalance.launcher import TrialLaunch, TrialOutcome, WarmPool, cold_reason, run_trial
from autobalance.protocol import TrialAttr, best_trial
from autobalance.store import heartbeat_interval_s, trial_id
from autobalance.tuner._reporter import Reporter, TrialCoordinator
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner._time_spent import TrialOverhead
from autobalance.tuner.search import (
    AUTO_MEASURE_FACTOR,
    AUTO_MEASURE_MAX_S,
    WARM_PRUNE_MIN_STEPS,
    compile_env,
)

__all__ = ["Slot", "Stopped", "TrialLauncher", "beating", "best_step_s", "plan_slots"]


class Stopped(KeyboardInterrupt):
    """Raised in a slot's trial when another slot stopped the study (or the tuner was interrupted):
    the trial is killed and marked interrupted like on Ctrl-C."""


@contextlib.contextmanager
def beating(beat: Callable[[], object], *, at_once: bool = True) -> Iterator[None]:
    """Call ``beat`` (errors ignored) every few seconds on a thread while the block runs: a heartbeat."""
    stop = threading.Event()

    def run() -> None:
        if at_once and not stop.is_set():
            with contextlib.suppress(Exception):
                beat()
        while not stop.wait(min(3.0, heartbeat_interval_s() / 2)):
            with contextlib.suppress(Exception):
                beat()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


class TrialLauncher:
    """Starts the study's trials: one slot per concurrent trial, a warm pool per slot (created on
    first use), the multi-node coordinator when ``--nnodes`` > 1."""

    def __init__(self, *, settings: TuneSettings, storage: optuna.storages.RDBStorage, reporter: Reporter,
                 stop: threading.Event | None = None, pool: WarmPool | None = None) -> None:
        """``pool``: a warm pool shared with other tuners of the same script (the caller closes it)."""
        self.settings = settings
        self.storage = storage
        self.reporter = reporter
        self.stop = stop if stop is not None else threading.Event()  # a slot failed or Ctrl-C: trials killed
        self.owns_pool = pool is None
        self.cold = settings.cold  # --cold, or a script that cannot run warm (cold_note says why)
        self.cold_note: str | None = None
        self.trials_run = 0  # trials launched, the baseline included
        self.overhead = TrialOverhead()  # what --measure-s auto reads (count_trials)
        self.coordinator: TrialCoordinator | None = None
        self._slots: list[Slot] | None = None
        self._pools: dict[int, WarmPool] = {} if pool is None else {0: pool}  # by slot index
        self._local = threading.local()
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ slots
    def slots(self) -> list[Slot]:
        """Where concurrent trials run (bad --gpus-per-trial/--cpus-per-trial: an error here)."""
        if self._slots is None:
            s = self.settings
            self._slots = plan_slots(device=s.device, nproc_per_node=s.nproc_per_node, nnodes=s.nnodes,
                                     gpus_per_trial=s.gpus_per_trial, cpus_per_trial=s.cpus_per_trial)
        return self._slots

    def enter_slot(self, slot: Slot) -> None:
        self._local.slot = slot

    def slot(self) -> Slot:
        """The slot of the calling thread (the first one on the main thread)."""
        return getattr(self._local, "slot", None) or self.slots()[0]

    # ------------------------------------------------------------------ launching
    def launch(self, study: optuna.Study, *, number: int, config: BalanceConfig | None,
               trial: optuna.Trial | None = None, again: bool = False) -> TrialOutcome:
        """Run one trial (``config`` None: the script's own configuration) and classify its end.
        A ``trial`` beats its heartbeat and may be pruned; ``again``: a re-measure run."""
        s = self.settings
        name = f"trial-{number:04d}-{int(time.time())}" + ("-again" if again else "")
        trial_dir = os.path.abspath(os.path.join(s.runs_dir, s.study_name, name))
        slot = self.slot()
        launch = TrialLaunch(
            script=s.script, script_args=list(s.script_args), nproc_per_node=s.nproc_per_node, nnodes=s.nnodes,
            node_rank=s.node_rank, rdzv_endpoint=s.rdzv_endpoint, torchrun_args=list(s.torchrun_args),
            device=s.device, config_json=None if config is None else config.to_json(),
            global_batch=s.global_batch if config is None else None, steps=s.steps, warmup=s.warmup,
            measure_s=self.measure_s(study), max_steps=s.max_steps,
            memory_cap_bytes=s.caps_bytes() if s.cap_mode == "enforce" else None, trial_dir=trial_dir,
            timeout_s=s.trial_timeout, pg_timeout_s=int(max(30, min(300, s.trial_timeout / 2))),
            env={**compile_env(s), **slot.env}, cpus=list(slot.cpus or []) or None,
        )
        # Pruning a warm trial kills the pool (restart: seconds); worth it only for long trials.
        prune = s.prune_factor > 0 and (self.cold or s.nnodes > 1 or s.steps >= WARM_PRUNE_MIN_STEPS)
        pruner = _Pruner(trial, os.path.join(trial_dir, "progress.json"), best_step_s(study),
                         s.prune_factor) if prune and trial is not None else None

        def on_poll(elapsed: float) -> bool:
            if self.stop.is_set():  # another slot failed or the tuner was interrupted
                raise Stopped
            self.reporter.tick(number, elapsed)
            return pruner.should_stop() if pruner is not None else False

        started_at = time.time()
        heartbeat = contextlib.nullcontext() if trial is None else beating(
            functools.partial(self.storage.record_heartbeat, trial_id(trial)))
        try:
            with heartbeat:
                if s.nnodes > 1:
                    outcome = self._coordinator().run(launch, on_poll=on_poll)
                elif (pool := self._pool(launch)) is not None:
                    outcome = pool.run(launch, on_poll=on_poll)
                else:
                    outcome = run_trial(launch, on_poll=on_poll)
                outcome.started_at = started_at
                return outcome
        finally:
            with self._lock:
                self.trials_run += 1

    def measure_s(self, study: optuna.Study) -> float:
        """How long the next trial measures: ``--measure-s``, or with ``auto`` on CUDA 7/3 of the
        per-trial overhead (so the steps take >= 70 % of a trial), at most 2 s."""
        s = self.settings
        if not isinstance(s.measure_s, str):
            return float(s.measure_s)
        if s.device != "cuda":
            return 0.0
        if not self.overhead.counted:
            self.count_trials(study)
        overhead = self.overhead.seconds
        return 0.0 if overhead is None else min(AUTO_MEASURE_MAX_S, AUTO_MEASURE_FACTOR * overhead)

    def count_trials(self, study: optuna.Study) -> None:
        """Bring :attr:`overhead` up to date with the study's trials (after each recorded trial)."""
        self.overhead.update(study.get_trials(deepcopy=False))

    def beat_now(self, trial: optuna.Trial) -> None:  # a tuner killed before its trial starts leaves it stale
        with contextlib.suppress(Exception):
            self.storage.record_heartbeat(trial_id(trial))

    # ------------------------------------------------------------------ pools and the coordinator
    def _coordinator(self) -> TrialCoordinator:
        if self.coordinator is None:
            from autobalance.launcher import Coordinator

            s = self.settings
            assert s.rdzv_endpoint, "checked in Tuner.run()"
            self.coordinator = Coordinator(runs_dir=s.runs_dir, rdzv_endpoint=s.rdzv_endpoint, nnodes=s.nnodes,
                                           nproc_per_node=s.nproc_per_node, script=s.script,
                                           script_args=list(s.script_args), note=self.reporter.note)
            self.coordinator.start()
        return self.coordinator

    def _pool(self, launch: TrialLaunch) -> WarmPool | None:
        """The slot's warm pool (its workers hold the slot's devices for the whole study); None: cold."""
        s = self.settings
        if self.cold or s.nnodes > 1:
            return None
        slot = self.slot().index
        with self._lock:
            pool = self._pools.get(slot)
            if pool is None:
                reason = cold_reason(s.script)
                if reason is not None:
                    self.cold_note = f"Cold trials (one torchrun per trial): {reason}."
                    self.reporter.note(self.cold_note)
                    self.cold = True
                    return None
                pool_dir = os.path.abspath(os.path.join(s.runs_dir, s.study_name))
                pool = self._pools[slot] = WarmPool(template=launch, pool_dir=pool_dir)
        return pool

    def close_slot(self, slot: Slot) -> None:
        """Close the slot's pool, from the thread that started it (its parent-death signal)."""
        with self._lock:
            pool = self._pools.pop(slot.index, None) if slot.index or self.owns_pool else None
        if pool is not None:
            pool.close()

    def take_pool(self) -> WarmPool | None:
        """The study's own warm pool, handed to the caller (who closes it), when one slot ran the
        trials on this thread (a slot thread's pool is closed by that thread)."""
        with self._lock:
            if not self.owns_pool or self._slots is None or len(self._slots) != 1:
                return None
            return self._pools.pop(0, None)

    def close(self) -> None:
        for slot, pool in self._pools.items():
            if slot or self.owns_pool:
                pool.close()
        self._pools.clear()
        if self.coordinator is not None:
            self.coordinator.close()
            self.coordinator = None


def best_step_s(study: optuna.Study) -> float | None:
    """The best trial's step time (``protocol.best_trial``: one meaning of best); None before one."""
    best = best_trial(study)
    step_ms = best.user_attrs.get(TrialAttr.STEP_TIME_MS) if best is not None else None
    return float(step_ms) / 1000 if step_ms else None


@dataclass
class _Pruner:
    """Reports each measured step time as an intermediate value; asks to stop a hopeless trial."""

    trial: optuna.Trial
    path: str  # the trial's progress.json
    best: float | None
    factor: float
    reported: int = 0
    stop: bool = False

    def should_stop(self) -> bool:
        if self.stop or not os.path.exists(self.path):
            return self.stop
        try:
            with open(self.path) as fh:
                progress = json.load(fh)
        except (OSError, ValueError):
            return False
        measured = progress.get("step_times_s", [])[int(progress.get("warmup_steps", 0)):]
        while self.reported < len(measured):
            with contextlib.suppress(Exception):
                self.trial.report(measured[self.reported], self.reported)
            self.reported += 1
        if self.best and self.factor and measured:
            self.stop = sorted(measured)[len(measured) // 2] > self.factor * self.best
        return self.stop


# -------------------------------------------------------------- slots: where concurrent trials run
@dataclass(frozen=True)
class Slot:
    """Where one concurrent trial runs."""

    index: int
    env: dict[str, str] = field(default_factory=dict)  # its trials' CUDA_VISIBLE_DEVICES
    cpus: tuple[int, ...] | None = None  # the cores its trials are pinned to (None: not pinned)

    def describe(self) -> str:
        parts = []
        if "CUDA_VISIBLE_DEVICES" in self.env:
            parts.append(f"GPUs {self.env['CUDA_VISIBLE_DEVICES']}")
        if self.cpus is not None:
            parts.append(f"cores {_ranges(self.cpus)}")
        return f"slot {self.index}: " + (", ".join(parts) or "all devices")


def _ranges(cpus: tuple[int, ...]) -> str:
    groups: list[list[int]] = []
    for c in sorted(cpus):
        if groups and groups[-1][1] == c - 1:
            groups[-1][1] = c
        else:
            groups.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in groups)


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: its ``CUDA_VISIBLE_DEVICES`` entries, or all indices."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is not None:
        return [x.strip() for x in raw.split(",") if x.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def plan_slots(*, device: str, nproc_per_node: int, nnodes: int, gpus_per_trial: int | None,
               cpus_per_trial: int | None, gpus: list[str] | None = None,
               cpus: list[int] | None = None) -> list[Slot]:
    """The slots for the flags (one slot, unpinned, when neither flag is given)."""
    if gpus_per_trial is None and cpus_per_trial is None:
        return [Slot(0)]
    if nnodes > 1:
        raise UsageError("--gpus-per-trial/--cpus-per-trial run several one-node trials at once; they do not combine "
                         "with --nnodes > 1 (a multi-node trial uses whole nodes).")
    counts = []
    if gpus_per_trial is not None:
        if device != "cuda":
            raise UsageError("--gpus-per-trial needs --device cuda; on CPU use --cpus-per-trial.")
        if gpus_per_trial < nproc_per_node:
            raise UsageError(f"--gpus-per-trial={gpus_per_trial} is smaller than --nproc-per-node={nproc_per_node}; "
                             "each rank needs its own GPU.")
        gpus = visible_gpus() if gpus is None else gpus
        if len(gpus) < gpus_per_trial:
            raise UsageError(f"--gpus-per-trial={gpus_per_trial} but only {len(gpus)} GPU(s) are visible; "
                             "use fewer or check CUDA_VISIBLE_DEVICES.")
        counts.append(len(gpus) // gpus_per_trial)
    if cpus_per_trial is not None:
        cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
        if len(cpus) < cpus_per_trial:
            raise UsageError(f"--cpus-per-trial={cpus_per_trial} but this process may use only {len(cpus)} core(s); "
                             "use fewer.")
        counts.append(len(cpus) // cpus_per_trial)
    g, c = gpus_per_trial, cpus_per_trial
    return [Slot(i, {} if g is None or gpus is None else {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * g:i * g + g])},
                 None if c is None or cpus is None else tuple(cpus[i * c:i * c + c])) for i in range(min(counts))]
