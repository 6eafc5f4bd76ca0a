"""Print the tables of benchmarks/RESULTS.md from the raw result files of one dated run.

    python benchmarks/summarize.py benchmarks/2026-11-30-h200x2
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def load(d: Path, name: str) -> dict:
    return json.loads((d / name).read_text())


def warm_vs_cold(d: Path) -> None:
    data = load(d, "warm_vs_cold.json")
    print("| configuration | mode | rank 0 peak GiB | rank 1 peak GiB | spread GiB | step ms | trial wall s |")
    print("|---|---|---|---|---|---|---|")
    for row in data["rows"]:
        for mode in ("cold", "warm"):
            r = row[mode]
            p0, p1 = r["0"]["peak_device_gib"], r["1"]["peak_device_gib"]
            step = max(r["0"]["step_time_ms"], r["1"]["step_time_ms"])
            print(f"| {row['config']} | {mode} | {p0:.2f} | {p1:.2f} | {abs(p0 - p1):.2f} | {step:.1f} | {row[mode + '_wall_s']:.1f} |")
    print()
    print("Allocated / reserved peaks, warm minus cold (GiB):")
    for row in data["rows"]:
        diffs = []
        for rank in ("0", "1"):
            c, w = row["cold"][rank], row["warm"][rank]
            diffs.append(f"r{rank} alloc {w['peak_allocated_gib'] - c['peak_allocated_gib']:+.2f} "
                         f"reserved {w['peak_reserved_gib'] - c['peak_reserved_gib']:+.2f}")
        print(f"- {row['config']}: " + "; ".join(diffs))


def grid(d: Path) -> dict:
    data = load(d, "smart_search_grid.json")["grid"]
    rows = data["rows"]
    best = data["best"]
    walls = [r["wall_s"] for r in rows]
    overhead = [r["wall_s"] - 4 * r["step_ms"] / 1000 for r in rows if r["step_ms"]]
    print(f"grid: {data['configs']} configurations in {data['wall_s']:.0f} s (one warm pool); median trial wall "
          f"{statistics.median(walls):.2f} s, of which {statistics.median(overhead):.2f} s outside the 4 timed-or-warm-up steps")
    c = best["config"]
    print(f"grid best (feasible, spread <= 0.5 GiB): {c['dtype']} {c['micro_batches']} acc {c['accumulation']} "
          f"ckpt {[len(x) for x in c['checkpoint']]}: {best['step_ms']:.1f} ms, spread {best['spread_gib']:.2f} GiB")
    return best


def studies(d: Path, grid_best: dict) -> None:
    rows = [json.loads(line) for line in (d / "smart_search_studies_spread_constraint.log").read_text().splitlines()
            if line.startswith('{"strategy"')]
    print("| strategy | seed | best step ms (spread <= 0.5 GiB) | ratio to grid best | trials to within 5 % | wall s (30 trials) | model held-out error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        best = r["best_step_ms_spread_ok"]
        ratio = f"{best / grid_best['step_ms']:.3f}" if best else "none found"
        err = r["memory_model_holdout_error"]
        print(f"| {r['strategy']} | {r['seed']} | {best if best else '-'} | {ratio} | {r['trials_to_within_5pct'] or '-'} | "
              f"{r['wall_s']:.1f} | {'-' if err is None else f'{100 * err:.1f} %'} |")


def main() -> None:
    d = Path(sys.argv[1])
    warm_vs_cold(d)
    print()
    best = grid(d)
    print()
    studies(d, best)
    ov = load(d, "overhead.json")
    print()
    print(f"runtime overhead: plan {ov['plan_ms']:.2f} ms vs hand-written {ov['hand_ms']:.2f} ms "
          f"({ov['overhead_pct']:+.2f} %, {ov['steps_each']} steps each)")


if __name__ == "__main__":
    main()
