"""Any split of the global batch (issue 21) against equal micro-batches, on one GPU.

The scenario of the issue: the ~270M GPT of ``benchmarks/common.py`` on one GPU, global batch 32
(the script's own configuration: micro-batch 4 x 8 accumulation steps), a memory cap under which a
micro-batch of 8 does not fit eagerly. Equal micro-batches can only use the divisors of 32
(1, 2, 4, 8, ...); any split can run 6,6,5,5,5,5 or 7,7,6,6,6.

Phases (all in one warm worker pool, ``--cap-mode judge``: ranks run uncapped and peaks are judged
against the cap, so no trial really runs out of memory):

1. ``direct``: a fixed list of eager configurations of both forms, measured one after the other
   (an A/B that does not depend on any search).
2. ``studies``: two studies with the same settings (trials, seed, model strategy, eager, dtypes),
   one with ``split="equal"``, one with ``split="any"``; their best feasible step time. With
   ``--study-compile search`` both studies also search ``torch.compile`` and its activation budget
   (``--time-budget`` bounds each study; results in ``any_split_studies_compiled.json``).
3. ``compiled`` (optional, a separate run: about 12-30 s of compilation per configuration): the
   largest micro-batches 8 (equal: 8,8,8,8), 7 and 6 (any: 7,7,6,6,6 and 6,6,5,5,5,5) compiled
   (``torch.compile`` default mode), at the default activation budget and at 0.5. The any split's
   two micro-batch sizes compile once each (the second size makes the batch dimension dynamic).

    python benchmarks/any_split.py --cap-gib 16 --phase direct,studies   # one H200, about 3-5 minutes
    python benchmarks/any_split.py --cap-gib 16 --phase compiled         # one H200, about 2-4 minutes
    python benchmarks/any_split.py --cap-gib 16 --phase studies --study-compile search --time-budget 3m
                                                                         # one H200, at most ~8 minutes
    python benchmarks/any_split.py --small --cap-gib 0.0148 --trials 6    # CPU smoke run: the tiny GPT
"""

from __future__ import annotations

import argparse
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


def script_args(small: bool) -> list[str]:
    """The benchmark GPT with its own configuration set to the best equal form (4 x 8 = 32)."""
    args = [] if small else list(GPT_ARGS)
    for flag, value in (("--micro-batch", "4"), ("--samples", "1024"), ("--accumulation", "8")):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


def direct_configs(dtype: str, global_batch: int, compiled: bool) -> list[tuple[str, BalanceConfig]]:
    """Equal forms (divisors) and any splits: eager with 4..8 micro-steps (largest micro-batch 8..4);
    compiled with 4..6 micro-steps (8, 7, 6), each at the default activation budget and at 0.5."""
    out: list[tuple[str, BalanceConfig]] = []
    extra: dict[str, Any] = {"dtype": dtype, "gradient_as_bucket_view": True}
    budgets = [1.0, 0.5] if compiled else [None]
    for budget in budgets:
        if compiled:
            extra.update(compile="default", activation_budget=[budget])
        for acc in range(4, 7 if compiled else 9):
            cfg = BalanceConfig.any_split(rank_samples=[global_batch], accumulation=acc, **extra)
            form = "equal" if cfg.equal_micro_batches else "any"
            label = f"{form} {cfg.split_text()}" + (f" budget {budget}" if compiled else "")
            out.append((label, cfg))
    return out


def measure(pool: WarmPool, launch_args: dict[str, Any], root: str, name: str, cfg: BalanceConfig,
            usable_gib: float) -> dict[str, Any]:
    launch = TrialLaunch(**launch_args, trial_dir=f"{root}/{name}", config_json=cfg.to_json())
    o = pool.run(launch)
    ok = o.status == "ok"
    peaks = [o.reports[r].memory.peak_device / GIB for r in sorted(o.reports)] if ok else []
    step = max(o.reports[r].step_time_s for r in o.reports) * 1000 if ok else None
    row = {"config": cfg.to_dict(), "split": cfg.split_lines(), "equal_form": cfg.equal_micro_batches,
           "status": o.status, "peaks_gib": peaks, "step_ms": step,
           "fits": bool(peaks) and max(peaks) <= usable_gib, "wall_s": round(o.wall_s, 2)}
    print(json.dumps({k: row[k] for k in ("split", "status", "peaks_gib", "step_ms", "fits")}), flush=True)
    return row


def best_row(rows: list[dict[str, Any]], *, equal_form: bool | None = None) -> dict[str, Any] | None:
    ok = [r for r in rows if r["fits"] and r["step_ms"] and (equal_form is None or r["equal_form"] == equal_form)]
    return min(ok, key=lambda r: r["step_ms"]) if ok else None


def run_direct(pool: WarmPool, launch_args: dict[str, Any], root: str, args: argparse.Namespace, usable: float,
               *, compiled: bool) -> dict[str, Any]:
    t0 = time.monotonic()
    rows = []
    for i, (label, cfg) in enumerate(direct_configs(args.dtype, args.global_batch, compiled)):
        print(f"{'compiled' if compiled else 'eager'} {i}: {label}", flush=True)
        rows.append({"label": label, **measure(pool, launch_args, root, f"{'c' if compiled else 'e'}{i}", cfg, usable)})
    eq, any_ = best_row(rows, equal_form=True), best_row(rows, equal_form=False)
    return {"rows": rows, "best_equal": eq, "best_any": any_, "wall_s": time.monotonic() - t0,
            "speedup_any_over_equal": (eq["step_ms"] / any_["step_ms"]) if eq and any_ else None}


def run_studies(pool: WarmPool, root: str, args: argparse.Namespace) -> dict[str, Any]:
    import optuna

    from autobalance.tuner import Tuner, TuneSettings

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out: dict[str, Any] = {}
    for split in ("equal", "any"):
        settings = TuneSettings(
            script=GPT, script_args=script_args(args.small), trials=args.trials, nproc_per_node=1, device=args.device,
            storage=f"sqlite:///{root}/studies.db", study_name=f"split-{split}-compile-{args.study_compile}",
            memory_cap_gib=[args.cap_gib], headroom=args.headroom, cap_mode="judge", compile=args.study_compile,
            strategy="model", sampler="tpe", seed=args.seed, dtypes=[args.dtype],
            max_accumulation=args.max_accumulation, split=split, verify=False, trial_timeout=180,
            runs_dir=f"{root}/runs", time_budget=args.time_budget,
        )
        t0 = time.monotonic()
        result = Tuner(settings=settings, pool=pool).run()
        study = optuna.load_study(study_name=settings.study_name, storage=settings.storage)
        launched = [t for t in study.get_trials() if t.user_attrs.get("status") not in (None, "predicted_oom")]
        best = result.best
        row = {"split": split, "compile": args.study_compile, "time_budget": args.time_budget,
               "wall_s": round(time.monotonic() - t0, 1), "trials_launched": len(launched),
               "best": None if best is None else {
                   "number": best.number, "config": best.user_attrs["config"],
                   "split": BalanceConfig.from_dict(best.user_attrs["config"]).split_lines(),
                   "step_ms": best.user_attrs.get("step_time_ms"), "peaks_gib": best.user_attrs.get("peak_device_gib")},
               "trials": [{"number": t.number, "status": t.user_attrs.get("status"),
                           "split": BalanceConfig.from_dict(t.user_attrs["config"]).split_text()
                           if t.user_attrs.get("config") else None,
                           "compile": (t.user_attrs.get("config") or {}).get("compile"),
                           "step_ms": t.user_attrs.get("step_time_ms"), "feasible": t.user_attrs.get("feasible")}
                          for t in study.get_trials()]}
        print(json.dumps({k: row[k] for k in ("split", "wall_s", "trials_launched", "best")}), flush=True)
        out[split] = row
    eq, any_ = (out[s]["best"] for s in ("equal", "any"))
    out["speedup_any_over_equal"] = (eq["step_ms"] / any_["step_ms"]) if eq and any_ and any_["step_ms"] else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap-gib", type=float, default=16.0)
    p.add_argument("--headroom", type=float, default=0.05)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--trials", type=int, default=10, help="trials per study (same for both forms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-accumulation", type=int, default=8)
    p.add_argument("--phase", default="direct,studies", help="comma list of direct, studies, compiled")
    p.add_argument("--small", action="store_true", help="CPU smoke run with the tiny default GPT")
    p.add_argument("--study-compile", choices=["off", "search"], default="off",
                   help="studies phase: eager only (off) or torch.compile searched too (search), same for both forms")
    p.add_argument("--time-budget", default=None, help="studies phase: stop starting trials after this (e.g. 3m), per study")
    args = p.parse_args()
    args.device = "cpu" if args.small else "cuda"
    if args.small and args.dtype == "bf16":
        args.dtype = "fp32"
    usable = args.cap_gib * (1 - args.headroom)
    root = tempfile.mkdtemp(prefix="ab-any-split-")
    launch_args = dict(script=GPT, script_args=script_args(args.small), nproc_per_node=1, device=args.device,
                       steps=3, warmup=1, timeout_s=180)
    pool = WarmPool(template=TrialLaunch(**launch_args, trial_dir=root), pool_dir=f"{root}/pool")
    out: dict[str, Any] = {"cap_gib": args.cap_gib, "headroom": args.headroom, "usable_gib": usable,
                           "global_batch": args.global_batch, "dtype": args.dtype, "script_args": script_args(args.small),
                           "trials": args.trials, "seed": args.seed, "phase": args.phase,
                           "study_compile": args.study_compile, "time_budget": args.time_budget}
    name = "any_split_small" if args.small else "any_split"
    if args.study_compile == "search":
        name += "_studies_compiled"
    t0 = time.monotonic()
    try:
        if "direct" in args.phase:
            out["direct"] = run_direct(pool, launch_args, root, args, usable, compiled=False)
            write_result(name, out)
        if "studies" in args.phase:
            out["studies"] = run_studies(pool, root, args)
            write_result(name, out)
        if "compiled" in args.phase:
            out["compiled"] = run_direct(pool, launch_args, root, args, usable, compiled=True)
    finally:
        pool.close()
    out["wall_s"] = round(time.monotonic() - t0, 1)
    write_result(name, out)
    for phase in ("direct", "compiled"):
        if phase in out:
            d = out[phase]
            for key in ("best_equal", "best_any"):
                b = d[key]
                print(f"{phase} {key}: " + (f"{b['step_ms']:.1f} ms {b['split']}" if b else "none fits"))
    if "studies" in out:
        for split in ("equal", "any"):
            b = out["studies"][split]["best"]
            print(f"study split={split}: " + (f"{b['step_ms']:.1f} ms {b['split']}" if b else "no feasible trial"))


if __name__ == "__main__":
    main()
