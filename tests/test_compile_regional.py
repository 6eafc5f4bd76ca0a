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
from pathlib import Path
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


def test_a_block_is_compiled_with_ddps_bucket_split_off_and_the_whole_model_with_it_on(dynamo):
    """Inside a block DDP's bucket boundaries do not split the graph (``optimize_ddp`` off while a regional
    region compiles: its gradients are ready when the block's backward ends, and a split would compile
    each block in pieces); a whole-model compile keeps DDPOptimizer's split. Read by a backend at compile
    time. Fails if the regional wrapper stops switching it off, or leaks the switch to the whole scope."""
    seen: list[bool] = []

    def backend(gm: Any, inputs: Any) -> Any:
        seen.append(bool(torch._dynamo.config.optimize_ddp))
        return gm.forward

    torch.manual_seed(0)
    model = Net([Block() for _ in range(2)])
    state = CompileState(mode="default", budget=None, sizes=[6], scope="regional")
    state.backend = backend  # type: ignore[assignment]
    plan = SimpleNamespace(model=model, block_run=find_blocks(model)[1], model_info={}, verify=None, rank=0)
    state.on_wrapped(plan, model)  # type: ignore[arg-type]
    _step(model, *_data(6), loss=False)
    assert seen and not any(seen)
    seen.clear()
    torch._dynamo.reset()
    whole = Net([Block() for _ in range(2)])
    state = CompileState(mode="default", budget=None, sizes=[6], scope="whole")
    state.backend = backend  # type: ignore[assignment]
    state.apply(whole)
    _step(whole, *_data(6), loss=False)
    assert seen and all(seen) == bool(torch._dynamo.config.optimize_ddp)


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
    assert state.regions["tail"] == "none: the lightning integration's loop computes the loss (the blocks alone are compiled)"


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


# ---------------------------------------------------------------------- real runs (torchrun, 2 gloo ranks)

FAST_COMPILE = {"AUTOBALANCE_COMPILE_BACKEND": "aot_eager_decomp_partition", "OMP_NUM_THREADS": "1"}


def _gpt_args(layers: int, *extra: str) -> list[str]:
    return ["--n-layer", str(layers), "--n-embd", "32", "--samples", "128", *extra]


def _verify(tmp_path: Path, cfg: BalanceConfig, *script_args: str) -> tuple[dict[str, Any], str]:
    from tests.tune_helpers import GPT, cli

    path = tmp_path / "c.json"
    path.write_text(cfg.to_json())
    proc = cli(["verify", GPT, "--config", str(path), "--device", "cpu", "--runs-dir", str(tmp_path / "runs"),
                "--json", "--", *script_args], cwd=tmp_path, env=FAST_COMPILE, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    return json.loads(proc.stdout), proc.stderr


def _run_reports(verdict: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The rank reports of one verification run."""
    trial_dir = Path(verdict["runs"][name])
    return [json.loads((trial_dir / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_verify_passes_a_regional_configuration_with_an_uneven_split_and_per_rank_budgets(tmp_path):
    """The regional compiled step (each block and the loss compiled, budgets 0.5 and 1.0, 3 + 13
    samples) against the script's own eager fp32 step: within the rounding bound, and the compiled run
    really compiled one block graph and the loss on each rank with its own budget.

    Dropout off in the script (``--dropout 0``): with ``aot_eager_decomp_partition`` a budget below 1
    recomputes random ops without replaying them (whole-model too: rng-replay 0.19 on this model;
    Inductor replays them and passes), which is the test backend's, not the runtime's."""
    cfg = BalanceConfig(micro_batches=[3, 13], global_batch=16, compile="default", compile_scope="regional",
                        activation_budget=[0.5, 1.0])
    verdict, _ = _verify(tmp_path, cfg, *_gpt_args(3, "--dropout", "0"))
    assert verdict["passed"] is True, verdict["reason"]
    checks = {c["name"]: c for c in verdict["checks"]}
    eq = checks["equivalence"]
    assert eq["runs"] == ["tuned", "baseline"]  # fp32: the compiled configuration itself against the eager one
    assert eq["grad_rel"] <= verdict["bound"] and eq["param_rel"] <= verdict["bound"]
    for rank, (report, budget) in enumerate(zip(_run_reports(verdict, "tuned"), (0.5, 1.0), strict=True)):
        comp = report["compile"]
        assert comp["scope"] == "regional" and comp["activation_budget"] == budget, (rank, comp)
        assert comp["regions"]["blocks"] == 3 and comp["regions"]["tail"] == "the loss (plan.wrap(loss=...))"
        assert comp["graphs"] == 2, (rank, comp)  # one block graph for the three blocks, one for the loss


@pytest.mark.slow
def test_checkpointed_blocks_under_a_regional_compile_run_eagerly_and_verify(tmp_path):
    """Rank 0 checkpoints block 0 under a regional compile: it stays eager, the others compile; the
    step matches the eager fp32 one, and with dropout on the recomputation replays the masks. Before
    the rng-replay reference kept that block eager too, this failed (compiled dropout draws other
    masks than the eager checkpointed block: gradients 9e-2 apart, Inductor as well)."""
    cfg = BalanceConfig(micro_batches=[3, 13], global_batch=16, compile="default", compile_scope="regional",
                        activation_budget=[1.0, 1.0], checkpoint=[[0], []])
    verdict, _ = _verify(tmp_path, cfg, *_gpt_args(2))
    assert verdict["passed"] is True, verdict["reason"]
    checks = {c["name"]: c for c in verdict["checks"]}
    assert checks["equivalence"]["grad_rel"] <= verdict["bound"]
    replay = checks["rng-replay"]
    assert replay["grad_rel"] <= replay["tolerance"][0], replay
    ranks = _run_reports(verdict, "tuned")
    assert [r["compile"]["regions"]["checkpointed_eager"] for r in ranks] == [1, 0]
    assert [r["compile"]["regions"]["blocks"] for r in ranks] == [1, 2]
    reference = _run_reports(verdict, "tuned-dropout-no-recompute")
    assert reference[0]["compile"]["regions"]["eager_for_verification"] == 1  # not checkpointed, still eager
    assert "eager_for_verification" not in reference[1]["compile"]["regions"]


@pytest.mark.slow
def test_a_regional_trial_with_the_loss_outside_compiles_one_graph_for_four_blocks(tmp_path):
    from autobalance.launcher import TrialLaunch, run_trial
    from tests.tune_helpers import GPT

    cfg = BalanceConfig(micro_batches=[5, 11], global_batch=16, compile="default", compile_scope="regional",
                        activation_budget=[0.5, 1.0])
    launch = TrialLaunch(script=GPT, script_args=_gpt_args(4, "--loss-outside"), nproc_per_node=2, device="cpu",
                         config_json=cfg.to_json(), steps=2, warmup=1, trial_dir=str(tmp_path / "t"), timeout_s=300,
                         env=FAST_COMPILE, trial_id=f"regional{time.time()}")
    outcome = run_trial(launch)
    assert outcome.status == "ok", (outcome.reason, outcome.traceback[-3000:])
    for rank, rep in outcome.reports.items():
        comp = rep.compile
        assert comp["scope"] == "regional" and comp["regions"]["blocks"] == 4, (rank, comp)
        assert comp["regions"]["tail"].startswith("none: the loss is computed outside the model")
        assert comp["graphs"] == 1 and comp["recompiles_after_first_step"] == 0, (rank, comp)
        assert rep.timing.compile_s > 0 and len(rep.step_times_s) == 2


def _production(tmp_path: Path, cfg: BalanceConfig, env: dict[str, str] | None = None) -> tuple[Any, dict[int, Any]]:
    """``cfg`` saved in a store, exported, and loaded by a production job (tests/scripts/show_regions.py)."""
    from autobalance.store import ConfigStore, current_fingerprint, export_file
    from tests.conftest import torchrun

    with ConfigStore(url=f"sqlite:///{tmp_path / 'best.db'}") as store:
        row = store.save(study_name="prod", trial_number=4, config=cfg, figures={},
                         fingerprint=current_fingerprint(device_type="cpu", world_size=2, nnodes=1), saved_by="test")
        assert store.load("prod").config == cfg  # the scope survives the store
    path = export_file(row, str(tmp_path / "best.json"))
    assert json.loads(Path(path).read_text())["config"]["compile_scope"] == "regional"
    out = tmp_path / "regions"
    out.mkdir()
    proc = torchrun(["tests/scripts/show_regions.py"], env={"AUTOBALANCE_DEVICE": "cpu", "AUTOBALANCE_CONFIG_FILE": path,
                                                            "SHOW_REGIONS_DIR": str(out), **FAST_COMPILE, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1) if (out / f"rank{r}.json").exists()}
    return proc, found


@pytest.mark.slow
def test_production_loads_a_regional_configuration_and_compiles_the_same_regions(tmp_path):
    """A saved regional configuration (rank 0 checkpointing block 0) loads in a production job on every
    rank, and the job compiles what the trial compiled: the blocks not checkpointed (one graph) and the
    loss (one graph), with each rank's budget."""
    cfg = BalanceConfig(micro_batches=[3, 5], global_batch=8, compile="default", compile_scope="regional",
                        activation_budget=[0.5, 1.0], checkpoint=[[0], []])
    proc, found = _production(tmp_path, cfg)
    assert set(found) == {0, 1}
    using = [line for line in proc.stderr.splitlines() if line.startswith("autobalance: using")]
    assert len(using) == 1 and "compile=default regional" in using[0], using
    for rank, data in found.items():
        assert BalanceConfig.from_dict(data["config"]) == cfg
        comp = data["compile"]
        assert comp["scope"] == "regional" and comp["activation_budget"] == [0.5, 1.0][rank]
        assert comp["regions"]["tail"] == "the loss (plan.wrap(loss=...))"
        assert comp["graphs"] == 2, (rank, comp)
    assert found[0]["compiled_blocks"] == [False, True, True] and found[0]["compile"]["regions"]["checkpointed_eager"] == 1
    assert found[1]["compiled_blocks"] == [True, True, True] and found[1]["compile"]["regions"]["blocks"] == 3


@pytest.mark.slow
def test_a_production_model_without_its_blocks_says_so_in_one_line_and_runs_eagerly(tmp_path):
    cfg = BalanceConfig(micro_batches=[3, 5], global_batch=8, compile="default", compile_scope="regional")
    proc, found = _production(tmp_path, cfg, {"SHOW_REGIONS_NO_BLOCKS": "1"})
    warned = [line for line in proc.stderr.splitlines() if "compile_scope='regional' but the model has no repeated" in line]
    assert len(warned) == 2, proc.stderr[-3000:]  # one line per rank
    assert all("blocks=" in line and "compile_scope='whole'" in line for line in warned)
    for data in found.values():
        comp = data["compile"]
        assert comp["regions"]["blocks"] == 0 and comp["regions"]["note"] == "no repeated blocks found: ran eagerly"
        assert comp["graphs"] == 1  # the loss alone: the model ran eagerly


@pytest.mark.slow
def test_each_integration_compiles_the_blocks_it_finds_and_names_the_framework_as_the_loss_owner(tmp_path):
    """Lightning, the Hugging Face Trainer and Accelerate under a regional compile (any split, rank 0
    checkpointing block 0, budgets 0.5 and 1.0): ``prepare_model`` finds the blocks before the
    framework's DDP and ``attach`` compiles them (one graph per rank), the framework's loss is no tail,
    and the update is one process's full-batch SGD."""
    from tests.conftest import torchrun

    frameworks = {"lightning": "lightning", "hf": "transformers", "accelerate": "accelerate"}
    for module in frameworks.values():
        pytest.importorskip(module)
    proc = torchrun(["tests/scripts/integrations_regional.py", str(tmp_path), ",".join(frameworks)],
                    env=FAST_COMPILE, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for name in frameworks:
        for rank, results in enumerate(ranks):
            comp = results[name]["compile"]
            assert comp is not None and comp["scope"] == "regional", (name, rank, comp)
            assert comp["regions"]["blocks"] == [2, 3][rank] and comp["regions"]["checkpointed_eager"] == [1, 0][rank]
            assert comp["regions"]["tail"].startswith(f"none: the {name} integration's loop computes the loss")
            assert comp["activation_budget"] == [0.5, 1.0][rank] and comp["recompiles_after_first_step"] == 0
            # one graph for the blocks; on rank 1 block 0 is compiled too and takes the data (no gradient)
            # where the others take activations: Dynamo guards on requires_grad, a second graph
            assert comp["graphs"] == [1, 2][rank], (name, rank, comp)
        assert ranks[0][name]["rel_error"] <= 1e-6, (name, ranks[0][name])
