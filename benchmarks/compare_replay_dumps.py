"""Compare two ``benchmarks/replay_search.py --dump`` files study by study, trial by trial.

    python benchmarks/compare_replay_dumps.py OLD.json NEW.json

One line per study that decides differently: the first trial that differs (phase, scope, micro-batch x
micro-steps, budget, dtype, state on each side), or, with the same trials, how the number of trials or
the saved configuration changed; a class for each (the phase that proposed the new trial: ``raise-budget``,
``grow-probe``; ``length``: the same trials, fewer or more of them; ``saved``: the same trials, another
saved configuration), and the count of each class at the end.
"""

from __future__ import annotations

import collections
import json
import sys
from typing import Any


def _key(d: dict[str, Any]) -> tuple[str, str, str, int]:
    return d["machine"], d["placement"], d["budget"], d["seed"]


def _short(entry: list[Any]) -> str:
    phase, cfg, state = entry[0], entry[1] or {}, entry[2]
    scope = cfg.get("compile_scope", "") if cfg.get("compile") != "off" else "eager"
    split = f"{max(cfg.get('micro_batches') or [0])}x{cfg.get('accumulation')}"
    budget = (cfg.get("activation_budget") or ["-"])[0]
    return f"{phase}: {scope} {split} b{budget} {cfg.get('dtype')} {state}"


def compare(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> tuple[list[str], dict[str, int]]:
    a, b = {_key(d): d for d in old}, {_key(d): d for d in new}
    counts: collections.Counter[str] = collections.Counter()
    lines = []
    for key in sorted(a):
        x, y = a[key], b[key]
        lx, ly = x["log"], y["log"]
        first = next((i for i in range(min(len(lx), len(ly))) if lx[i][:3] != ly[i][:3]), None)
        same_saved = x["saved"] == y["saved"]
        if first is None and len(lx) == len(ly) and same_saved:
            counts["identical"] += 1
            continue
        if first is None:
            cls = "length" if len(lx) != len(ly) else "saved"
            why = (f"same trials, then {len(lx)} -> {len(ly)} trials" if cls == "length"
                   else "same trials, another saved configuration")
        else:
            cls = ly[first][0] if ly[first][0] in ("raise-budget", "grow-probe") else "other"
            why = f"trial {first}: {_short(lx[first])}  ->  {_short(ly[first])}"
        counts[cls] += 1
        lines.append(f"{key[0]:8s} {key[1]:7s} seed {key[3]:2d} [{cls}] {why}; saved {'same' if same_saved else 'differs'}")
    return lines, dict(counts)


if __name__ == "__main__":
    with open(sys.argv[1]) as f_old, open(sys.argv[2]) as f_new:
        found, counted = compare(json.load(f_old), json.load(f_new))
    print("\n".join(found))
    print(counted)
