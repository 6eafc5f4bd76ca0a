"""Issue 40: regional compilation (``compile_scope='regional'``).

Fast tests (no process group) drive :class:`~autobalance.runtime._compile.CompileState` directly with
Dynamo's ``eager`` backend: the graph count is Dynamo's (``unique_graphs``), whatever the backend.
The ``slow`` ones run real torchrun jobs (2 gloo ranks) of ``examples/gpt/train.py`` at a tiny size,
compiled with ``aot_eager_decomp_partition`` (the partitioner and its activation budget, no C++
compile) through ``AUTOBALANCE_COMPILE_BACKEND``, as ``tests/test_compile_verify.py`` does.
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autobalance import BalanceConfig, ConfigError
from autobalance._config import describe_config
from autobalance.runtime._checkpoint import apply_checkpointing, find_blocks
from autobalance.runtime._compile import CompileState
from autobalance.runtime._with_loss import ModelWithLoss

D = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


class OtherBlock(nn.Module):
    """A second block type (other code, other parameters): its own graph."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.inp = nn.Linear(4, D)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture
def dynamo() -> Iterator[Any]:
    """Dynamo's counters, from a clean cache (and cleaned after)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def _graphs(counters: Any) -> int:
    return int(counters["stats"]["unique_graphs"])


def _compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def _regional(model: nn.Module, *, loss: bool, blocks: str | None = None, sizes: list[int] | None = None,
              checkpoint: list[int] | None = None, framework: str | None = None) -> tuple[nn.Module, CompileState]:
    """``model`` wrapped as the runtime wraps it (checkpointing, the loss, then ``on_wrapped``)."""
    _, run = find_blocks(model, blocks)
    apply_checkpointing(run, checkpoint or [])
    wrapped = ModelWithLoss(model, F.cross_entropy) if loss else model
    state = CompileState(mode="default", budget=None, sizes=sizes or [6], backend="eager", scope="regional")
    plan = SimpleNamespace(model=wrapped, block_run=run, model_info={"framework": framework} if framework else {},
                           verify=None, rank=0)
    state.on_wrapped(plan, wrapped)  # type: ignore[arg-type]
    return wrapped, state


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, loss: bool) -> list[torch.Tensor]:
    """One forward and backward; the gradients."""
    model.zero_grad()
    out = model(x, y) if loss else F.cross_entropy(model(x), y)
    out.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("n_blocks", [2, 4])
@pytest.mark.parametrize("loss", [False, True])
def test_identical_blocks_compile_once_and_the_loss_tail_once(dynamo, n_blocks, loss):
    """One graph for every block, whatever their number, plus one for the loss that ``plan.wrap(loss=)``
    owns; the gradients are eager's. Fails if blocks stay eager (0 graphs), if each block traces its
    own graph (``n_blocks``), or if the tail is not compiled."""
    torch.manual_seed(0)
    model = Net([Block() for _ in range(n_blocks)])
    eager = copy.deepcopy(model)
    wrapped, state = _regional(model, loss=loss)
    assert all(_compiled(b) for b in model.blocks) and not _compiled(model) and not _compiled(model.head)
    tail = "the loss (plan.wrap(loss=...))" if loss else \
        "none: the loss is computed outside the model (pass it as plan.wrap(model, loss=fn) to compile it)"
    assert state.regions == {"blocks": n_blocks, "checkpointed_eager": 0, "tail": tail}
    x, y = _data(6)
    for _ in range(2):
        got = _step(wrapped, x, y, loss=loss)
    want = _step(eager, x, y, loss=False)
    assert len(got) == len(want) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want, strict=True))
    assert _graphs(dynamo) == 1 + loss
    report = state.to_dict(device_type="cpu")
    assert report["scope"] == "regional" and report["regions"] == state.regions and report["graphs"] == 1 + loss


def test_two_block_types_compile_one_graph_each(dynamo):
    """``blocks=`` naming a ModuleList of two alternating block classes: every block compiled, one
    graph per class (2, with the loss outside)."""
    torch.manual_seed(0)
    model = Net([Block(), OtherBlock(), Block(), OtherBlock()])
    eager = copy.deepcopy(model)
    wrapped, state = _regional(model, loss=False, blocks="blocks")
    assert all(_compiled(b) for b in model.blocks) and state.regions["blocks"] == 4
    x, y = _data(6)
    got = _step(wrapped, x, y, loss=False)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, _step(eager, x, y, loss=False), strict=True))
    assert _graphs(dynamo) == 2


def test_a_rank_with_two_micro_step_sizes_compiles_each_region_once(dynamo):
    """Micro-steps of 6 and 5 on one rank: the batch dimension marked dynamic in each region (the
    whole-model path's ``maybe_mark_dynamic``), one graph per region, not one per size."""
    torch.manual_seed(0)
    wrapped, state = _regional(Net([Block() for _ in range(3)]), loss=True, sizes=[6, 6, 5])
    assert state.dynamic_batch
    for n in (6, 6, 5, 5):
        _step(wrapped, *_data(n), loss=True)
    assert _graphs(dynamo) == 2


def test_checkpointed_blocks_stay_eager_and_the_others_compile(dynamo):
    """This rank checkpoints block 0: it runs eagerly inside its checkpoint wrapper (no second
    recomputation from the budget), the other blocks compile (one graph); gradients are eager's."""
    torch.manual_seed(0)
    model = Net([Block() for _ in range(3)])
    eager = copy.deepcopy(model)
    wrapped, state = _regional(model, loss=False, checkpoint=[0])
    assert state.regions == {"blocks": 2, "checkpointed_eager": 1, "tail": state.regions["tail"]}
    assert not _compiled(model.blocks[0]) and _compiled(model.blocks[1]) and _compiled(model.blocks[2])
    x, y = _data(6)
    got = _step(wrapped, x, y, loss=False)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, _step(eager, x, y, loss=False), strict=True))
    assert _graphs(dynamo) == 1


def test_a_model_without_repeated_blocks_warns_once_and_runs_eagerly(dynamo):
    model = nn.Sequential(nn.Linear(4, D), nn.ReLU(), nn.Linear(D, 3))
    assert len(find_blocks(model)[1]) == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped, state = _regional(model, loss=True)
    lines = [str(w.message) for w in caught if "autobalance" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "blocks=" in lines[0] and "compile_scope='whole'" in lines[0] and "eagerly" in lines[0]
    assert state.regions["blocks"] == 0 and state.regions["note"] == "no repeated blocks found: ran eagerly"
    _step(wrapped, *_data(6), loss=True)
    assert not _compiled(model)
    assert _graphs(dynamo) == 1  # the loss alone (plan.wrap owns it); the model itself ran eagerly


def test_an_integration_reports_that_it_owns_the_loss(dynamo):
    """Under a framework (``prepare_model`` records it), no tail: the report says the framework computes
    the loss, not that the script should pass ``loss=`` to ``plan.wrap``."""
    _, state = _regional(Net([Block(), Block()]), loss=False, framework="lightning")
    assert state.regions["tail"] == "none: lightning computes the loss itself (the blocks alone are compiled)"


# ---------------------------------------------------------------------- the configuration

def make(**kw: Any) -> BalanceConfig:
    base: dict[str, Any] = dict(micro_batches=[3, 5], global_batch=8, compile="default")
    base.update(kw)
    return BalanceConfig(**base)


def test_a_regional_configuration_round_trips_and_whole_stays_as_stored_before():
    cfg = make(compile_scope="regional", activation_budget=[0.5, 1.0], checkpoint=[[0], []])
    data = json.loads(cfg.to_json())
    assert data["compile_scope"] == "regional"
    assert BalanceConfig.from_json(cfg.to_json()) == cfg
    assert "compile_scope" not in json.loads(make().to_json())  # whole: no key, as before the scope existed
    old = {"micro_batches": [3, 5], "global_batch": 8, "compile": "default", "checkpoint": [[], []], "dtype": "fp32",
           "accumulation": 1, "bucket_cap_mb": 25.0, "gradient_as_bucket_view": False}
    assert BalanceConfig.from_dict(old).compile_scope == "whole"
    assert "compile=default regional" in describe_config(cfg) and "regional" not in describe_config(make())


@pytest.mark.parametrize(("kw", "words"), [
    (dict(compile="off", compile_scope="regional"), ["compile_scope='regional' needs compile on", "compile='default'",
                                                      "compile_scope='whole'"]),
    (dict(micro_batches=[8], compile="reduce-overhead", compile_scope="regional"),
     ["compile_scope='regional' with compile='reduce-overhead'", "compile_scope='whole' or compile='default'"]),
    (dict(compile_scope="blocks"), ["compile_scope='blocks' is unknown", "whole, regional"]),
    (dict(compile_scope=1), ["compile_scope=1", "a string"]),
    (dict(checkpoint=[[0], []]), ["checkpoint[0]=[0]", "compile_scope='regional'"]),
])
def test_invalid_scopes_give_one_line_errors_naming_the_fix(kw, words):
    with pytest.raises(ConfigError) as info:
        make(**kw)
    text = str(info.value)
    assert "\n" not in text
    for w in words:
        assert w in text, text


def test_the_report_names_the_scope_parameter_in_words():
    from autobalance.report._figures import param_words

    assert param_words("compile_scope") == "compile scope"
