"""How long a trial runs and what its steps took: warm-up, measured steps, progress for the pruner.

A trial (the launcher sets ``AUTOBALANCE_TRIAL_DIR``) runs ``AUTOBALANCE_WARMUP`` warm-up steps, then
``AUTOBALANCE_STEPS`` measured ones; with ``AUTOBALANCE_MEASURE_S`` it measures for about that many
seconds instead (at least the minimum, at most ``AUTOBALANCE_MAX_STEPS``), every rank agreeing on the
count from the slowest rank's first measured step. Steps spent compiling come first and are timed as
``compile_s`` by the compile part, not here. Once the warm-up is over the garbage collector runs
and everything alive is frozen out of later collections (``gc.freeze``): the measured steps are not
timed with a full collection of the process's heap in one of them (the warm worker unfreezes
after the trial). After each step rank 0 rewrites ``progress.json`` (step
times so far) for the tuner's pruner. Outside a trial the clock only records step times.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from autobalance import _env
from autobalance._files import write_json_atomic
from autobalance.protocol import timed_steps

__all__ = ["PROGRESS_FILE", "StepClock"]

PROGRESS_FILE = "progress.json"


class StepClock:
    """One rank's step timing and the trial's step count."""

    def __init__(self, *, trial_dir: str | None, rank: int, device: torch.device, compile_steps: int,
                 one_step: bool, trial: _env.TrialEnv | None = None) -> None:
        """``trial``: the trial's variables as ``plan()`` read them (None: their defaults)."""
        trial = trial or _env.TrialEnv(trial_dir="")
        self.trial_dir = trial_dir
        self.rank = rank
        self.device = device
        self.warmup_steps = trial.warmup
        self.measured_steps = trial.steps
        self.measure_s = trial.measure_s
        self.max_steps = max(self.measured_steps, trial.max_steps)
        self.target_steps = self.measured_steps
        """Measured steps of this trial: ``measured_steps``, or more once ``measure_s`` sets it."""
        self.compile_steps = compile_steps
        """Optimizer steps spent compiling (timed as compile_s, not as a measured step)."""
        self.one_step = one_step
        """A verification run: its one step is recorded even when compiling, never extended."""
        self.step_times: list[float] = []
        self.step_samples: list[int | None] = []
        """Samples of each timed step over all ranks (fewer than the global batch in a partial step)."""
        self.started_at = time.time()
        self.first_step_at: float | None = None
        self._step_start: float | None = None

    @property
    def in_trial(self) -> bool:
        return self.trial_dir is not None

    def start(self) -> None:
        """The first ``steps()`` call: the clock of the first step starts."""
        if self._step_start is None:
            self._step_start = time.perf_counter()
            self.first_step_at = time.time()

    def lap(self) -> float | None:
        """Seconds since the previous step ended (or the first started); ``None`` before any step."""
        now = time.perf_counter()
        seconds = None if self._step_start is None else now - self._step_start
        self._step_start = now
        return seconds

    def record(self, seconds: float, *, claimed: bool, samples: int | None = None) -> None:
        """A step of ``samples`` took ``seconds``; ``claimed`` when a part timed it otherwise (the
        compile step)."""
        if claimed:
            if self.one_step:  # a verification run has this one step only
                self.step_times.append(seconds)
                self.step_samples.append(samples)
            elif not self.step_times and self.warmup_steps == 0:
                self._before_measured_steps()
            return
        self.step_times.append(seconds)
        self.step_samples.append(samples)
        if len(self.step_times) == self.warmup_steps and not self.one_step:
            self._before_measured_steps()
        if len(self.step_times) == self.warmup_steps + 1 and self.measure_s > 0 and not self.one_step:
            self._set_target_steps(seconds)
            self._step_start = time.perf_counter()  # the agreement is not part of the next step

    def _before_measured_steps(self) -> None:
        """Collect garbage now, and keep what is alive out of the collections during the measured
        steps; not part of the next step's time."""
        if not self.in_trial:
            return
        gc.collect()
        gc.freeze()
        self._step_start = time.perf_counter()

    def done(self, steps_done: int) -> bool:
        """Whether a trial has run its compile, warm-up and measured steps."""
        return self.in_trial and steps_done >= self.compile_steps + self.warmup_steps + self.target_steps

    def measured_enough(self) -> bool:
        """The data ran out during a longer ``measure_s`` measurement, after the minimum: still a result."""
        return self.target_steps > self.measured_steps and \
            len(self.step_times) >= self.warmup_steps + self.measured_steps

    def measured(self) -> list[float]:
        """The measured step times (a trial's warm-up steps left out)."""
        return self.step_times[self.warmup_steps:] if self.in_trial else self.step_times

    def measured_samples(self, global_batch: int) -> list[int]:
        """The measured steps' samples (a step recorded without its count counts as a full one)."""
        samples = self.step_samples[self.warmup_steps:] if self.in_trial else self.step_samples
        return [global_batch if n is None else n for n in samples]

    def timed(self, global_batch: int) -> tuple[list[float], float | None]:
        """The measured steps the step time stands for and their samples per step
        (:func:`~autobalance.protocol.timed_steps`): partial steps (the end of an epoch) do less work
        and are left out when a full step was measured; when every measured step is partial (a
        dataset smaller than one global batch), they are all kept and the samples are their mean."""
        return timed_steps(self.measured(), self.measured_samples(global_batch), global_batch)

    def step_figures(self, global_batch: int) -> tuple[float | None, float | None, int]:
        """(step time: the median of :meth:`timed`, the samples that time stands for, measured
        partial steps)."""
        partial = sum(1 for n in self.measured_samples(global_batch) if n < global_batch)
        times, per_step = self.timed(global_batch)
        if not times:
            return None, None, partial
        return statistics.median(times), per_step, partial

    def write_progress(self, steps_done: int) -> None:
        """Step times so far, for the tuner's pruner (rank 0 only; the ranks step in lockstep)."""
        if self.trial_dir is None or self.rank != 0:
            return
        write_json_atomic(os.path.join(self.trial_dir, PROGRESS_FILE), {
            "steps_done": steps_done, "warmup_steps": self.warmup_steps, "step_times_s": self.step_times,
        }, fsync=False)

    def _set_target_steps(self, first_measured_s: float) -> None:
        """Measure for about ``measure_s``: every rank takes the slowest rank's first measured step
        (one tiny all-reduce, at the same point on every rank), so all stop after the same step."""
        slowest = first_measured_s
        if self.in_trial and dist.is_available() and dist.is_initialized():
            on = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
            t = torch.tensor([first_measured_s], dtype=torch.float64, device=on)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            slowest = float(t.item())
        wanted = math.ceil(self.measure_s / max(slowest, 1e-6))
        self.target_steps = max(self.measured_steps, min(self.max_steps, wanted))
