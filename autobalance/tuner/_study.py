"""The tuning loop: an Optuna study whose trials are real torchrun jobs."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance._errors import LaunchError, TrialScriptError, UsageError
from autobalance.launcher import TrialLaunch, TrialOutcome, WarmPool, cold_reason, run_trial
from autobalance.launcher._procs import interrupts_deferred
from autobalance.protocol import (
    CONSTRAINTS_KEY,
    MEASURED_STATUSES,
    TOLD_STATUSES,
    Status,
    StudyAttr,
    TrialAttr,
    best_trial,
    is_feasible,
)
from autobalance.tuner._compile import ATTR_COMPILE_TOTAL, compile_env, compile_notes, space_problem
from autobalance.tuner._objective import TrialFigures, figures_from_outcome
from autobalance.tuner._parallel import Slot, plan_slots
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner._space import SearchSpace
from autobalance.tuner._storage import heartbeat_interval_s, mask, open_storage
from autobalance.tuner._workers import NOT_COUNTED, BaselineClaim, fail_stale_trials, worker_id

__all__ = [
    "ATTR_BASELINE",
    "ATTR_OBJECTIVE",
    "ATTR_REFERENCE",
    "ATTR_SPACE",
    "TuneResult",
    "Tuner",
    "best_trial",
    "make_sampler",
]

ATTR_SPACE = StudyAttr.SPACE
ATTR_OBJECTIVE = StudyAttr.OBJECTIVE
ATTR_REFERENCE = StudyAttr.REFERENCE
ATTR_BASELINE = StudyAttr.BASELINE
ATTR_CAPACITY = StudyAttr.CAPACITY
ATTR_DEVICE = StudyAttr.DEVICE
ATTR_SCRIPT_SHA = StudyAttr.SCRIPT_SHA
ATTR_LAUNCH = StudyAttr.LAUNCH
MAX_CRASHES_IN_A_ROW = 3
_WARM_PRUNE_MIN_STEPS = 20


@dataclass(kw_only=True)
class TuneResult:
    """What a finished ``tune`` produced."""

    study_name: str
    storage: str
    """Masked storage URL."""
    trials_run: int
    """Trials launched by this invocation (reused or predicted trials not counted)."""
    baseline: FrozenTrial | None
    best: FrozenTrial | None
    wall_s: float
    saved: bool = False
    """Whether the best configuration was saved to the store."""
    notes: list[str] = field(default_factory=list)


def make_sampler(settings: TuneSettings, *, n_trials: int) -> optuna.samplers.BaseSampler:
    seed = settings.seed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if settings.sampler == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if settings.sampler == "gp":
            return optuna.samplers.GPSampler(seed=seed, n_startup_trials=min(10, max(2, n_trials // 4)))
        if settings.sampler == "nsga2":
            return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, min(20, n_trials // 3)))
        return optuna.samplers.TPESampler(
            seed=seed, multivariate=True, constant_liar=True, n_startup_trials=min(10, max(3, n_trials // 4))
        )


def script_sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


class Tuner:
    """Runs ``settings.trials`` trials of one study (continuing an existing one)."""

    def __init__(self, *, settings: TuneSettings, reporter: Any = None, pool: WarmPool | None = None) -> None:
        """``pool``: a warm pool shared with other tuners of the same script (the caller closes it)."""
        self.settings = settings
        self.reporter = reporter or _NullReporter()
        self.storage = open_storage(settings.storage)
        self._crashes_in_a_row = 0
        self._measured: dict[str, FrozenTrial] = {}
        self.trials_run = 0
        self.advisor: Any = None
        self.pool: WarmPool | None = pool
        self._owns_pool = pool is None
        self.cold_note: str | None = None
        # several trials at once (see _parallel): one thread per slot, these shared between them
        self.slots: list[Slot] | None = None
        self._local = threading.local()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._slot_pools: dict[int, WarmPool] = {}
        self._running_here: set[int] = set()
        self._in_flight: dict[str, threading.Event] = {}
        self.coordinator: Any = None

    # ------------------------------------------------------------------ study set-up
    def _open_study(self) -> optuna.Study:
        s = self.settings
        directions: list[Any] = ["minimize", "minimize"] if s.multi_objective else ["minimize"]
        study = optuna.create_study(
            study_name=s.study_name, storage=self.storage, directions=directions,
            sampler=make_sampler(s, n_trials=s.trials), load_if_exists=True,
        )
        if [d.name.lower() for d in study.directions] != directions:
            raise UsageError(
                f"--study-name={s.study_name!r} exists with {len(study.directions)} objective(s) but this run asks for "
                f"{len(directions)} ({'--multi-objective' if s.multi_objective else 'single objective'}); "
                "use the same setting or a new --study-name."
            )
        objective = {"weight_spread": s.weight_spread, "weight_time": s.weight_time, "headroom": s.headroom,
                     "multi_objective": s.multi_objective, "caps_bytes": s.caps_bytes(), "device": s.device,
                     "world_size": s.world_size, "nnodes": s.nnodes, "cap_mode": s.cap_mode,
                     "max_spread_gib": s.max_spread_gib}
        stored = study.user_attrs.get(ATTR_OBJECTIVE)
        if stored is None:
            study.set_user_attr(ATTR_OBJECTIVE, objective)
            names = ["spread_frac", "step_time_norm"] if s.multi_objective else ["spread_plus_time"]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                study.set_metric_names(names)
        elif stored != objective:
            diff = sorted(k for k in objective if stored.get(k) != objective[k])
            raise UsageError(
                f"--study-name={s.study_name!r} exists with another search space/objective (differs in: {', '.join(diff)}); "
                "run with the original settings to continue it, or pass a new --study-name."
            )
        fail_stale_trials(study, self.storage)
        self._measured = {
            json.dumps(t.user_attrs[TrialAttr.CONFIG], sort_keys=True): t
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if TrialAttr.CONFIG in t.user_attrs and t.user_attrs.get(TrialAttr.STATUS) in MEASURED_STATUSES
        }
        return study

    @staticmethod
    def counted_trials(study: optuna.Study) -> int:
        """Finished trials (interrupted, stale or surplus ones excluded: they are retried) plus running ones."""
        return sum(1 for t in study.get_trials(deepcopy=False) if Tuner._counts(t))

    # ------------------------------------------------------------------ launching
    def _launch(self, study: optuna.Study, *, number: int, config: BalanceConfig | None,
                heartbeat_trial_id: int | None, trial: optuna.Trial | None = None) -> TrialOutcome:
        s = self.settings
        trial_dir = os.path.abspath(os.path.join(s.runs_dir, s.study_name, f"trial-{number:04d}-{int(time.time())}"))
        launch = TrialLaunch(
            script=s.script, script_args=list(s.script_args), nproc_per_node=s.nproc_per_node, nnodes=s.nnodes,
            node_rank=s.node_rank, rdzv_endpoint=s.rdzv_endpoint, torchrun_args=list(s.torchrun_args),
            device=s.device, config_json=None if config is None else config.to_json(),
            global_batch=s.global_batch if config is None else None, steps=s.steps, warmup=s.warmup,
            measure_s=self._measure_s(study), max_steps=s.max_steps,
            memory_cap_bytes=s.caps_bytes() if s.cap_mode == "enforce" else None, trial_dir=trial_dir, timeout_s=s.trial_timeout,
            pg_timeout_s=int(max(30, min(300, s.trial_timeout / 2))),
            env={**compile_env(s), **self._slot().env}, cpus=list(self._slot().cpus or []) or None,
        )
        stop = threading.Event()
        beat = None
        if heartbeat_trial_id is not None:
            beat = threading.Thread(target=self._heartbeat, args=(heartbeat_trial_id, stop), daemon=True)
            beat.start()
        # Pruning a warm trial kills the pool (restart: seconds); worth it only for long trials.
        prune = trial is not None and s.prune_factor > 0 and (s.cold or s.nnodes > 1 or s.steps >= _WARM_PRUNE_MIN_STEPS)
        pruner = _Pruner(trial=trial, trial_dir=trial_dir, best_step_s=self._best_step_s(study),
                         factor=s.prune_factor) if prune and trial is not None else None

        def on_poll(elapsed: float) -> bool:
            if self._stop.is_set():  # another slot failed or the tuner was interrupted
                raise _Stopped
            self.reporter.tick(number, elapsed)
            return pruner.should_stop() if pruner is not None else False

        try:
            if s.nnodes > 1:
                return self._coordinator().run(launch, on_poll=on_poll)
            pool = self._pool(launch)
            if pool is not None:
                return pool.run(launch, on_poll=on_poll)
            return run_trial(launch, on_poll=on_poll)
        finally:
            stop.set()
            if beat is not None:
                beat.join(timeout=5)
            with self._lock:
                self.trials_run += 1

    def _record_launch(self, study: optuna.Study) -> None:
        """How this run starts the script (once it is accepted): what ``promote`` verifies with."""
        s = self.settings
        if s.nnodes == 1:
            study.set_user_attr(ATTR_LAUNCH, {
                "script": os.path.abspath(s.script), "script_args": list(s.script_args),
                "nproc_per_node": s.nproc_per_node, "device": s.device, "torchrun_args": list(s.torchrun_args),
                "runs_dir": os.path.abspath(s.runs_dir), "trial_timeout": s.trial_timeout, "cold": s.cold,
                "compile_env": compile_env(s)})

    def _measure_s(self, study: optuna.Study) -> float:
        """How long the next trial measures: ``--measure-s``, or with ``auto`` on CUDA 7/3 of the
        per-trial overhead seen so far (so the steps take >= 70 % of a trial), at most 2 s."""
        s = self.settings
        if not isinstance(s.measure_s, str):
            return float(s.measure_s)
        if s.device != "cuda":
            return 0.0
        overhead = per_trial_overhead_s(study.get_trials(deepcopy=False))
        return 0.0 if overhead is None else min(AUTO_MEASURE_MAX_S, AUTO_MEASURE_FACTOR * overhead)

    def _slot(self) -> Slot:
        """The slot of the calling thread (the first one on the main thread)."""
        slot = getattr(self._local, "slot", None)
        if slot is None:
            slots = self._plan_slots()
            slot = slots[0]
        return slot  # type: ignore[no-any-return]

    def _plan_slots(self) -> list[Slot]:
        if self.slots is None:
            s = self.settings
            self.slots = plan_slots(device=s.device, nproc_per_node=s.nproc_per_node, nnodes=s.nnodes,
                                    gpus_per_trial=s.gpus_per_trial, cpus_per_trial=s.cpus_per_trial)
        return self.slots

    def _coordinator(self) -> Any:
        """The multi-node hand-off (started on first use; see ``launcher._multinode``)."""
        if self.coordinator is None:
            from autobalance.launcher._multinode import Coordinator

            s = self.settings
            assert s.rdzv_endpoint, "checked in run()"
            self.coordinator = Coordinator(runs_dir=s.runs_dir, rdzv_endpoint=s.rdzv_endpoint, nnodes=s.nnodes,
                                           nproc_per_node=s.nproc_per_node, script=s.script,
                                           script_args=list(s.script_args), note=self.reporter.note)
            self.coordinator.start()
        return self.coordinator

    def _pool(self, launch: TrialLaunch) -> WarmPool | None:
        """The warm pool, created on first use; None when trials must run cold."""
        s = self.settings
        if s.cold or s.nnodes > 1:
            return None
        slot = self._slot().index
        with self._lock:
            pool = self.pool if slot == 0 else self._slot_pools.get(slot)
            if pool is None:
                reason = cold_reason(s.script)
                if reason is not None:
                    self.cold_note = f"Cold trials (one torchrun per trial): {reason}."
                    self.reporter.note(self.cold_note)
                    s.cold = True
                    return None
                # one pool per slot: its workers hold the slot's devices for the whole study
                pool_dir = os.path.abspath(os.path.join(s.runs_dir, s.study_name))
                pool = WarmPool(template=launch, pool_dir=pool_dir)
                if slot == 0:
                    self.pool = pool
                else:
                    self._slot_pools[slot] = pool
        return pool

    def close(self) -> None:
        if self.pool is not None and self._owns_pool:
            self.pool.close()
            self.pool = None
        for pool in self._slot_pools.values():
            pool.close()
        self._slot_pools.clear()
        if self.coordinator is not None:
            self.coordinator.close()
            self.coordinator = None

    @staticmethod
    def _best_step_s(study: optuna.Study) -> float | None:
        times = [t.user_attrs[TrialAttr.STEP_TIME_MS] / 1000 for t in study.get_trials(deepcopy=False)
                 if is_feasible(t) and t.user_attrs.get(TrialAttr.STEP_TIME_MS)]
        return min(times) if times else None

    def _heartbeat(self, trial_id: int, stop: threading.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                self.storage.record_heartbeat(trial_id)
            stop.wait(min(3.0, heartbeat_interval_s() / 2))

    # ------------------------------------------------------------------ recording
    def _capacity(self, study: optuna.Study) -> list[float] | None:
        cap = study.user_attrs.get(ATTR_CAPACITY)
        return [float(c) for c in cap] if cap else None

    def record(self, study: optuna.Study, trial: optuna.Trial, config: BalanceConfig, outcome: TrialOutcome,
               *, baseline: bool = False) -> FrozenTrial:
        s = self.settings
        figures = figures_from_outcome(outcome, world_size=s.world_size, caps=s.caps_bytes(),
                                       fallback_capacity=self._capacity(study))
        attrs: dict[str, Any] = {
            **figures.user_attrs(s.headroom),
            "status": outcome.status,
            "reason": outcome.reason,
            "config": config.to_dict(),
            "baseline": baseline,
            "wall_s": round(outcome.wall_s, 3),
            "trial_dir": outcome.trial_dir,
        }
        if outcome.traceback:
            attrs["error_tail"] = outcome.traceback[-1500:]
        if outcome.failing_rank is not None:
            attrs["failing_rank"] = outcome.failing_rank
        if outcome.pool_start_s > 0.05:
            attrs["pool_start_s"] = round(outcome.pool_start_s, 3)
        try:  # per-rank memory chart as a trial artifact; Optuna accepts artifacts only before tell
            from autobalance.report import artifact_dir_for, upload_trial_chart

            upload_trial_chart(study, trial, artifact_dir_for(s.storage), attrs=attrs)
        except Exception as exc:
            warnings.warn(f"autobalance: trial {trial.number}'s memory chart was not stored ({exc})", stacklevel=2)
        return self._tell(study, trial, figures, attrs, outcome.status)

    def _tell(self, study: optuna.Study, trial: optuna.Trial, figures: TrialFigures, attrs: dict[str, Any],
              status: str) -> FrozenTrial:
        s = self.settings
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        if status == Status.PRUNED:
            return study.tell(trial, state=TrialState.PRUNED)
        if status in TOLD_STATUSES:
            reference = study.user_attrs.get(ATTR_REFERENCE)
            if figures.measured and reference is None:
                reference = float(figures.step_time_s)  # type: ignore[arg-type]
                study.set_user_attr(ATTR_REFERENCE, reference)
            constraints = [figures.memory_constraint(s.headroom)]
            if s.max_spread_gib is not None:
                spread = figures.spread_bytes() if figures.measured else None
                # same keys on every trial (GPSampler requires it): unmeasured trials violate it too
                constraints.append(1.0 if spread is None else spread / 2**30 - s.max_spread_gib)
            trial.set_user_attr(TrialAttr.FEASIBLE, all(c <= 0 for c in constraints) and status == Status.OK)
            self.storage.set_trial_system_attr(trial._trial_id, CONSTRAINTS_KEY, constraints)
            values = figures.values(reference_step_s=reference, weight_spread=s.weight_spread,
                                    weight_time=s.weight_time, multi_objective=s.multi_objective)
            frozen = study.tell(trial, values)
        else:
            frozen = study.tell(trial, state=TrialState.FAIL)
        if "config" in attrs and status in MEASURED_STATUSES:
            self._measured[json.dumps(attrs["config"], sort_keys=True)] = frozen
        return frozen

    # ------------------------------------------------------------------ the loop
    def _baseline(self, study: optuna.Study) -> SearchSpace:
        s = self.settings
        number = len(study.get_trials(deepcopy=False))
        self.reporter.start(number, None, baseline=True)
        outcome = self._launch(study, number=number, config=None, heartbeat_trial_id=None)
        rep = next((r for _, r in sorted(outcome.reports.items()) if r.get("defaults") and r.get("model")), None)
        if outcome.status == Status.ERROR:
            raise TrialScriptError(
                f"the baseline trial (the script's own configuration) failed: {outcome.reason}. "
                f"Fix the script; logs in {outcome.trial_dir}.", traceback_text=outcome.traceback,
                rank=outcome.failing_rank,
            )
        if rep is None:
            raise LaunchError(
                f"the baseline trial ended with '{outcome.status}' ({outcome.reason}) before any rank reported "
                f"its model; logs in {outcome.trial_dir}. "
                + ("Raise --trial-timeout." if outcome.status == Status.TIMEOUT else "Check that the script calls plan.wrap().")
            )
        defaults = BalanceConfig.from_dict(rep["defaults"])
        dtypes = s.dtypes or self._default_dtypes(rep)
        if defaults.dtype not in dtypes:
            dtypes = [defaults.dtype, *dtypes]
        space = SearchSpace.build(world_size=s.world_size, global_batch=defaults.global_batch,
                                  num_layers=int(rep["model"].get("num_blocks", 0)), dtypes=dtypes,
                                  max_accumulation=max(s.max_accumulation, defaults.accumulation),
                                  compile_modes=s.compile_modes())
        if defaults.accumulation not in space.accumulations:
            space.accumulations = sorted({*space.accumulations, defaults.accumulation})
        capacity = [float((outcome.reports.get(r) or rep)["device"]["capacity_bytes"]) for r in range(s.world_size)]
        if s.device == "cuda" and s.caps_bytes():
            too_big = [(r, c) for r, c in enumerate(s.caps_bytes() or []) if c > capacity[r]]
            if too_big:
                r, c = too_big[0]
                raise UsageError(
                    f"--memory-cap-gib={c / 2**30:g} for rank {r} is larger than its card ({capacity[r] / 2**30:.1f} GiB); "
                    "use a smaller cap."
                )
        study.set_user_attr(ATTR_SPACE, space.to_dict())
        study.set_user_attr(ATTR_CAPACITY, capacity)
        study.set_user_attr(ATTR_DEVICE, rep["device"])
        study.set_user_attr(ATTR_SCRIPT_SHA, script_sha256(s.script))
        study.set_user_attr(StudyAttr.TORCH_VERSION, rep.get("torch_version"))
        study.set_user_attr(StudyAttr.CUDA_VERSION, rep.get("cuda_version"))
        study.enqueue_trial(space.params_from_config(defaults), user_attrs={"baseline": True})
        trial = study.ask()
        frozen = self.record(study, trial, defaults, outcome, baseline=True)
        study.set_user_attr(ATTR_BASELINE, frozen.number)
        self.reporter.finish(frozen, best_trial(study))
        return space

    @staticmethod
    def _default_dtypes(rep: dict[str, Any]) -> list[str]:
        if rep["device"]["type"] == "cuda":
            return ["fp32", "bf16", "fp16"]
        return ["fp32", "bf16"]

    def run(self) -> TuneResult:
        s = self.settings
        start = time.monotonic()
        self._plan_slots()  # bad --gpus-per-trial/--cpus-per-trial: an error before anything runs
        if s.nnodes > 1 and not s.rdzv_endpoint:
            raise UsageError(f"--nnodes={s.nnodes} needs --rdzv-endpoint HOST:PORT (a port on this node that the other "
                             "nodes reach); start `autobalance worker` with the same endpoint on each of them.")
        study = self._open_study()
        space_dict = study.user_attrs.get(ATTR_SPACE)
        space = SearchSpace.from_dict(space_dict) if space_dict else None
        if space is not None:
            self._check_space(space)
        self.reporter.begin(s, already=self.counted_trials(study))
        try:
            if space is None or ATTR_BASELINE not in study.user_attrs:
                space = self._baseline_once(study)
            self._record_launch(study)
            if self.advisor is None and s.strategy == "model":
                self.advisor = _make_advisor(space=space, settings=s)
            slots = self._plan_slots()
            if len(slots) > 1:
                self._run_parallel(study, space, slots)
            else:
                while self._more_trials(study):
                    self._one_trial(study, space)
        finally:
            self.close()
        best = best_trial(study)
        base_no = study.user_attrs.get(ATTR_BASELINE)
        baseline = study.trials[base_no] if base_no is not None else None
        result = TuneResult(study_name=s.study_name, storage=mask(s.storage), trials_run=self.trials_run,
                            baseline=baseline, best=best, wall_s=time.monotonic() - start)
        self._summarise(study, result)
        return result

    def _run_parallel(self, study: optuna.Study, space: SearchSpace, slots: list[Slot]) -> None:
        """One thread per slot, each asking, launching and telling trials until the study is done.
        A slot that fails (a script error that stops the study, too many crashes) or a Ctrl-C stops
        every slot: their running trials are killed and marked interrupted (run again on the next start)."""
        errors: list[BaseException] = []
        self.reporter.note(f"{len(slots)} trials at a time: " + "; ".join(slot.describe() for slot in slots) + ".")

        finished = [threading.Event() for _ in slots]

        def work(slot: Slot, done: threading.Event) -> None:
            self._local.slot = slot
            try:
                while not self._stop.is_set() and self._more_trials(study):
                    self._one_trial(study, space)
            except BaseException as exc:
                errors.append(exc)
                self._stop.set()
            finally:
                # a pool is closed by the thread that (re)started it: its parent-death signal follows that thread
                with self._lock:
                    pool = self._slot_pools.pop(slot.index, None)
                    if slot.index == 0 and self._owns_pool:
                        pool, self.pool = self.pool, None
                if pool is not None:
                    pool.close()
                done.set()

        threads = [threading.Thread(target=work, args=(slot, done), name=f"autobalance-slot-{slot.index}",
                                    daemon=True) for slot, done in zip(slots, finished, strict=True)]
        for thread in threads:
            thread.start()
        # Events, not Thread.join: a join interrupted by Ctrl-C can mark a running thread as stopped
        # (CPython < 3.13), and the tuner would then exit while a slot still records its trial.
        try:
            while not all(done.is_set() for done in finished):
                for done in finished:
                    done.wait(timeout=0.2)
        except KeyboardInterrupt:
            self._stop.set()
            with interrupts_deferred():  # the slots kill and mark their trials; a second Ctrl-C waits
                for done in finished:
                    done.wait(timeout=120)
            raise
        real = [e for e in errors if not isinstance(e, _Stopped)]
        if real:
            raise real[0]
        if errors:
            raise KeyboardInterrupt

    def _summarise(self, study: optuna.Study, result: TuneResult) -> None:
        trials = study.get_trials(deepcopy=False)
        predicted = [t for t in trials if t.user_attrs.get(TrialAttr.STATUS) == Status.PREDICTED_OOM]
        pruned = sum(t.state == TrialState.PRUNED for t in trials)
        if predicted:
            result.notes.append(f"{len(predicted)} configuration(s) predicted to run out of memory were recorded without "
                                "launching.")
        launched = [t for t in trials if t.user_attrs.get(TrialAttr.STATUS) == Status.OK and t.user_attrs.get(TrialAttr.STEPS_S) is not None
                    and t.user_attrs.get(TrialAttr.WALL_S) and t.user_attrs.get(TrialAttr.REUSED_FROM) is None]
        if len(launched) >= 2:
            # a warm pool's own start is paid once per (re)start, not per trial: reported apart
            starts = sum(float(t.user_attrs.get(TrialAttr.POOL_START_S) or 0.0) for t in launched)
            walls = sum(float(t.user_attrs[TrialAttr.WALL_S]) for t in launched) - starts
            in_steps = sum(float(t.user_attrs[TrialAttr.STEPS_S]) for t in launched)
            result.notes.append(
                f"Steps took {100 * in_steps / max(walls, 1e-9):.0f}% of the measured trials' wall time (median "
                f"overhead {per_trial_overhead_s(launched, last=len(launched)) or 0:.2f} s per trial: the script's "
                "set-up, hand-over" + (f"; plus {starts:.1f} s starting warm workers)." if starts else ")."))
        compiled_skipped = sum((t.user_attrs.get(TrialAttr.CONFIG) or {}).get("compile", "off") != "off" for t in predicted)
        compile_times = sorted(float(t.user_attrs[TrialAttr.COMPILE_S]) for t in trials if t.user_attrs.get(TrialAttr.COMPILE_S))
        if compiled_skipped and compile_times:
            median = compile_times[len(compile_times) // 2]
            result.notes.append(f"{compiled_skipped} of them compiled: about {compiled_skipped * median:.0f} s of "
                                f"compilation saved (the study's median compile, {median:.1f} s, each).")
        if pruned:
            result.notes.append(f"{pruned} trial(s) were stopped early (pruned) as clearly slower than the best.")
        if self.cold_note:
            result.notes.append(self.cold_note)
        compile_lines, compile_total = compile_notes(trials)
        if compile_lines:
            study.set_user_attr(ATTR_COMPILE_TOTAL, round(compile_total, 3))
            result.notes.extend(compile_lines)
        if self.advisor is not None:
            error = self.advisor.holdout_error(study)
            if error is not None:
                study.set_user_attr(StudyAttr.MEMORY_MODEL_ERROR, error)
                result.notes.append(f"Memory model: {100 * error:.1f}% mean error predicting held-out trials' per-rank peaks.")

    def _check_space(self, space: SearchSpace) -> None:
        """A continued study keeps its search space: flags that would change it are an error."""
        s = self.settings
        problems = []
        if s.global_batch is not None and s.global_batch != space.global_batch:
            problems.append(f"--global-batch={s.global_batch} (the study searches global batch {space.global_batch})")
        if s.dtypes is not None and set(s.dtypes) - set(space.dtypes):
            problems.append(f"--dtypes={','.join(s.dtypes)} (the study searches {','.join(space.dtypes)})")
        compile_problem = space_problem(s, space)
        if compile_problem:
            problems.append(compile_problem)
        if problems:
            raise UsageError(
                f"--study-name={s.study_name!r} exists with another search space: {'; '.join(problems)}; "
                "run with the original settings to continue it, or pass a new --study-name."
            )

    def _baseline_once(self, study: optuna.Study) -> SearchSpace:
        """Run the baseline, or wait while another worker on this study runs it (see ``_workers``)."""
        claim = BaselineClaim(self.storage, study._study_id, owner=worker_id(),
                              stale_after_s=3 * heartbeat_interval_s())
        waiting = False
        while True:
            attrs = study.user_attrs
            if ATTR_BASELINE in attrs and ATTR_SPACE in attrs:
                return SearchSpace.from_dict(attrs[ATTR_SPACE])
            if claim.try_acquire():
                break
            if not waiting:
                holder = claim.holder() or {}
                self.reporter.note(f"Waiting for the baseline trial that {holder.get('owner', 'another worker')} runs.")
                waiting = True
            time.sleep(1.0)
        stop = threading.Event()

        def refresh() -> None:
            while not stop.wait(min(3.0, heartbeat_interval_s() / 2)):
                with contextlib.suppress(Exception):
                    claim.refresh()

        beat = threading.Thread(target=refresh, daemon=True)
        beat.start()
        try:
            attrs = study.user_attrs  # recorded by another worker while this one took the claim?
            if ATTR_BASELINE in attrs and ATTR_SPACE in attrs:
                return SearchSpace.from_dict(attrs[ATTR_SPACE])
            return self._baseline(study)
        finally:
            stop.set()
            beat.join(timeout=5)
            claim.release()

    def _more_trials(self, study: optuna.Study) -> bool:
        """Whether to ask for another trial; waits for other workers' running trials at the end
        (one may go stale and need a replacement)."""
        total = self.settings.trials
        noted = False
        while True:
            if self._stop.is_set():
                return False
            fail_stale_trials(study, self.storage)
            if self.counted_trials(study) < total:
                return True
            with self._lock:  # this tuner's own running trials (other slots) are not waited for
                running = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                           if t._trial_id not in self._running_here]
            if not running:
                return False
            if not noted:
                self.reporter.note(f"Waiting for {len(running)} trial(s) that other workers on this study are running.")
                noted = True
            time.sleep(min(3.0, heartbeat_interval_s() / 2))

    def _surplus(self, study: optuna.Study, trial: optuna.Trial) -> bool:
        """Another worker asked for the last trial at the same moment: fail this one (not counted)."""
        total = self.settings.trials
        before = [t for t in study.get_trials(deepcopy=False) if t.number < trial.number]
        counted = sum(1 for t in before if self._counts(t))
        if counted < total:
            return False
        trial.set_user_attr(TrialAttr.STATUS, Status.SURPLUS)
        trial.set_user_attr(TrialAttr.REASON, f"{total} trials were already counted when it was asked (another worker "
                                      "took the last one); nothing was launched")
        study.tell(trial, state=TrialState.FAIL)
        return True

    @staticmethod
    def _counts(t: FrozenTrial) -> bool:
        status = t.user_attrs.get(TrialAttr.STATUS)
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            return status != Status.PREDICTED_OOM
        if t.state == TrialState.FAIL:
            return status not in NOT_COUNTED
        return t.state == TrialState.RUNNING

    def _one_trial(self, study: optuna.Study, space: SearchSpace) -> None:
        with self._lock:  # one ask at a time: the advisor's proposals and the in-flight set stay consistent
            if self.advisor is not None:
                self.advisor.before_ask(study)
            trial = study.ask()
            with contextlib.suppress(Exception):  # beat at once: a tuner killed before its trial starts leaves it stale
                self.storage.record_heartbeat(trial._trial_id)
            if self._surplus(study, trial):
                return
            self._running_here.add(trial._trial_id)
        try:
            self._run_asked(study, space, trial)
        except BaseException as exc:
            # whatever stopped the tuner here (Ctrl-C, a storage or launcher error), the trial must
            # not stay RUNNING: record why (an interrupted one is run again on the next start)
            with contextlib.suppress(Exception):
                if study._storage.get_trial(trial._trial_id).state == TrialState.RUNNING:
                    interrupted = isinstance(exc, KeyboardInterrupt)
                    trial.set_user_attr(TrialAttr.STATUS, Status.INTERRUPTED if interrupted else Status.CRASH)
                    trial.set_user_attr(TrialAttr.REASON, "the tuner was interrupted (Ctrl-C or SIGTERM); the trial's processes "
                                        "were killed" if interrupted else f"the tuner failed: {type(exc).__name__}: "
                                        f"{mask(str(exc))[:250]}")
                    study.tell(trial, state=TrialState.FAIL)
            raise
        finally:
            with self._lock:
                self._running_here.discard(trial._trial_id)

    def _run_asked(self, study: optuna.Study, space: SearchSpace, trial: optuna.Trial) -> None:
        config = space.suggest(trial)
        key = config.to_json()
        while True:
            with self._lock:
                running = self._in_flight.get(key)
                if running is None:
                    seen = self._measured.get(key)
                    if seen is not None:
                        self._reuse(study, trial, seen)
                        return
                    if self.advisor is not None:
                        predicted = self.advisor.predict_infeasible(study, config)
                        if predicted is not None:
                            self._tell(study, trial, predicted[0], {**predicted[1], "config": config.to_dict()},
                                       Status.PREDICTED_OOM)
                            self.reporter.finish(study.trials[trial.number], best_trial(study), predicted=True)
                            return
                    done = self._in_flight[key] = threading.Event()
                    break
            # another slot measures this very configuration: wait for it, then reuse its result
            while not running.wait(0.5):
                if self._stop.is_set():
                    raise _Stopped
        try:
            self._measure(study, trial, config)
        finally:
            with self._lock:
                self._in_flight.pop(key, None)
            done.set()

    def _measure(self, study: optuna.Study, trial: optuna.Trial, config: BalanceConfig) -> None:
        self.reporter.start(trial.number, config)
        try:
            outcome = self._launch(study, number=trial.number, config=config, heartbeat_trial_id=trial._trial_id,
                                   trial=trial)
        except KeyboardInterrupt as exc:
            partial = getattr(exc, "outcome", None)
            trial.set_user_attr(TrialAttr.STATUS, Status.INTERRUPTED)
            trial.set_user_attr(TrialAttr.REASON, "the tuner was interrupted (Ctrl-C or SIGTERM); the trial's processes were killed")
            trial.set_user_attr(TrialAttr.CONFIG, config.to_dict())
            if partial is not None:
                trial.set_user_attr(TrialAttr.TRIAL_DIR, partial.trial_dir)
            study.tell(trial, state=TrialState.FAIL)
            raise
        with self._lock:  # matplotlib (the trial's chart) and the advisor are not thread-safe
            frozen = self.record(study, trial, config, outcome)
            if self.advisor is not None:
                self.advisor.after_trial(study, frozen)
            self.reporter.finish(frozen, best_trial(study))
            self._check_stop(study, outcome)

    def _reuse(self, study: optuna.Study, trial: optuna.Trial, seen: FrozenTrial) -> None:
        for key, value in seen.user_attrs.items():
            if key not in ("baseline",):
                trial.set_user_attr(key, value)
        trial.set_user_attr(TrialAttr.BASELINE, False)
        trial.set_user_attr(TrialAttr.REUSED_FROM, seen.number)
        self.storage.set_trial_system_attr(trial._trial_id, CONSTRAINTS_KEY,
                                           list(seen.system_attrs.get(CONSTRAINTS_KEY, [1.0])))
        frozen = study.tell(trial, list(seen.values))
        self.reporter.finish(frozen, best_trial(study), reused=True)

    def _check_stop(self, study: optuna.Study, outcome: TrialOutcome) -> None:
        s = self.settings
        if outcome.status == Status.CRASH:
            self._crashes_in_a_row += 1
            if self._crashes_in_a_row >= MAX_CRASHES_IN_A_ROW:
                raise LaunchError(
                    f"{self._crashes_in_a_row} trials in a row crashed (last: {outcome.reason}); "
                    f"stopping. Logs in {outcome.trial_dir}."
                )
            return
        self._crashes_in_a_row = 0
        if outcome.status == Status.ERROR:
            any_ok = any(t.user_attrs.get(TrialAttr.STATUS) == Status.OK for t in study.get_trials(deepcopy=False))
            if s.on_error == "stop" or not any_ok:
                raise TrialScriptError(
                    f"trial {study.trials[-1].number} failed in the training script: {outcome.reason}. "
                    f"Logs in {outcome.trial_dir}. (Use --on-error continue to skip such trials.)",
                    traceback_text=outcome.traceback, rank=outcome.failing_rank,
                )


AUTO_MEASURE_FACTOR = 7 / 3
"""``--measure-s auto``: measure 7/3 of the overhead, so the overhead is <= 30 % of a trial."""
AUTO_MEASURE_MAX_S = 2.0
"""``--measure-s auto`` never measures longer than this (cold trials' overhead is seconds)."""


def per_trial_overhead_s(trials: list[FrozenTrial], *, last: int = 5) -> float | None:
    """Median, over the last ``last`` launched ok trials, of the trial's wall time outside its
    warm-up and measured steps, its compilation and the start of a warm pool (what remains: a cold
    trial's start-up, the script's set-up, the hand-over); None before any."""
    overheads = []
    for t in trials:
        a = t.user_attrs
        if (t.state != TrialState.COMPLETE or a.get(TrialAttr.STATUS) != Status.OK or a.get(TrialAttr.REUSED_FROM) is not None
                or a.get(TrialAttr.WALL_S) is None or a.get(TrialAttr.STEPS_S) is None):
            continue
        overheads.append(max(0.0, float(a[TrialAttr.WALL_S]) - float(a[TrialAttr.STEPS_S]) - float(a.get(TrialAttr.COMPILE_S) or 0.0)
                             - float(a.get(TrialAttr.POOL_START_S) or 0.0)))
    recent = overheads[-last:]
    return statistics.median(recent) if recent else None


class _Stopped(KeyboardInterrupt):
    """Raised in a slot's trial when another slot stopped the study (or the tuner was interrupted):
    the trial is killed and marked interrupted like on Ctrl-C."""


def _make_advisor(*, space: SearchSpace, settings: TuneSettings) -> Any:
    try:
        from autobalance.tuner._advisor import ModelAdvisor
    except ImportError:
        return None
    return ModelAdvisor(space=space, settings=settings)


class _Pruner:
    """Reports each measured step time as an intermediate value; asks to stop a hopeless trial."""

    def __init__(self, *, trial: optuna.Trial, trial_dir: str, best_step_s: float | None, factor: float) -> None:
        self.trial = trial
        self.path = os.path.join(trial_dir, "progress.json")
        self.best = best_step_s
        self.factor = factor
        self.reported = 0
        self.stop = False

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


class _NullReporter:
    def begin(self, settings: TuneSettings, *, already: int) -> None: ...
    def start(self, number: int, config: BalanceConfig | None, *, baseline: bool = False) -> None: ...
    def tick(self, number: int, elapsed: float) -> None: ...
    def note(self, text: str) -> None: ...
    def finish(self, trial: FrozenTrial, best: FrozenTrial | None, *, reused: bool = False,
               predicted: bool = False) -> None: ...
