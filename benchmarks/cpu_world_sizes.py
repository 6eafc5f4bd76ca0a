"""The search space, solver, memory model and reports at 4 and 8 ranks, on CPU (gloo).

Runs a short model-guided study of the tiny GPT example per world size, then the HTML report,
and records what came out. Proves the world-size-dependent parts scale; not a speed benchmark.

    python benchmarks/cpu_world_sizes.py --ranks 4,8 --trials 6
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import GPT, run_tree, write_result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", default="4,8")
    p.add_argument("--trials", type=int, default=6)
    args = p.parse_args()
    import optuna

    root = tempfile.mkdtemp(prefix="ab-ranks-")
    runs = []
    for world in (int(r) for r in args.ranks.split(",")):
        db = f"sqlite:///{root}/w{world}.db"
        # 16 samples per rank so every split has room; rank 0's extras make the even split lopsided
        cmd = [sys.executable, "-m", "autobalance", "tune", GPT, "--trials", str(args.trials), "--nproc-per-node",
               str(world), "--device", "cpu", "--storage", db, "--study-name", f"w{world}", "--seed", "0",
               "--dtypes", "fp32", "--trial-timeout", "300", "--runs-dir", f"{root}/runs", "--", "--micro-batch", "4"]
        proc = run_tree(cmd, timeout_s=args.trials * 300 + 600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        wall = proc.wall_s
        study = optuna.load_study(study_name=f"w{world}", storage=db)
        trials = study.get_trials()
        report = run_tree([sys.executable, "-m", "autobalance", "report", "--study-name", f"w{world}",
                           "--storage", db, "-o", f"{root}/w{world}.html"], timeout_s=300)
        runs.append({
            "world_size": world, "returncode": proc.returncode, "wall_s": wall, "stderr_tail": proc.stderr[-1500:],
            "trials": [{"number": t.number, "status": t.user_attrs.get("status"), "config": t.user_attrs.get("config"),
                        "peak_device_gib": t.user_attrs.get("peak_device_gib"), "spread_gib": t.user_attrs.get("spread_gib"),
                        "step_time_ms": t.user_attrs.get("step_time_ms"),
                        "proposed_by": t.user_attrs.get("proposed_by")} for t in trials],
            "space": study.user_attrs.get("autobalance:space"),
            "memory_model_holdout_error": study.user_attrs.get("autobalance:memory_model_holdout_error"),
            "report_returncode": report.returncode,
            "report_bytes": os.path.getsize(f"{root}/w{world}.html") if os.path.exists(f"{root}/w{world}.html") else 0,
        })
        print(f"world {world}: rc {proc.returncode}, {len(trials)} trials in {wall:.0f} s, report rc {report.returncode}",
              flush=True)
    write_result("cpu_world_sizes", {"runs": runs})


if __name__ == "__main__":
    main()
