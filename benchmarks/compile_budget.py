"""torch.compile with a per-rank activation-memory budget versus eager, on the GPT benchmark scenario.

Phases (``--phase``, comma-separated):

1. ``grid``: eager configurations (split x per-rank checkpointing) and compiled ones (split x per-rank
   budget), uncapped in one warm pool with the study's kind of Inductor cache, judged against
   ``--cap-gib`` afterwards. Every compiled configuration runs twice: the second run compiles from
   the persistent cache (``compile_s`` cold vs warm, FX graph cache hits). Reports the best eager
   and the best compiled step time with spread <= 0.5 GiB within the cap, and their ratio
   (goal: >= 1.25x).
2. ``verify``: ``autobalance verify``'s check of the best compiled configuration and of a low-budget
   one, on the GPT with dropout 0.1 (the partitioner has recomputed dropout with new random numbers
   in some PyTorch versions: on 2.13 CPU a budget of 0.05 gives wrong gradients).
3. ``study``: ``autobalance tune --compile search`` (``--trials``, cap-mode judge, warm workers,
   per-study Inductor cache, verification before saving): total wall time (goal: <= 300 s for 30
   trials), compile time in total, best compiled vs best eager trial of the same study.

    python benchmarks/compile_budget.py --cap-gib 20            # on nvidia-h200-x2
    python benchmarks/compile_budget.py --small --phase grid    # CPU smoke run (tiny GPT, seconds per config)
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
SPREAD_LIMIT_GIB = 0.5
DEVICE, SCRIPT_ARGS, LAYERS, DTYPE = "cuda", GPT_ARGS, 16, "bf16"


def eager_configs() -> list[BalanceConfig]:
    out = []
    for r0 in (5, 6, 7, 8):
        for c0, c1 in itertools.product((0, LAYERS // 4, LAYERS // 2, LAYERS), (0, LAYERS // 4)):
            out.append(BalanceConfig(micro_batches=[r0, 16 - r0], global_batch=16, dtype=DTYPE, gradient_as_bucket_view=True,
                                     checkpoint=[list(range(c0)), list(range(c1))]))
    return out


def compiled_configs() -> list[BalanceConfig]:
    out = []
    for r0 in (6, 7, 8):
        for b0, b1 in ((1.0, 1.0), (0.8, 0.8), (0.6, 0.8), (0.45, 0.8), (0.3, 0.6)):
            out.append(BalanceConfig(micro_batches=[r0, 16 - r0], global_batch=16, dtype=DTYPE, gradient_as_bucket_view=True,
                                     compile="default", activation_budget=[b0, b1]))
    return out


def measure(pool: WarmPool, root: str, name: str, cfg: BalanceConfig, usable: float) -> dict[str, Any]:
    launch = TrialLaunch(script=GPT, script_args=SCRIPT_ARGS, nproc_per_node=2, device=DEVICE, trial_dir=f"{root}/{name}",
                         config_json=cfg.to_json(), steps=5, warmup=2, timeout_s=600)
    o = pool.run(launch)
    row: dict[str, Any] = {"name": name, "config": cfg.to_dict(), "status": o.status, "reason": o.reason, "wall_s": o.wall_s}
    if o.status == "ok":
        peaks = [o.reports[r].memory.peak_device / GIB for r in sorted(o.reports)]
        row.update(peaks_gib=peaks, spread_gib=max(peaks) - min(peaks), feasible=max(peaks) <= usable,
                   step_ms=max(o.reports[r].step_time_s for r in o.reports) * 1000,
                   compile_s=max((o.reports[r].timing.compile_s or 0) for r in o.reports),
                   budgets_used=[o.reports[r].activation_budget for r in sorted(o.reports)],
                   cache=[(o.reports[r].compile or {}).get("cache") for r in sorted(o.reports)])
    print(json.dumps(row, default=str), flush=True)
    return row


def best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [r for r in rows if r.get("feasible") and r["spread_gib"] <= SPREAD_LIMIT_GIB]
    return min(ok, key=lambda r: r["step_ms"]) if ok else None


def run_grid(pool: WarmPool, root: str, usable: float) -> dict[str, Any]:
    t0 = time.monotonic()
    eager = [measure(pool, root, f"eager{i}", c, usable) for i, c in enumerate(eager_configs())]
    cold, warm = [], []
    for i, c in enumerate(compiled_configs()):
        cold.append(measure(pool, root, f"compiled{i}", c, usable))
        warm.append(measure(pool, root, f"compiled{i}-again", c, usable))  # from the persistent cache
    be, bc = best(eager), best(warm)
    pairs = [(a["compile_s"], b["compile_s"]) for a, b in zip(cold, warm, strict=True) if a.get("compile_s") and b.get("compile_s")]
    return {"eager": eager, "compiled_cold_cache": cold, "compiled_warm_cache": warm, "best_eager": be, "best_compiled": bc,
            "speedup_compiled_vs_eager": (be["step_ms"] / bc["step_ms"]) if be and bc else None,
            "compile_s_median_cold": sorted(p[0] for p in pairs)[len(pairs) // 2] if pairs else None,
            "compile_s_median_warm": sorted(p[1] for p in pairs)[len(pairs) // 2] if pairs else None,
            "wall_s": time.monotonic() - t0}


def run_verify(root: str, grid: dict[str, Any] | None) -> list[dict[str, Any]]:
    from autobalance.tuner._verify import Verifier, VerifyTarget

    chosen = [BalanceConfig.from_dict(grid["best_compiled"]["config"])] if grid and grid.get("best_compiled") else []
    chosen.append(BalanceConfig(micro_batches=[7, 9], global_batch=16, dtype=DTYPE, compile="default",
                                activation_budget=[0.05, 0.3]))
    args = [a for a in SCRIPT_ARGS]
    if "--dropout" in args:
        args[args.index("--dropout") + 1] = "0.1"
    out = []
    for i, cfg in enumerate(chosen):
        target = VerifyTarget(script=GPT, script_args=args, nproc_per_node=2, device=DEVICE, timeout_s=900,
                              work_dir=f"{root}/verify{i}", env={"TORCHINDUCTOR_CACHE_DIR": f"{root}/inductor-cache"})
        verdict = Verifier(target, note=print).verify(cfg)
        out.append({"config": cfg.to_dict(), **verdict.to_dict()})
        print(json.dumps(out[-1], default=str), flush=True)
    return out


def run_study(args: argparse.Namespace, root: str) -> dict[str, Any]:
    import optuna

    from autobalance.cli._common import quiet_optuna
    from autobalance.tuner import Tuner, TuneSettings
    from autobalance.tuner._verify import verify_for_saving

    quiet_optuna()
    settings = TuneSettings(script=GPT, script_args=SCRIPT_ARGS, trials=args.trials, nproc_per_node=2, device=DEVICE,
                            storage=f"sqlite:///{root}/study.db", study_name="compile", memory_cap_gib=[args.cap_gib],
                            cap_mode="judge", max_spread_gib=SPREAD_LIMIT_GIB, compile="search", steps=3, warmup=1,
                            trial_timeout=300, runs_dir=f"{root}/runs", seed=0)
    t0 = time.monotonic()
    result = Tuner(settings=settings).run()
    tune_s = time.monotonic() - t0
    study = optuna.load_study(study_name="compile", storage=settings.storage)
    saved = verify_for_saving(settings=settings, study=study, best=result.best, baseline=result.baseline,
                              notes=result.notes, note=print) if result.best is not None else None
    wall = time.monotonic() - t0
    ok = [t for t in study.get_trials() if t.user_attrs.get("status") == "ok" and t.user_attrs.get("feasible")]

    def fastest(compiled: bool) -> dict[str, Any] | None:
        rows = [t for t in ok if (t.user_attrs["config"].get("compile", "off") != "off") == compiled]
        t = min(rows, key=lambda t: t.user_attrs["step_time_ms"]) if rows else None
        return None if t is None else {"number": t.number, "config": t.user_attrs["config"],
                                       "step_ms": t.user_attrs["step_time_ms"], "spread_gib": t.user_attrs["spread_gib"],
                                       "compile_s": t.user_attrs.get("compile_s")}

    be, bc = fastest(False), fastest(True)
    return {"trials": args.trials, "tune_wall_s": tune_s, "wall_s_with_verify": wall, "notes": result.notes,
            "compile_total_s": study.user_attrs.get("autobalance:compile_total_s"),
            "best_eager": be, "best_compiled": bc,
            "speedup_compiled_vs_eager": (be["step_ms"] / bc["step_ms"]) if be and bc else None,
            "saved_trial": None if saved is None else saved.number,
            "objective_best": None if result.best is None else result.best.user_attrs["config"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cap-gib", type=float, default=20.0)
    p.add_argument("--headroom", type=float, default=0.05)
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--phase", default="grid,verify,study")
    p.add_argument("--small", action="store_true", help="CPU smoke run with the tiny default GPT")
    args = p.parse_args()
    global DEVICE, SCRIPT_ARGS, LAYERS, DTYPE
    if args.small:
        DEVICE, SCRIPT_ARGS, LAYERS, DTYPE = "cpu", ["--dropout", "0.0"], 4, "fp32"
    usable = args.cap_gib * (1 - args.headroom)
    root = tempfile.mkdtemp(prefix="ab-compile-")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", f"{root}/inductor-cache")
    out: dict[str, Any] = {"cap_gib": args.cap_gib, "usable_gib": usable, "script_args": SCRIPT_ARGS, "root": root}
    grid = None
    if "grid" in args.phase:
        template = TrialLaunch(script=GPT, script_args=SCRIPT_ARGS, nproc_per_node=2, device=DEVICE, trial_dir=root,
                               steps=5, warmup=2, timeout_s=600)
        pool = WarmPool(template=template, pool_dir=f"{root}/pool")
        try:
            grid = out["grid"] = run_grid(pool, root, usable)
        finally:
            pool.close()
        write_result("compile_budget_grid", out)
    if "verify" in args.phase:
        out["verify"] = run_verify(root, grid)
        write_result("compile_budget_verify", out)
    if "study" in args.phase:
        out["study"] = run_study(args, root)
    write_result("compile_budget", out)


if __name__ == "__main__":
    main()
