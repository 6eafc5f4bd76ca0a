"""A production job of ``examples/gpt/train.py``'s model (for the regional-compile tests): the plan
loads its configuration as production does (``AUTOBALANCE_CONFIG_FILE`` / the store), the model is
wrapped with its loss, one forward and backward run, and each rank writes what its compile part did
(``CompileState.to_dict``: scope, regions, Dynamo graphs) to ``SHOW_REGIONS_DIR/rank<R>.json``.

``SHOW_REGIONS_NO_BLOCKS=1``: a model that lost its block list (the blocks inlined into one
``nn.Sequential`` of layers of different types), as a job whose model changed after tuning.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

import autobalance as ab

spec = importlib.util.spec_from_file_location("gpt_example", Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py")
assert spec is not None and spec.loader is not None
gpt = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gpt  # Dynamo looks the model's module up by name
spec.loader.exec_module(gpt)


class Flat(nn.Module):
    """No repeated blocks: embedding, one MLP, head."""

    def __init__(self, vocab: int, n_embd: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(vocab, n_embd), nn.Linear(n_embd, n_embd), nn.GELU(),
                                 nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)


plan = ab.plan(micro_batch=4)
torch.manual_seed(0)
vocab, block = 64, 16
if os.environ.get("SHOW_REGIONS_NO_BLOCKS") == "1":
    model: nn.Module = Flat(vocab, 32)
else:
    model = gpt.GPT(vocab=vocab, block_size=block, n_layer=int(os.environ.get("SHOW_REGIONS_LAYERS", "3")), n_embd=32,
                    n_head=4, dropout=0.0)
wrapped = plan.wrap(model, loss=gpt.lm_loss)
n = plan.config.micro_batches[plan.rank]
x = torch.randint(0, vocab, (n, block))
loss = wrapped(x, torch.roll(x, -1, dims=1))
loss.backward()
state = plan.compile_state
blocks = plan.block_run
result = {"rank": plan.rank, "config": plan.config.to_dict(), "loss": float(loss),
          "compile": None if state is None else state.to_dict(device_type="cpu"),
          "compiled_blocks": [getattr(b, "_compiled_call_impl", None) is not None for b in (blocks or [])]}
with open(os.path.join(os.environ["SHOW_REGIONS_DIR"], f"rank{plan.rank}.json"), "w") as fh:
    json.dump(result, fh)
