"""Run by ``tests/test_compile_regional.py`` under torchrun (gloo, CPU, 2 ranks): each named integration
trains ``tests/integrations_exact.py``'s blocks model 3 steps under a regional compile (an uneven
split, micro-steps of unequal sizes, rank 0 checkpointing block 0), and each rank writes what its
compile part did (``CompileState.to_dict``) and how far the parameters are from one process's
full-batch SGD.

    torchrun --nproc-per-node 2 tests/scripts/integrations_regional.py OUT_DIR lightning,hf,accelerate
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import autobalance as ab
from autobalance._config import BalanceConfig
from tests import integrations_exact as exact

CONFIG = BalanceConfig.any_split(rank_samples=[7, 4], accumulation=2, checkpoint=[[0], []], compile="default",
                                 compile_scope="regional", activation_budget=[0.5, 1.0])

plans: list[Any] = []
_plan = ab.plan


def _capture(**kwargs: Any) -> Any:
    """``ab.plan`` as the runners call it, the plan kept (its compile part is read afterwards)."""
    made = _plan(**kwargs)
    plans.append(made)
    return made


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2].split(",")
    rank = int(os.environ["RANK"])
    data = exact.dataset(CONFIG.global_batch * exact.STEPS)
    ab.plan = _capture  # type: ignore[assignment]
    results: dict[str, Any] = {}
    for name in names:
        torch._dynamo.reset()  # each framework's blocks compile afresh (the graph count is per process)
        params, _ = exact.RUNNERS[name](CONFIG, data, 2)
        state = plans[-1].compile_state
        results[name] = {"compile": state.to_dict(device_type="cpu") if state is not None else None,
                         "rel_error": exact.rel_error(params, exact.reference(CONFIG, data, 0, weighted=True))}
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
