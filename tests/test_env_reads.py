"""Every environment variable the package reads, and why none of them can change a production
job's training math (issue 22: no switch in autobalance/ may silently corrupt training).

The inventory is found from the source (every ``os.environ.get`` / ``os.environ[...]`` /
``os.getenv`` / ``int_env`` / ``float_env``, names resolved through ``autobalance._env`` and the
module's own constants), so a new read fails here until someone says what it does.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import autobalance
from autobalance import _env

ROOT = Path(autobalance.__file__).parent

TORCHRUN = "set by torchrun: the process's place in the job"
TRIAL = "read only in a trial (AUTOBALANCE_TRIAL_DIR set by the launcher) or by the warm worker module"
NO_MATH = "no effect on the computed step (timeouts, display, caches, device placement, the store's bookkeeping)"
WHICH_CONFIG = "which saved configuration production loads (checked against this hardware on rank 0, broadcast)"

READS: dict[str, str] = {
    "RANK": TORCHRUN, "WORLD_SIZE": TORCHRUN, "LOCAL_RANK": TORCHRUN, "LOCAL_WORLD_SIZE": TORCHRUN,
    # the launcher -> runtime contract (autobalance/_env.py)
    "AUTOBALANCE_TRIAL_DIR": "marks a trial: the job then ends after its measured steps and writes rank "
                             "reports, which no production job can miss",
    "AUTOBALANCE_TRIAL_ID": TRIAL,
    "AUTOBALANCE_CONFIG": TRIAL,  # test_trial_only_variables_are_ignored_by_a_production_job
    "AUTOBALANCE_GLOBAL_BATCH": TRIAL,  # idem
    "AUTOBALANCE_STEPS": TRIAL, "AUTOBALANCE_WARMUP": TRIAL, "AUTOBALANCE_MEASURE_S": TRIAL,
    "AUTOBALANCE_MAX_STEPS": TRIAL,
    "AUTOBALANCE_DIAGNOSE": TRIAL + " (adds MemTracker's module breakdown, a measurement)",
    "AUTOBALANCE_WARM": TRIAL, "AUTOBALANCE_POOL_DIR": TRIAL,
    "AUTOBALANCE_STUDY": WHICH_CONFIG, "AUTOBALANCE_STORAGE": WHICH_CONFIG, "AUTOBALANCE_CONFIG_FILE": WHICH_CONFIG,
    "AUTOBALANCE_MEMORY_CAP_BYTES": NO_MATH + ": a memory cap (an OOM, never another result)",
    "AUTOBALANCE_PG_TIMEOUT_S": NO_MATH, "AUTOBALANCE_DEVICE": NO_MATH,
    "AUTOBALANCE_COMPILE_BACKEND": "documented user setting (docs/compile.md): the torch.compile backend of a "
                                   "compiled configuration; every backend runs the same graph and partitioner",
    "AUTOBALANCE_NODES_WAIT_S": NO_MATH, "AUTOBALANCE_HEARTBEAT_S": NO_MATH,
    "TORCHINDUCTOR_CACHE_DIR": NO_MATH, "CUDA_VISIBLE_DEVICES": NO_MATH, "COLUMNS": NO_MATH,
}
"""Every variable the package reads -> why it cannot change a production job's training math."""


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _reads_env(f: ast.AST) -> bool:
    """``os.environ.get`` / ``.pop``, ``os.getenv``, or the runtime's ``int_env`` / ``float_env``."""
    if isinstance(f, ast.Attribute):
        return (f.attr in ("get", "pop") and _is_environ(f.value)) or f.attr == "getenv"
    return isinstance(f, ast.Name) and f.id in ("getenv", "int_env", "float_env")


def _resolve(node: ast.AST, module: str) -> str | None:
    """The variable's name: a literal, ``_env.X``, or a constant of the module (None: a parameter)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "_env":
        return str(getattr(_env, node.attr))
    if isinstance(node, ast.Name):
        value = getattr(importlib.import_module(module), node.id, None)
        return value if isinstance(value, str) else None
    raise AssertionError(f"{module}: an environment read this test cannot resolve: {ast.unparse(node)}")


def env_reads() -> dict[str, list[str]]:
    """Variable -> ``path:line`` of each read in the package."""
    found: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(("autobalance", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            arg: ast.AST | None = None
            if isinstance(node, ast.Call) and node.args and _reads_env(node.func):
                arg = node.args[0]
            elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
                arg = node.slice
            if arg is not None and (name := _resolve(arg, module)) is not None:
                found.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_environment_read_is_accounted_for():
    """Fails if the package reads a variable not in READS (a new switch, e.g. a test-only
    ``AUTOBALANCE_TEST_*`` that could change training math, is back), or if READS lists one it no
    longer reads."""
    found = env_reads()
    assert sorted(set(found) - set(READS)) == [], {k: found[k] for k in set(found) - set(READS)}
    assert sorted(set(READS) - set(found)) == []
    assert not [name for name in found if "TEST" in name]


def test_trial_only_variables_are_ignored_by_a_production_job(monkeypatch: pytest.MonkeyPatch):
    """Fails if a production job (no AUTOBALANCE_TRIAL_DIR) applies a configuration or a global
    batch from the environment that a tuner's trial would have received."""
    monkeypatch.delenv(_env.TRIAL_DIR, raising=False)
    monkeypatch.setenv(_env.CONFIG, '{"micro_batches": [7], "global_batch": 7}')
    monkeypatch.setenv(_env.GLOBAL_BATCH, "99")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", _env.STUDY, _env.CONFIG_FILE):
        monkeypatch.delenv(name, raising=False)
    plan = autobalance.plan(micro_batch=4, device="cpu")
    assert plan.source == "defaults"
    assert plan.config.micro_batches == [4] and plan.config.global_batch == 4
