"""Every environment variable the package reads, and why none of them can change a production
job's training math (issue 22: no switch in autobalance/ may silently corrupt training).

The inventory is found from the source by AST, on every form of reading a variable by name:
``os.environ.get`` / ``.pop`` / ``.setdefault`` / ``[...]``, ``"X" in os.environ`` / ``not in``,
``os.getenv``, the runtime's ``int_env``, ``TrialEnv.read(os.environ, ...)`` (a read of every
name in ``TrialEnv.NAMES`` and ``TrialEnv.JOB_NAMES``) and ``TrialEnv.read_job(os.environ)`` (of
``JOB_NAMES``: ``test_trial_env_read_reads_only_its_names`` proves both), each also through an alias
(``env = os.environ``, ``from os import environ``, ``import os as o``) or on a copy
(``env = dict(os.environ)``); names are resolved through ``autobalance._env``, the module's own
constants and loops over literal tuples. So a new read fails here until someone says what it does.

Reading the whole environment (``dict(os.environ)``, ``os.environ.copy()``, ``.items()``,
``.keys()``, ``{**os.environ}``, passing ``os.environ`` on) names no variable: each such site is
listed in ``WHOLE_READS`` with its reason, or fails. The checker itself is proved on planted
sources (``test_checker_finds_planted_reads``), so it cannot pass by seeing nothing.

In ``autobalance/runtime/`` an ``AUTOBALANCE_*`` variable is read through ``TrialEnv`` (issue 32: one
typed trial environment), apart from the few direct reads listed in ``RUNTIME_DIRECT`` with their
reason: ``test_the_runtime_reads_its_variables_through_trial_env``.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import autobalance
from autobalance import _env
from autobalance._errors import UsageError

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
    "AUTOBALANCE_EMULATE_MS_PER_SAMPLE": NO_MATH + ": an emulated slow rank sleeps per sample, no tensor touched",
    "AUTOBALANCE_EMULATE_SMS": NO_MATH + ": an emulated smaller GPU runs the same kernels on fewer SMs",
    "AUTOBALANCE_COMPILE_BACKEND": "documented user setting (docs/compile.md): the torch.compile backend of a "
                                   "compiled configuration; every backend runs the same graph and partitioner",
    "AUTOBALANCE_NODES_WAIT_S": NO_MATH, "AUTOBALANCE_HEARTBEAT_S": NO_MATH,
    "TORCHINDUCTOR_CACHE_DIR": NO_MATH, "CUDA_VISIBLE_DEVICES": NO_MATH, "COLUMNS": NO_MATH,
    "ACCELERATE_DYNAMO_BACKEND": "removed, never read (.pop): the HF integration withdraws transformers' own "
                                 "compile request (accelerate < 1.2 reads it) so the configuration alone compiles",
    "ACCELERATE_DYNAMO_MODE": "idem",
}
"""Every variable the package reads -> why it cannot change a production job's training math."""

WHOLE_READS: dict[str, str] = {
    "launcher/_torchrun.py::trial_environment":
        "the launcher building a trial's environment: the parent's (NCCL/NVLink settings) minus the "
        "configuration and store variables, plus the trial's; read in the tuner, never in a training job",
    "runtime/_worker.py::main":
        "the warm worker keeps the environment it started with and restores it before each trial, so one "
        "trial's variables never leak into the next; no variable is looked up in it",
}
"""``path::function`` of each read of the whole environment -> why it is not a hidden switch."""

RUNTIME_DIRECT: dict[tuple[str, str], str] = {
    ("runtime/_plan.py", "AUTOBALANCE_PG_TIMEOUT_S"):
        "int_env before the process group exists, its default that of a trial (60 s) or of a production job",
    ("runtime/_worker.py", "AUTOBALANCE_PG_TIMEOUT_S"): "the warm pool's process group, set up before any trial",
    ("runtime/_choice.py", "AUTOBALANCE_CONFIG_FILE"):
        "a production job's saved configuration, which a trial never has (the launcher drops it)",
    ("runtime/_choice.py", "AUTOBALANCE_STUDY"): "idem",
    ("runtime/_choice.py", "AUTOBALANCE_STORAGE"): "idem",
}
"""``(file, variable)`` of each ``AUTOBALANCE_*`` variable the runtime reads other than through
``TrialEnv.read`` / ``read_job`` -> why."""

TRIAL_ENV_READ = (*_env.TrialEnv.NAMES, *_env.TrialEnv.JOB_NAMES)
"""What ``TrialEnv.read`` reads (``read_job``: ``JOB_NAMES`` alone)."""

NAME_METHODS = ("get", "pop", "setdefault", "__getitem__", "__contains__")
"""``environ.<m>(NAME, ...)``: a read of one variable."""
WRITE_METHODS = ("update", "clear", "__setitem__", "__delitem__")
"""``environ.<m>(...)``: a write, not a read."""
COPIES = ("dict", "copy", "deepcopy")
"""``dict(environ)`` / ``environ.copy()`` / ``copy.copy(environ)``: a copy, whose look-ups are reads too."""


class _Scope:
    def __init__(self, parent: _Scope | None, qualname: str, params: set[str]) -> None:
        self.parent, self.qualname, self.params = parent, qualname, params
        self.aliases: set[str] = set()       # names bound to os.environ itself
        self.copies: set[str] = set()        # names bound to a copy of it
        self.loops: dict[str, list[ast.expr]] = {}  # `for NAME in (A, B)`: NAME -> [A, B]

    def find(self, attr: str, name: str) -> bool:
        scope: _Scope | None = self
        while scope is not None:
            if name in getattr(scope, attr):
                return True
            scope = scope.parent
        return False

    def loop(self, name: str) -> list[ast.expr] | None:
        scope: _Scope | None = self
        while scope is not None:
            if name in scope.loops:
                return scope.loops[name]
            scope = scope.parent
        return None


def _scope_nodes(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """The nodes of one function, class body or module, without those of the functions and classes in it."""
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        yield node  # a function or class itself (entered as its own scope), not what is inside it
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))


class EnvReads:
    """The environment reads of one source file: ``names`` (variable -> lines) and ``whole``
    (``path::function`` -> lines of each read of the whole environment)."""

    def __init__(self, source: str, rel: str, constant: Callable[[str], object]) -> None:
        self.rel, self.constant = rel, constant
        self.names: dict[str, list[int]] = {}
        self.whole: dict[str, list[int]] = {}
        self.typed: dict[str, list[int]] = {}
        """The reads among ``names`` made through ``TrialEnv.read`` / ``read_job``."""
        tree = ast.parse(source)
        self.os_names, self.environ_names, self.getenv_names = {"os"}, set(), {"int_env"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                for a in node.names:
                    if a.name in ("environ", "environb"):
                        self.environ_names.add(a.asname or a.name)
                    elif a.name == "getenv":
                        self.getenv_names.add(a.asname or a.name)
        self._consumed: set[int] = set()
        self._walk(tree.body, _Scope(None, "<module>", set()))

    # -- what an expression is -----------------------------------------------------------------
    def _is_environ(self, node: ast.AST, scope: _Scope) -> bool:
        """``os.environ`` or a name bound to it."""
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb"):
            return isinstance(node.value, ast.Name) and node.value.id in self.os_names
        return isinstance(node, ast.Name) and (node.id in self.environ_names or scope.find("aliases", node.id))

    def _is_env(self, node: ast.AST, scope: _Scope) -> bool:
        """``os.environ``, an alias or a copy of it: look-ups in it are reads."""
        return self._is_environ(node, scope) or (isinstance(node, ast.Name) and scope.find("copies", node.id))

    def _copy_of_environ(self, node: ast.AST, scope: _Scope) -> bool:
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name == "copy" and isinstance(f, ast.Attribute) and not node.args:
                return self._is_env(f.value, scope)
            return name in COPIES and len(node.args) == 1 and self._is_env(node.args[0], scope)
        if isinstance(node, ast.Dict):
            return any(k is None and self._is_env(v, scope) for k, v in zip(node.keys, node.values, strict=True))
        return False

    def _resolve(self, node: ast.AST, scope: _Scope) -> list[str]:
        """The variable names an argument can be (empty: a parameter of the enclosing function)."""
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            return [node.value.decode() if isinstance(node.value, bytes) else node.value]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "_env":
            return [str(getattr(_env, node.attr))]
        if isinstance(node, ast.Name):
            if (items := scope.loop(node.id)) is not None:
                return [n for item in items for n in self._resolve(item, scope)]
            value = self.constant(node.id)
            if isinstance(value, str):
                return [value]
            if scope.find("params", node.id):
                return []  # int_env(name, ...): the callers' names are the reads
        raise AssertionError(f"{self.rel}:{getattr(node, 'lineno', '?')}: an environment read this test "
                             f"cannot resolve: {ast.unparse(node)}")

    # -- walking ---------------------------------------------------------------------------------
    def _walk(self, body: list[ast.stmt], scope: _Scope) -> None:
        nodes = list(_scope_nodes(body))
        for node in nodes:  # bindings first: a name bound anywhere in a function is bound in all of it
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                if self._is_environ(node.value, scope):
                    scope.aliases.update(names)
                    self._consumed.add(id(node.value))
                elif self._copy_of_environ(node.value, scope):
                    scope.copies.update(names)
            elif (isinstance(node, ast.For) and isinstance(node.target, ast.Name)
                  and isinstance(node.iter, (ast.Tuple, ast.List))):
                scope.loops[node.target.id] = list(node.iter.elts)
        for node in sorted(nodes, key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
            self._visit(node, scope)
        for node in nodes:
            if self._is_environ(node, scope) and id(node) not in self._consumed \
                    and not isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del)):
                self.whole.setdefault(f"{self.rel}::{scope.qualname}", []).append(node.lineno)  # type: ignore[attr-defined]
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                self._enter(node, scope)

    def _enter(self, fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef, scope: _Scope) -> None:
        params: set[str] = set()
        if not isinstance(fn, ast.ClassDef):
            a = fn.args
            params = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p is not None}
        name = fn.name if not isinstance(fn, ast.Lambda) else "<lambda>"
        qual = name if scope.qualname == "<module>" else f"{scope.qualname}.{name}"
        body = fn.body if not isinstance(fn, ast.Lambda) else [ast.Expr(fn.body)]
        self._walk(body, _Scope(scope, qual, params))

    def _read(self, arg: ast.AST, node: ast.AST, scope: _Scope) -> None:
        for name in self._resolve(arg, scope):
            self.names.setdefault(name, []).append(node.lineno)  # type: ignore[attr-defined]

    def _visit(self, node: ast.AST, scope: _Scope) -> None:
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in ("read", "read_job") and node.args
                    and self._is_env(node.args[0], scope) and ast.unparse(f.value) in ("TrialEnv", "_env.TrialEnv")):
                self._consumed.add(id(node.args[0]))  # TrialEnv.read(os.environ, ...): its names, not the whole
                read = _env.TrialEnv.JOB_NAMES if f.attr == "read_job" else TRIAL_ENV_READ
                for name in read:
                    self.names.setdefault(name, []).append(node.lineno)
                    self.typed.setdefault(name, []).append(node.lineno)
            elif isinstance(f, ast.Attribute) and self._is_env(f.value, scope):
                self._consumed.add(id(f.value))
                if f.attr in NAME_METHODS and node.args:
                    self._read(node.args[0], node, scope)
                elif f.attr not in WRITE_METHODS and self._is_environ(f.value, scope):
                    self._consumed.discard(id(f.value))  # .items(), .keys(), .copy(): the whole environment
            elif ((isinstance(f, ast.Attribute) and f.attr == "getenv"
                   and isinstance(f.value, ast.Name) and f.value.id in self.os_names)
                  or (isinstance(f, ast.Name) and f.id in self.getenv_names)) and node.args:
                self._read(node.args[0], node, scope)
        elif isinstance(node, ast.Subscript) and self._is_env(node.value, scope):
            self._consumed.add(id(node.value))
            if isinstance(node.ctx, ast.Load):
                self._read(node.slice, node, scope)
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                if isinstance(op, (ast.In, ast.NotIn)) and self._is_env(operands[i + 1], scope):
                    self._consumed.add(id(operands[i + 1]))
                    self._read(operands[i], node, scope)


def _module_constants(source: str) -> dict[str, object]:
    """``NAME = "literal"`` at a module's top level."""
    out: dict[str, object] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            out.update((t.id, node.value.value) for t in node.targets if isinstance(t, ast.Name))
    return out


def _files(root: Path, package: str) -> Iterator[tuple[str, EnvReads]]:
    """``(path, its reads)`` of each source under ``root``."""
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        source = path.read_text()
        constants = _module_constants(source)
        module = ".".join((package, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")

        def constant(name: str, constants: dict[str, object] = constants, module: str = module) -> object:
            if name in constants:
                return constants[name]
            try:  # a name imported from elsewhere (only the real package is importable)
                return getattr(importlib.import_module(module), name, None)
            except ImportError:
                return None

        yield rel, EnvReads(source, rel, constant)


def scan(root: Path, package: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """``(variable -> path:line of each read, path::function -> path:line of each whole read)``."""
    names: dict[str, list[str]] = {}
    whole: dict[str, list[str]] = {}
    for rel, found in _files(root, package):
        for name, lines in found.names.items():
            names.setdefault(name, []).extend(f"{rel}:{n}" for n in lines)
        for site, lines in found.whole.items():
            whole.setdefault(site, []).extend(f"{rel}:{n}" for n in lines)
    return names, whole


def direct_reads(root: Path, package: str, *, under: str, prefix: str) -> dict[tuple[str, str], list[int]]:
    """``(path, variable) -> lines`` of each read under folder ``under`` of a variable named
    ``prefix...`` other than through ``TrialEnv.read`` / ``read_job``."""
    out: dict[tuple[str, str], list[int]] = {}
    for rel, found in _files(root, package):
        if not rel.startswith(f"{under}/"):
            continue
        for name, lines in found.names.items():
            typed = list(found.typed.get(name, []))
            for line in lines:
                if line in typed:
                    typed.remove(line)
                elif name.startswith(prefix):
                    out.setdefault((rel, name), []).append(line)
    return out


def env_reads() -> dict[str, list[str]]:
    """Variable -> ``path:line`` of each read in the package."""
    return scan(ROOT, "autobalance")[0]


def test_every_environment_read_is_accounted_for():
    """Fails if a new AUTOBALANCE_TEST_* switch is read with `in os.environ` (or ``not in``,
    ``.get``, ``.pop``, ``.setdefault``, ``[...]``, ``os.getenv``, through an alias or a copy of the
    environment): the package reads a variable not in READS; or if READS lists one it no longer
    reads; or if a new read of the whole environment (``dict(os.environ)``, ``os.environ.copy()``,
    ``.items()``, ``.keys()``) is not in WHOLE_READS with its reason."""
    found, whole = scan(ROOT, "autobalance")
    assert sorted(set(found) - set(READS)) == [], {k: found[k] for k in set(found) - set(READS)}
    assert sorted(set(READS) - set(found)) == []
    assert not [name for name in found if "TEST" in name]
    assert sorted(set(whole) - set(WHOLE_READS)) == [], {k: whole[k] for k in set(whole) - set(WHOLE_READS)}
    assert sorted(set(WHOLE_READS) - set(whole)) == []


PLANTED = '''\
import os
import os as _os
from os import environ as E, getenv as ge

FLAG = "AB_CONST"


def reads(name):
    if "AB_IN" in os.environ:
        pass
    if "AB_NOT_IN" not in os.environ:
        pass
    os.environ.setdefault("AB_SETDEFAULT", "1")
    os.environ.pop("AB_POP", None)
    os.environ["AB_SUBSCRIPT"]
    os.getenv("AB_GETENV")
    ge("AB_GETENV_IMPORTED")
    _os.environ.get("AB_OS_ALIAS")
    E.get("AB_FROM_OS")
    os.environ.get(FLAG)
    os.environ.get(name)           # a parameter: its callers' names are the reads
    env = os.environ
    env.get("AB_ALIAS_GET")
    if "AB_ALIAS_IN" in env:
        pass
    copied = dict(os.environ)
    copied.get("AB_COPY_GET")
    for var in ("AB_LOOP_1", "AB_LOOP_2"):
        os.environ.get(var)
    os.environ["AB_WRITTEN"] = "1"  # writes are not reads
    os.environ.update({"AB_UPDATED": "1"})


def whole_items():
    return list(os.environ.items())


def whole_keys():
    return [k for k in os.environ.keys() if k.startswith("AB_")]


def whole_copy():
    return os.environ.copy()


def whole_dict():
    return dict(os.environ)


def whole_alias():
    env = os.environ
    return {**env}


def not_environ():
    environ = [b"AB_PROC=1"]      # another process's /proc/PID/environ, not this one's
    return b"x" in environ
'''


def test_checker_finds_planted_reads(tmp_path: Path):
    """Each form of reading the environment the checker claims to find, planted in a source, is
    found: fails if the detector misses ``in`` / ``not in``, ``setdefault``, an alias, a copy, an
    ``os`` imported under another name, or a whole-environment read (``.items()``, ``.keys()``,
    ``.copy()``, ``dict(os.environ)``, ``{**env}``)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "_planted.py").write_text(PLANTED)
    found, whole = scan(tmp_path / "pkg", "planted_pkg")
    assert sorted(found) == sorted([
        "AB_IN", "AB_NOT_IN", "AB_SETDEFAULT", "AB_POP", "AB_SUBSCRIPT", "AB_GETENV", "AB_GETENV_IMPORTED",
        "AB_OS_ALIAS", "AB_FROM_OS", "AB_CONST", "AB_ALIAS_GET", "AB_ALIAS_IN", "AB_COPY_GET",
        "AB_LOOP_1", "AB_LOOP_2"])
    assert found["AB_IN"] == ["_planted.py:9"] and found["AB_NOT_IN"] == ["_planted.py:11"]
    assert sorted(whole) == sorted(f"_planted.py::{f}" for f in (
        "reads", "whole_items", "whole_keys", "whole_copy", "whole_dict", "whole_alias"))
    assert whole["_planted.py::reads"] == ["_planted.py:26"]  # dict(os.environ), not the alias nor the writes


def test_checker_fails_on_a_name_it_cannot_resolve(tmp_path: Path):
    """Fails if a read whose name the checker cannot work out (an f-string, a call) passes unseen."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text('import os\nx = "AB_" + "TEST"\nif f"{x}" in os.environ:\n    pass\n')
    with pytest.raises(AssertionError, match=r"m.py:3: an environment read this test cannot resolve"):
        scan(tmp_path / "pkg", "planted_pkg")


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


def test_checker_counts_trial_env_read_as_its_names(tmp_path: Path):
    """Fails if ``TrialEnv.read(os.environ, ...)`` or ``TrialEnv.read_job(os.environ)`` is taken for a
    read of the whole environment, or for no read at all: they read the names of ``TrialEnv.NAMES``
    and ``JOB_NAMES``, and ``JOB_NAMES`` alone."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("import os\nfrom autobalance import _env\n\n\ndef f():\n"
                                           "    return _env.TrialEnv.read(os.environ, rank=0)\n")
    (tmp_path / "pkg" / "n.py").write_text("import os\nfrom autobalance._env import TrialEnv\n\n\ndef g():\n"
                                           "    return TrialEnv.read_job(os.environ).device\n")
    found, whole = scan(tmp_path / "pkg", "planted_pkg")
    assert sorted(found) == sorted(TRIAL_ENV_READ) and whole == {}
    assert found[_env.STEPS] == ["m.py:6"] and found[_env.DEVICE] == ["m.py:6", "n.py:6"]


RUNTIME_PLANTED = '''\
import os

from autobalance import _env


def f(rank):
    trial = _env.TrialEnv.read(os.environ, rank=rank)
    backend = os.environ.get("AUTOBALANCE_COMPILE_BACKEND")   # a new direct read: fails
    local = int(os.environ.get("LOCAL_RANK", "0"))             # torchrun's: not the rule's
    return trial, backend, local, _env.TrialEnv.read_job(os.environ).warm
'''


def test_the_runtime_reads_its_variables_through_trial_env():
    """Fails if ``autobalance/runtime/`` reads an ``AUTOBALANCE_*`` variable other than through
    ``TrialEnv.read`` / ``read_job`` (issue 32) where ``RUNTIME_DIRECT`` does not say why, or if an
    entry of ``RUNTIME_DIRECT`` is no longer read there."""
    direct = direct_reads(ROOT, "autobalance", under="runtime", prefix="AUTOBALANCE_")
    assert sorted(set(direct) - set(RUNTIME_DIRECT)) == [], {k: direct[k] for k in set(direct) - set(RUNTIME_DIRECT)}
    assert sorted(set(RUNTIME_DIRECT) - set(direct)) == []


def test_checker_finds_a_planted_direct_runtime_read(tmp_path: Path):
    """The rule above sees a direct read of an ``AUTOBALANCE_*`` variable in the runtime beside the
    typed reads, and only in the runtime."""
    (tmp_path / "pkg" / "runtime").mkdir(parents=True)
    (tmp_path / "pkg" / "runtime" / "_m.py").write_text(RUNTIME_PLANTED)
    (tmp_path / "pkg" / "_other.py").write_text('import os\nos.environ.get("AUTOBALANCE_ELSEWHERE")\n')
    direct = direct_reads(tmp_path / "pkg", "planted_pkg", under="runtime", prefix="AUTOBALANCE_")
    assert direct == {("runtime/_m.py", _env.COMPILE_BACKEND): [8]}


class _Recording(dict):
    """An environment that notes each variable looked up in it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: set[str] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.asked.add(key)
        return super().__contains__(key)


def test_trial_env_read_reads_only_its_names():
    """Fails if ``TrialEnv.read`` looks up a variable outside ``TrialEnv.NAMES`` and ``JOB_NAMES``, or
    ``read_job`` one outside ``JOB_NAMES`` (the checker above counts them as reading exactly those)."""
    env = _Recording(_env.TrialEnv(trial_dir="/t", config_json="{}", global_batch=8, measure_s=2.0,
                                   memory_cap_bytes=(1, 2)).to_env(), AUTOBALANCE_STUDY="s")
    _env.TrialEnv.read(env, rank=1)
    assert env.asked <= set(TRIAL_ENV_READ)
    job = _Recording(env)
    _env.TrialEnv.read_job(job)
    assert job.asked == set(_env.TrialEnv.JOB_NAMES)


def test_trial_env_read_inverts_to_env_and_applies_the_defaults():
    """Fails if ``TrialEnv.read`` does not give back what ``to_env`` wrote (as ``from_env`` does), if an
    absent or empty variable does not take today's default, if a production job (no trial directory)
    takes a configuration or a global batch from the environment, or if a malformed variable's error
    is not today's (``UsageError`` naming it; a global batch: ``ValueError``)."""
    trial = _env.TrialEnv(trial_dir="/t", config_json='{"a": 1}', global_batch=96, steps=5, warmup=2,
                          measure_s=1.5, max_steps=40, memory_cap_bytes=(100, 200))
    assert _env.TrialEnv.read(trial.to_env(), rank=1) == trial == _env.TrialEnv.from_env(trial.to_env())
    assert trial.cap_for(1) == 200 and _env.TrialEnv(trial_dir="/t", memory_cap_bytes=(7,)).cap_for(3) == 7
    assert _env.TrialEnv.read({}, rank=0) == _env.TrialEnv(trial_dir="")
    empty = dict.fromkeys(_env.TrialEnv.NAMES, "")
    assert _env.TrialEnv.read(empty, rank=0) == _env.TrialEnv(trial_dir="")
    production = {**trial.to_env(), _env.TRIAL_DIR: "", _env.MEMORY_CAP_BYTES: " 1e9 "}
    read = _env.TrialEnv.read(production, rank=3)
    assert (read.trial_dir, read.config_json, read.global_batch) == ("", None, None)
    assert read.cap_for(3) == 10**9 and read.steps == 5
    with pytest.raises(UsageError, match=r"^AUTOBALANCE_STEPS='x' is not an integer; set it to a whole number\.$"):
        _env.TrialEnv.read({_env.STEPS: "x"}, rank=0)
    with pytest.raises(UsageError, match=r"^AUTOBALANCE_MEASURE_S='-1' must be a finite number >= 0"):
        _env.TrialEnv.read({_env.MEASURE_S: "-1"}, rank=0)
    with pytest.raises(UsageError, match=r"^AUTOBALANCE_MEASURE_S='s' is not a number; set it to seconds"):
        _env.TrialEnv.read({_env.MEASURE_S: "s"}, rank=0)
    with pytest.raises(UsageError, match=r"^AUTOBALANCE_MEMORY_CAP_BYTES='a' is not a byte count or a "
                                         r"comma-separated list of them\.$"):
        _env.TrialEnv.read({_env.MEMORY_CAP_BYTES: "a"}, rank=0)
    with pytest.raises(UsageError, match=r"^AUTOBALANCE_MEMORY_CAP_BYTES='1,2' has 2 entries but this is rank 2; "
                                         r"give one cap per rank\.$"):
        _env.TrialEnv.read({_env.MEMORY_CAP_BYTES: "1,2"}, rank=2)
    with pytest.raises(ValueError, match="invalid literal for int"):
        _env.TrialEnv.read({_env.TRIAL_DIR: "/t", _env.GLOBAL_BATCH: "many"}, rank=0)


def test_the_job_variables_round_trip_and_read_as_today():
    """Fails if a job variable of ``TrialEnv`` (trial id, device, warm, pool directory, diagnose, the
    emulations, the compile backend) is not given back by ``from_env``, ``read`` and ``read_job`` as
    ``to_env`` wrote it, if ``to_env`` writes one that is not set (the launcher's trials carry only
    ``NAMES``), or if a value is read otherwise than the runtime read it directly: as set, the two
    flags only when ``1``, and ``read_job`` never raising on the trial's own variables."""
    job = dict(trial_id="abc", device="cuda", warm=True, pool_dir="/p", diagnose=True,
               emulate_ms_per_sample="0,10", emulate_sms="0,64", compile_backend="eager")
    trial = _env.TrialEnv(trial_dir="/t", steps=4, memory_cap_bytes=(5,), **job)
    env = trial.to_env()
    assert set(env) - set(_env.TrialEnv.NAMES) == set(_env.TrialEnv.JOB_NAMES)
    assert env[_env.WARM] == env[_env.DIAGNOSE] == "1" and env[_env.TRIAL_ID] == "abc"
    assert _env.TrialEnv.from_env(env) == trial == _env.TrialEnv.read(env, rank=1)
    assert _env.TrialEnv.read_job(env) == _env.TrialEnv(trial_dir="", **job)
    assert set(_env.TrialEnv(trial_dir="/t").to_env()) <= set(_env.TrialEnv.NAMES)
    assert _env.TrialEnv.read_job({}) == _env.TrialEnv(trial_dir="") == _env.TrialEnv.read({}, rank=0)
    as_set = _env.TrialEnv.read_job({_env.WARM: "true", _env.DIAGNOSE: "yes", _env.DEVICE: "",
                                     _env.COMPILE_BACKEND: "", _env.TRIAL_ID: "", _env.STEPS: "x",
                                     _env.MEMORY_CAP_BYTES: "a", _env.EMULATE_SMS: "half"})
    assert (as_set.warm, as_set.diagnose, as_set.device, as_set.compile_backend, as_set.trial_id) == \
        (False, False, "", "", "")
    assert as_set.emulate_sms == "half" and as_set.steps == 3 and as_set.memory_cap_bytes is None


def test_the_plan_takes_the_job_variables_from_its_read(monkeypatch: pytest.MonkeyPatch):
    """Fails if ``plan()`` does not hand the variables it read to the parts that used to read them
    (the trial id, the emulated slow rank, the compile backend, diagnose, warm)."""
    from autobalance.runtime._compile import DEFAULT_BACKEND, CompileState

    for name in (*TRIAL_ENV_READ, "RANK", "WORLD_SIZE", "LOCAL_RANK", _env.STUDY, _env.CONFIG_FILE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(_env.TRIAL_ID, "tid")
    monkeypatch.setenv(_env.EMULATE_MS_PER_SAMPLE, "7")
    monkeypatch.setenv(_env.COMPILE_BACKEND, "eager")
    plan = autobalance.plan(micro_batch=2, device="cpu")
    assert plan.trial == _env.TrialEnv(trial_dir="", trial_id="tid", emulate_ms_per_sample="7", compile_backend="eager")
    assert plan.trial_id == "tid" and plan.slow_rank is not None and plan.slow_rank.ms_per_sample == 7
    assert CompileState(mode="default", budget=None, backend=plan.trial.compile_backend).backend == "eager"
    assert CompileState(mode="default", budget=None, backend="").backend == DEFAULT_BACKEND
