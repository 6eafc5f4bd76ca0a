"""Check ``--memory-cap``'s table of GPUs (``tuner/_settings.py: GPU_MEMORY_GIB``) against the cards of
this machine: each visible card's name and the memory CUDA reports, the table's entry it matches and
whether that entry is at most the card's memory (a cap named after the card a study runs on must not
exceed it, or the pre-flight refuses it). Not run yet: the table holds values as CUDA is known to
report them, rounded down.

    python benchmarks/gpu_memory_table.py            # writes $OUT/gpu_memory_table.json (or ./ without OUT)
"""

from __future__ import annotations

import json
import os
import re

import torch

from autobalance.tuner import parse_memory_cap
from autobalance.tuner._settings import GPU_MEMORY_GIB


def entry_for(name: str, total_gib: float) -> str | None:
    """The table's entry a card called ``name`` (``NVIDIA H100 80GB HBM3``) matches: its model, and the
    size when the table has several of that model (the one nearest ``total_gib``)."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())

    def model(entry: str) -> str:
        return re.sub(r"[^a-z0-9]", "", re.sub(r"-\d+GB$", "", entry).lower())

    models = [e for e in GPU_MEMORY_GIB if model(e) in key]
    if not models:
        return None
    longest = max(len(model(e)) for e in models)  # A100 over A10 in "A100-SXM4-40GB"
    models = [e for e in models if len(model(e)) == longest]
    return min(models, key=lambda e: abs(GPU_MEMORY_GIB[e] - total_gib))


def main() -> None:
    cards = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        total = props.total_memory / 2**30
        entry = entry_for(props.name, total)
        table = parse_memory_cap("--memory-cap", [entry])[0] if entry else None
        cards.append({"index": i, "name": props.name, "total_gib": round(total, 3), "entry": entry,
                      "table_gib": table, "fits": None if table is None else table <= total})
    out = os.environ.get("OUT", ".")
    path = os.path.join(out, "gpu_memory_table.json")
    with open(path, "w") as fh:
        json.dump({"torch": torch.__version__, "cards": cards}, fh, indent=1)
    print(json.dumps(cards, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
