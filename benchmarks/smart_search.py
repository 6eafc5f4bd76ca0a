"""Model-guided search versus plain TPE versus random on the GPT benchmark scenario.

1. Grid: every configuration of a coarse grid over the search space, measured uncapped in one
   warm worker pool (no OOM can hang a rank) and judged against the cap afterwards.
2. Studies: for each strategy and seed, a 30-trial study (``--cap-mode judge``, warm trials).
Reported: best feasible step time with spread <= 0.5 GiB relative to the grid's best, trials
until within 5 % of the study's final best, tuning wall time, memory-model held-out error.

    python benchmarks/smart_search.py --cap-gib 20 [--trials 30] [--seeds 0,1,2] [--phase grid,studies]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autobalance import BalanceConfig
from autobalance.launcher import TrialLaunch, WarmPool
from benchmarks.common import GPT, GPT_ARGS, write_result

GIB = 2**30
DEVICE, SCRIPT_ARGS, LAYERS = "cuda", GPT_ARGS, 16
SPREAD_LIMIT_GIB = 0.5


def grid_configs(*, layers: int, dtypes: list[str]) -> list[BalanceConfig]:
    out = []
    for dtype, acc in itertools.product(dtypes, (1, 2, 4)):
        total = 16 // acc
        for r0 in sorted({total // 2 - total // 4, total // 2 - total // 8, total // 2 - 1, total // 2} - {0}):
            for c0, c1 in itertools.product((0, layers // 4, layers // 2, layers), (0, layers // 4)):
                out.append(BalanceConfig(micro_batches=[r0, total - r0], accumulation=acc, global_batch=16,
                                         checkpoint=[list(range(c0)), list(range(c1))], dtype=dtype,
                                         gradient_as_bucket_view=True))
    return out


def judge(peaks: list[float], usable: float) -> bool:
    return max(peaks) <= usable


def run_grid(args: argparse.Namespace, pool: WarmPool, root: str, usable: float) -> dict[str, Any]:
    rows = []
    t0 = time.monotonic()
    configs = grid_configs(layers=LAYERS, dtypes=args.grid_dtypes.split(","))
    for i, cfg in enumerate(configs):
        launch = TrialLaunch(script=GPT, script_args=SCRIPT_ARGS, nproc_per_node=2, device=DEVICE,
                             trial_dir=f"{root}/grid{i}", config_json=cfg.to_json(), steps=3, warmup=1, timeout_s=120)
        o = pool.run(launch)
        peaks = [o.reports[r].memory.peak_device / GIB for r in sorted(o.reports)] if o.status == "ok" else []
        step = max(o.reports[r].step_time_s for r in o.reports) * 1000 if o.status == "ok" else None
        rows.append({"config": cfg.to_dict(), "status": o.status, "peaks_gib": peaks, "step_ms": step,
                     "feasible": bool(peaks) and judge(peaks, usable),
                     "spread_gib": (max(peaks) - min(peaks)) if peaks else None, "wall_s": o.wall_s})
        print(json.dumps(rows[-1]), flush=True)
    ok = [r for r in rows if r["feasible"] and r["spread_gib"] <= SPREAD_LIMIT_GIB]
    best = min(ok, key=lambda r: r["step_ms"]) if ok else None
    return {"rows": rows, "best": best, "wall_s": time.monotonic() - t0, "configs": len(configs)}


def best_so_far(trials: list[Any], usable: float) -> list[float | None]:
    """Per trial, the best step time so far among feasible trials with spread <= 0.5 GiB."""
    best: float | None = None
    out: list[float | None] = []
    for t in trials:
        a = t.user_attrs
        if a.get("status") == "ok" and a.get("feasible") and (a.get("spread_gib") or 9) <= SPREAD_LIMIT_GIB:
            step = a["step_time_ms"]
            best = step if best is None else min(best, step)
        out.append(best)
    return out


def run_studies(args: argparse.Namespace, pool: WarmPool, root: str, usable: float) -> list[dict[str, Any]]:
    import optuna

    from autobalance.tuner import Tuner, TuneSettings

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    results = []
    for strategy, seed in itertools.product(args.strategies.split(","), [int(s) for s in args.seeds.split(",")]):
        name = f"{strategy}-{seed}"
        settings = TuneSettings(
            script=GPT, script_args=SCRIPT_ARGS, trials=args.trials, nproc_per_node=2, device=DEVICE,
            storage=f"sqlite:///{root}/studies.db", study_name=name, memory_cap_gib=[args.cap_gib],
            cap_mode="judge", compile="off", max_spread_gib=SPREAD_LIMIT_GIB if args.spread_constraint else None, strategy="model" if strategy == "model" else "optuna",
            sampler="tpe" if strategy in ("model", "tpe") else "random", seed=seed, steps=3, warmup=1,
            trial_timeout=120, runs_dir=f"{root}/runs",
        )
        t0 = time.monotonic()
        tuner = Tuner(settings=settings, pool=pool)
        result = tuner.run()
        wall = time.monotonic() - t0
        study = optuna.load_study(study_name=name, storage=settings.storage)
        trials = [t for t in study.get_trials() if t.user_attrs.get("status") != "predicted_oom"]
        curve = best_so_far(trials, usable)
        final = curve[-1] if curve else None
        within = next((i + 1 for i, b in enumerate(curve) if b is not None and final is not None and b <= 1.05 * final), None)
        statuses: dict[str, int] = {}
        for t in study.get_trials():
            statuses[t.user_attrs.get("status", "?")] = statuses.get(t.user_attrs.get("status", "?"), 0) + 1
        best = result.best
        row = {"strategy": strategy, "seed": seed, "wall_s": wall, "trials_launched": result.trials_run,
               "best_step_ms_spread_ok": final, "trials_to_within_5pct": within, "curve_ms": curve,
               "statuses": statuses,
               "objective_best": None if best is None else {"number": best.number, "config": best.user_attrs["config"],
                                                            "step_ms": best.user_attrs["step_time_ms"],
                                                            "spread_gib": best.user_attrs["spread_gib"],
                                                            "peaks": best.user_attrs["peak_device_gib"]},
               "memory_model_holdout_error": study.user_attrs.get("autobalance:memory_model_holdout_error"),
               "pool_starts_so_far": pool.starts}
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cap-gib", type=float, default=20.0)
    p.add_argument("--headroom", type=float, default=0.05)
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--strategies", default="model,tpe,random")
    p.add_argument("--grid-dtypes", default="bf16,fp16")
    p.add_argument("--phase", default="grid,studies")
    p.add_argument("--small", action="store_true", help="CPU smoke run with the tiny default GPT")
    p.add_argument("--spread-constraint", action="store_true", help="studies use --max-spread-gib 0.5")
    args = p.parse_args()
    global DEVICE, SCRIPT_ARGS, LAYERS
    if args.small:
        DEVICE, SCRIPT_ARGS, LAYERS = "cpu", [], 4
    usable = args.cap_gib * (1 - args.headroom)
    root = tempfile.mkdtemp(prefix="ab-smart-")
    template = TrialLaunch(script=GPT, script_args=SCRIPT_ARGS, nproc_per_node=2, device=DEVICE, trial_dir=root,
                           steps=3, warmup=1, timeout_s=120)
    pool = WarmPool(template=template, pool_dir=f"{root}/pool")
    out: dict[str, Any] = {"cap_gib": args.cap_gib, "headroom": args.headroom, "usable_gib": usable,
                           "script_args": SCRIPT_ARGS, "trials": args.trials}
    try:
        if "grid" in args.phase:
            out["grid"] = run_grid(args, pool, root, usable)
            write_result("smart_search_grid", out)
        if "studies" in args.phase:
            out["studies"] = run_studies(args, pool, root, usable)
    finally:
        pool.close()
    out["pool_starts"] = pool.starts
    write_result("smart_search", out)


if __name__ == "__main__":
    main()
