"""How well the smart search's step-time model predicts measured step times it was not fitted to,
on the H200 grid of the GPT scenario (``2026-11-30-h200x2/smart_search_grid.json``, 144 measured
configurations, bf16/fp16): fit on N random configurations, predict the others; 50 draws per N.

    python benchmarks/step_time_model_check.py [--sizes 4,6,10,20,143] [--out FILE]

Runs unchanged in a checkout of an older commit (copy it there) to compare models.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optuna

from autobalance import BalanceConfig

try:
    from autobalance.tuner.search import StepTimeModel
except ImportError:  # a commit before the tuner's split (the script runs unchanged on older commits)
    from autobalance.tuner._advisor import StepTimeModel  # type: ignore[no-redef]

GRID = os.path.join(os.path.dirname(os.path.abspath(__file__)), "2026-11-30-h200x2", "smart_search_grid.json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4,6,10,20,143")
    p.add_argument("--draws", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with open(GRID) as fh:
        rows = [r for r in json.load(fh)["grid"]["rows"] if r["step_ms"]]
    trials = [optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=1.0,
                                        user_attrs={"status": "ok", "config": r["config"], "step_time_ms": r["step_ms"]})
              for r in rows]
    results = []
    for n in (int(x) for x in args.sizes.split(",")):
        errors: list[float] = []
        for seed in range(args.draws if n < len(rows) else 1):
            chosen = set(random.Random(seed).sample(range(len(rows)), n))
            model = StepTimeModel.fit([trials[i] for i in chosen], num_layers=16, device="cuda")
            held = [i for i in range(len(rows)) if i not in chosen] or list(chosen)  # all: in-sample
            for i in held:
                predicted = model.predict(BalanceConfig.from_dict(rows[i]["config"]))
                assert predicted is not None
                errors.append(abs(predicted / rows[i]["step_ms"] - 1))
        row = {"fitted_on": n, "median_rel_error": round(statistics.median(errors), 4),
               "p90_rel_error": round(sorted(errors)[int(0.9 * len(errors))], 4)}
        results.append(row)
        print(json.dumps(row), flush=True)
    best = min((r for r in rows if r["feasible"] and r["spread_gib"] <= 0.5), key=lambda r: r["step_ms"])
    fitted = StepTimeModel.fit(trials, num_layers=16, device="cuda")
    print(json.dumps({"grid_best": best["config"], "measured_ms": round(best["step_ms"], 2),
                      "predicted_ms_fitted_on_all": round(fitted.predict(BalanceConfig.from_dict(best["config"])), 2)}))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"benchmark": "step_time_model_check", "grid": os.path.relpath(GRID), "results": results}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
