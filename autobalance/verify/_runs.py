"""Launching the one-step verification runs and reading what they saved.

Every run is one optimizer step of the training script as a verification trial (see
:mod:`autobalance.runtime._verify`): the same starting weights (saved by the first run, loaded by
the others), the same global batch, no memory cap. :class:`SharedRuns` keeps what the verifications
of several configurations of one script share: one warm pool, the starting weights, and each run that
does not depend on the configuration (the baselines and the floor), run once.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autobalance import _env
from autobalance._config import BalanceConfig, describe_config
from autobalance.launcher import TrialLaunch, TrialOutcome, WarmPool, cold_reason, run_trial
from autobalance.protocol import Status

__all__ = ["RunFailed", "Runner", "SharedRuns", "StepResult", "VerifyTarget"]

INIT_FILE = "verify-init.pt"
STEP_FILE = "verify-step.pt"
STEP_JSON = "verify-step.json"


@dataclass(kw_only=True)
class VerifyTarget:
    """Where and how the verification runs are launched (one node)."""

    script: str
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: int
    device: str = "cpu"
    torchrun_args: list[str] = field(default_factory=list)
    timeout_s: float = 300.0
    work_dir: str
    """Directory for the runs (created)."""
    cold: bool = False
    """One torchrun per run instead of a warm worker pool."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the runs (e.g. the study's Inductor cache)."""


@dataclass(kw_only=True)
class StepResult:
    name: str
    config: dict[str, Any]
    trial_dir: str
    grads: dict[str, Any]
    params: dict[str, Any]
    buffers: dict[str, Any]
    samples: list[int]
    info: dict[str, Any]

    @property
    def overflow_skips(self) -> int:
        return int(self.info.get("overflow_skips") or 0)


class RunFailed(Exception):
    def __init__(self, name: str, text: str) -> None:
        super().__init__(f"the {name} run failed: {text}")
        self.name = name


class SharedRuns:
    """What the verifications of several configurations of one script share (``tune`` verifying its
    next-best candidates): one warm pool, the starting weights, and the runs that do not depend on
    the configuration (``baseline``, ``baseline-fp32``, ``floor``, ``baseline-<dtype>``,
    ``baseline-small``), each run once. Every successful run is kept by what it computes (its
    configuration, dropout, global batch and sample order, not its name), so a run another candidate
    or the baseline already made is not launched again: two compiled candidates of one split share
    their eager fp32 run, and a candidate whose fp32 arrangement is the script's own reuses the
    baseline's. The owner closes it; a verifier given one leaves it open.

    ``pool``: the study's warm pool, still running after its trials (``tune``): the runs use its
    workers when it :meth:`~autobalance.launcher.WarmPool.serves` them (no second start-up: torch,
    the process group, on a GPU the CUDA context), else a pool of their own. Whoever kept it closes
    it; :meth:`close` closes only a pool started here."""

    def __init__(self, *, pool: WarmPool | None = None) -> None:
        self.offered = pool
        self.pool: WarmPool | None = None
        self.init_path: str | None = None
        self.init: dict[str, Any] = {}
        self.baselines: dict[str, StepResult] = {}
        """Successful runs by what they compute (:func:`run_key`); a script-defaults run also under
        its resolved configuration."""

    def pool_for(self, launch: TrialLaunch, *, pool_dir: str, note: Callable[[str], None]) -> WarmPool:
        """The pool the verification runs use (see the class doc), chosen at the first run."""
        if self.pool is None:
            if self.offered is not None and self.offered.serves(launch):
                self.pool = self.offered
                note("verify: the runs use the study's warm workers (no new start-up)")
            else:
                self.pool = WarmPool(template=launch, pool_dir=pool_dir)
        return self.pool

    def close(self) -> None:
        if self.pool is not None and self.pool is not self.offered:
            self.pool.close()
        self.pool = None

    def __enter__(self) -> SharedRuns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_key(config: BalanceConfig | None, *, dropout: str, global_batch: int, reverse: bool,
            eager_blocks: list[list[int]] | None = None) -> str:
    """What a verification run computes: the configuration (None: the script's defaults), dropout,
    global batch, sample order and the blocks a regional compile leaves eager (``eager_blocks``).
    Two runs with one key take the same step."""
    key = f"{None if config is None else config.to_json()}|{dropout}|{global_batch}|{reverse}"
    return key if eager_blocks is None else f"{key}|eager={eager_blocks}"


class Runner:
    """Runs (or reuses) the one-step runs of one verification."""

    def __init__(self, target: VerifyTarget, *, shared: SharedRuns, allow_batch_dependent: bool,
                 note: Callable[[str], None]) -> None:
        self.target = target
        self.shared = shared
        self.allow_batch_dependent = allow_batch_dependent
        self.note = note
        self.runs: dict[str, str] = {}
        """Run name -> its directory."""
        self.results: list[StepResult] = []
        self.seconds: dict[str, dict[str, float]] = {}
        """Run name -> where its wall time went: ``run`` (launch to exit), ``read`` (loading its saved
        tensors here) and, from the run's own clock, ``init`` (loading the starting weights) and
        ``save`` (writing the step)."""

    def run(self, name: str, config: BalanceConfig | None, *, dropout: str, global_batch: int,
            reverse: bool = False, eager_blocks: list[list[int]] | None = None) -> StepResult:
        """One run, or the earlier one that took the same step (:func:`run_key`: kept in
        :class:`SharedRuns` for this verification and the next candidate's); ``reverse``: each
        micro-batch's samples in reverse order (the floor); ``eager_blocks``: per rank, blocks a
        regional compile leaves eager although not checkpointed (the rng-replay reference)."""
        key = run_key(config, dropout=dropout, global_batch=global_batch, reverse=reverse, eager_blocks=eager_blocks)
        done = self.shared.baselines.get(key)
        if done is not None:  # the same step, already run (by this verification or an earlier candidate's)
            self.runs[name] = done.trial_dir
            self.results.append(done)
            self.note(f"verify: {name} run: the same step as the {done.name} run, reused ({done.trial_dir})")
            return done
        result = self._launch_run(name, config, dropout=dropout, global_batch=global_batch, reverse=reverse,
                                  eager_blocks=eager_blocks)
        self.shared.baselines[key] = result
        if config is None and result.config:  # the script's own configuration, by its resolved name too
            resolved = run_key(BalanceConfig.from_dict(result.config), dropout=dropout, global_batch=global_batch,
                               reverse=reverse)
            self.shared.baselines.setdefault(resolved, result)
        return result

    def _launch(self, launch: TrialLaunch) -> TrialOutcome:
        t = self.target
        if not t.cold and cold_reason(t.script) is None:
            pool = self.shared.pool_for(launch, pool_dir=os.path.join(t.work_dir, "pool"), note=self.note)
            return pool.run(launch)
        return run_trial(launch)

    def _launch_run(self, name: str, config: BalanceConfig | None, *, dropout: str, global_batch: int,
                    reverse: bool, eager_blocks: list[list[int]] | None = None) -> StepResult:
        t = self.target
        trial_dir = os.path.join(t.work_dir, name)
        os.makedirs(trial_dir, exist_ok=True)
        spec: dict[str, Any] = {"dropout": dropout, "init": self.shared.init_path,
                                "allow_batch_dependent": self.allow_batch_dependent, "reverse": reverse}
        if eager_blocks is not None:
            spec["eager_blocks"] = eager_blocks
        with open(os.path.join(trial_dir, _env.VERIFY_FILE), "w") as fh:
            json.dump(spec, fh)
        self.runs[name] = trial_dir
        what = "script defaults" if config is None else describe_config(config)
        self.note(f"verify: {name} run ({what}, dropout {dropout}{', samples reversed' if reverse else ''})")
        launch = TrialLaunch(
            script=t.script, script_args=list(t.script_args), nproc_per_node=t.nproc_per_node,
            torchrun_args=list(t.torchrun_args), device=t.device,
            config_json=None if config is None else config.to_json(),
            global_batch=global_batch if config is None else None, steps=1, warmup=0, trial_dir=trial_dir,
            timeout_s=t.timeout_s, pg_timeout_s=int(max(30, min(300, t.timeout_s / 2))), env=dict(t.env),
        )
        started = time.monotonic()
        outcome = self._launch(launch)
        ran = time.monotonic() - started
        step_file = os.path.join(trial_dir, STEP_FILE)
        if outcome.status != Status.OK or not os.path.isfile(step_file):
            text = f"{outcome.status}: {outcome.reason}" if outcome.status != Status.OK else "no step was saved"
            raise RunFailed(name, f"{text} (logs in {trial_dir})")
        started = time.monotonic()
        result = self._load(name, trial_dir)
        read = time.monotonic() - started
        self.seconds[name] = {"run": round(ran, 2), "read": round(read, 2),
                              **{k: round(float(result.info[k]), 2) for k in ("init", "save")
                                 if isinstance(result.info.get(k), (int, float))}}
        self.note(f"verify: {name} run took {ran:.1f} s (" + ", ".join(
            f"{k} {v:.1f} s" for k, v in self.seconds[name].items() if k != "run") + ")")
        self.results.append(result)
        return result

    def _load(self, name: str, trial_dir: str) -> StepResult:
        import torch

        saved = torch.load(os.path.join(trial_dir, STEP_FILE), map_location="cpu", weights_only=True)
        with open(os.path.join(trial_dir, STEP_JSON)) as fh:
            info = json.load(fh)
        samples = sorted(int(i) for rank in info["micro_batches"] for mb in rank for i in mb)
        if self.shared.init_path is None:
            self.shared.init_path = os.path.join(trial_dir, INIT_FILE)
            self.shared.init = torch.load(self.shared.init_path, map_location="cpu", weights_only=True)
        return StepResult(name=name, config=info["config"], trial_dir=trial_dir, grads=dict(saved["grads"]),
                          params=dict(saved["params"]), buffers=dict(saved.get("buffers") or {}), samples=samples,
                          info=info)
