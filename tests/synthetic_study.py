"""A synthetic study written through the tuner's own recording (no torchrun): fast, and shaped like
the GPU study of issue 17 (one trial over the memory cap is faster than the best).

Each trial is a ``TrialOutcome`` with per-rank reports as the launcher reads them from the ranks'
JSON files; the tuner records it exactly as after a real run (user attributes, constraints,
objective values, the per-trial chart artifact).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from autobalance._config import BalanceConfig
from autobalance.launcher import TrialOutcome
from autobalance.protocol import StudyAttr
from autobalance.tuner import SearchSpace, Tuner, TuneSettings
from autobalance.tuner._reporter import write_notes
from autobalance.tuner._study import open_study

GIB = 2**30
REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "examples" / "gpt" / "train.py")
CAP_GIB = 16.0
HEADROOM = 0.05
NAME = "synthetic"


@dataclass(kw_only=True)
class Spec:
    """One synthetic trial: the configuration and what each rank reported."""

    status: str  # ok, oom, predicted_oom
    micro: list[int] = field(default_factory=list)
    """Equal micro-batches per rank (left empty when ``samples`` is given)."""
    samples: list[int] | None = None
    """Any split: per-rank samples per optimizer step in ``acc`` micro-steps that differ by one."""
    acc: int
    dtype: str = "bf16"
    compile: str = "off"
    budget: float | None = None
    ckpt: int = 0
    peaks_gib: list[float | None]
    step_ms: float | None = None
    compile_s: float | None = None
    failing_rank: int | None = None
    dominated_by: int | None = None
    busy_ms: list[float] | None = None
    """Each rank's busy time per step (its report's ``busy_time_s``); None: a study from before it was measured."""
    wait_ms: list[float] | None = None
    optimizer_mib: list[float] | None = None
    """Each rank's optimizer state (its report's ``optimizer.state_bytes``); None: not reported."""
    optimizer_shares: list[float] | None = None
    """Set: the configuration shards the optimizer state (zero1) with these shares."""


# trial 0 is the script's own configuration (the baseline); #3 is over the cap and faster than #2, the best
SPECS_2 = [
    Spec(status="oom", micro=[8, 8], acc=4, dtype="fp32", peaks_gib=[15.9, 14.2], failing_rank=0),
    Spec(status="ok", micro=[8, 8], acc=4, peaks_gib=[12.1, 11.0], step_ms=205.0),
    Spec(status="ok", micro=[16, 16], acc=2, compile="default", budget=0.4, peaks_gib=[14.0, 13.2], step_ms=139.0,
         compile_s=31.5),
    Spec(status="ok", micro=[16, 16], acc=2, compile="default", budget=0.8, peaks_gib=[16.65, 15.1], step_ms=128.0,
         compile_s=36.2),
    Spec(status="ok", micro=[16, 16], acc=2, dtype="fp16", compile="default", budget=0.5, peaks_gib=[14.6, 14.1],
         step_ms=151.0, compile_s=2.1),
    Spec(status="predicted_oom", micro=[16, 16], acc=2, compile="default", budget=0.9, peaks_gib=[16.65, None],
         dominated_by=3),
    Spec(status="oom", micro=[32, 32], acc=1, peaks_gib=[12.5, 15.6], failing_rank=1),
    Spec(status="ok", micro=[12, 20], acc=2, ckpt=4, peaks_gib=[13.9, 13.7], step_ms=171.0),
]
SPECS_1 = [
    Spec(status="ok", micro=[8], acc=4, dtype="fp32", peaks_gib=[11.0], step_ms=300.0),
    Spec(status="ok", micro=[16], acc=2, peaks_gib=[12.0], step_ms=180.0),
    Spec(status="ok", micro=[32], acc=1, peaks_gib=[16.2], step_ms=150.0),
    Spec(status="oom", micro=[32], acc=1, dtype="fp32", peaks_gib=[15.8], failing_rank=0),
]
BEST_2 = 2
OVER_CAP_FASTER_2 = 3
BEST_1 = 1


def _config(spec: Spec, layers: int) -> BalanceConfig:
    world = len(spec.samples or spec.micro)
    rest: dict[str, Any] = dict(checkpoint=[list(range(spec.ckpt)) for _ in range(world)], dtype=spec.dtype,
                                compile=spec.compile,
                                activation_budget=None if spec.budget is None else [spec.budget] * world)
    if spec.optimizer_shares is not None:
        rest.update(optimizer_sharding="zero1", optimizer_shares=list(spec.optimizer_shares))
    if spec.samples is not None:
        return BalanceConfig.any_split(rank_samples=list(spec.samples), accumulation=spec.acc, **rest)
    return BalanceConfig(micro_batches=list(spec.micro), accumulation=spec.acc, global_batch=sum(spec.micro) * spec.acc,
                         **rest)


def _report(spec: Spec, rank: int, config: BalanceConfig) -> dict[str, Any]:
    peak = spec.peaks_gib[rank]
    failed = spec.status == "oom" and rank == spec.failing_rank
    rep: dict[str, Any] = {
        "status": "oom" if failed else ("ok" if spec.status == "ok" else "peer_failed"), "rank": rank,
        "world_size": config.world_size,
        "memory": {} if peak is None else {"peak_device": peak * GIB, "peak_allocated": 0.9 * peak * GIB,
                                           "peak_reserved": 0.95 * peak * GIB, "outside_pytorch": 0.05 * peak * GIB},
        "device": {"type": "cuda", "name": "synthetic GPU", "capacity_bytes": 141 * GIB, "cap_bytes": CAP_GIB * GIB},
        "config": {"global_batch": config.global_batch},
        "timing": {"startup_s": 3.0},
    }
    if spec.status == "ok":
        rep["step_time_s"] = spec.step_ms / 1000.0  # type: ignore[operator]
        rep["timing"]["steps_s"] = 8 * spec.step_ms / 1000.0  # type: ignore[operator]
        rep["measured_steps"] = 5
    if spec.busy_ms is not None and spec.status == "ok":
        rep["busy_time_s"] = spec.busy_ms[rank] / 1000.0
        rep["allreduce_wait_s"] = (spec.wait_ms or [0.0] * len(spec.busy_ms))[rank] / 1000.0
    if spec.optimizer_mib is not None:
        rep["optimizer"] = {"sharding": config.optimizer_sharding, "wrapped": True,
                            "state_bytes": int(spec.optimizer_mib[rank] * 2**20)}
    if spec.compile != "off":
        rep["compile"] = {"mode": spec.compile, "cache": {"fx_graph_hits": 1 if (spec.compile_s or 0) < 5 else 0,
                                                          "fx_graph_misses": 0 if (spec.compile_s or 0) < 5 else 1}}
        rep["activation_budget"] = spec.budget
        if spec.compile_s is not None:
            rep["timing"]["compile_s"] = spec.compile_s
    return rep


def build_study(db: Path, *, world_size: int = 2, name: str = NAME, specs: list[Spec] | None = None,
                verified: int | None = None, multi_objective: bool = False) -> optuna.Study:
    """Write the synthetic study into ``sqlite:///db`` (its chart artifacts beside it) and return it."""
    specs = specs if specs is not None else (SPECS_2 if world_size == 2 else SPECS_1)
    url = f"sqlite:///{db}"
    settings = TuneSettings(script=SCRIPT, storage=url, study_name=name, nproc_per_node=world_size, device="cuda",
                            memory_cap_gib=[CAP_GIB] * world_size, headroom=HEADROOM, compile="search",
                            runs_dir=str(db.parent / "runs"), dtypes=["fp32", "bf16", "fp16"],
                            multi_objective=multi_objective)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # heartbeat outside optimize(), experimental APIs
        return _build(db, url, settings, specs, world_size, name, verified)


def _build(db: Path, url: str, settings: TuneSettings, specs: list[Spec], world_size: int, name: str,
           verified: int | None) -> optuna.Study:
    tuner = Tuner(settings=settings)
    study = open_study(settings, tuner.storage)
    layers = 8
    any_split = any(s.samples for s in specs)
    space = SearchSpace.build(world_size=world_size, global_batch=_config(specs[0], layers).global_batch,
                              num_layers=layers, dtypes=["fp32", "bf16", "fp16"], max_accumulation=8 if any_split else 4,
                              compile_modes=["off", "default"], any_split=any_split)
    study.set_user_attr(StudyAttr.SPACE, space.to_dict())
    study.set_user_attr(StudyAttr.CAPACITY, [CAP_GIB * GIB] * world_size)
    study.set_user_attr(StudyAttr.DEVICE, {"type": "cuda", "name": "synthetic GPU", "capacity_bytes": 141 * GIB})
    for number, spec in enumerate(specs):
        config = _config(spec, layers)
        params = space.params_from_config(config)
        study.enqueue_trial(params, user_attrs={"baseline": number == 0}, skip_if_exists=False)
        trial = study.ask()
        space.suggest(trial)  # the enqueued parameters, as the tuner registers them
        if spec.status == "predicted_oom":
            from autobalance.tuner import TrialFigures

            peaks = [None if p is None else p * GIB for p in spec.peaks_gib]
            cap = [CAP_GIB * GIB] * world_size
            figures = TrialFigures(status="predicted_oom", peak_device=peaks, peak_allocated=[None] * world_size,
                                   peak_reserved=[None] * world_size, outside_pytorch=[None] * world_size,
                                   capacity=cap, step_time_s=None, samples_per_s=None, startup_s=None)
            attrs = {**figures.user_attrs(HEADROOM), "status": "predicted_oom", "predicted": True,
                     "predicted_by": "dominance", "dominated_by": spec.dominated_by, "baseline": False,
                     "config": config.to_dict(),
                     "reason": f"not launched: trial {spec.dominated_by} exceeded rank 0's usable memory with less "
                               "recomputation"}
            tuner.recorder.predicted(study, trial, config, (figures, attrs))  # as the tuner records a prediction
            continue
        reports = {r: _report(spec, r, config) for r in range(world_size)}
        reason = ("" if spec.status == "ok" else
                  f"rank {spec.failing_rank} ran out of memory (torch.OutOfMemoryError)")
        outcome = TrialOutcome(status=spec.status, reason=reason or "all ranks finished", reports=reports,
                               returncode=0 if spec.status == "ok" else 1, wall_s=12.0 + (spec.compile_s or 0.0),
                               failing_rank=spec.failing_rank, trial_dir=str(db.parent / "runs" / f"trial{number}"))
        tuner.recorder.record(study, trial, config, outcome, baseline=number == 0)
        if number == 0:
            study.set_user_attr(StudyAttr.BASELINE, trial.number)
    if verified is not None:
        study.set_user_attr(f"{StudyAttr.VERIFY_PREFIX}{verified}", {
            "passed": True, "reason": "losses match the baseline's within 1e-3 after 3 steps", "skipped": False,
            "wall_s": 41.0, "checks": [], "runs": {}})
        write_notes(study)  # as the tuner does after verifying
    tuner.close()
    return optuna.load_study(study_name=name, storage=url)


if __name__ == "__main__":  # python -m tests.synthetic_study OUT.db : a study to look at
    import sys

    out = Path(sys.argv[1]).resolve()
    os.makedirs(out.parent, exist_ok=True)
    build_study(out, verified=BEST_2)
    print(f"sqlite:///{out}")
