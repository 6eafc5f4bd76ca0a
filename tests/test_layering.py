"""The rooms' one-way arrows (docs/architecture.md), checked on every import in the package:
``import a.b``, ``from a import b``, relative imports, ``from autobalance import tuner``, imports
inside functions and under ``TYPE_CHECKING``, and ``importlib.import_module("...")``.

- a room imports only the rooms it may (``ALLOWED``): no circle between rooms is possible;
- no module imports another package's private module or name (``autobalance.launcher._warm`` from outside
  ``autobalance.launcher``): rooms talk through their ``__init__``;
- the checker itself is tested on a planted tree, so it cannot pass by seeing nothing.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "autobalance"

FLOOR = "floor"
"""``autobalance._config``, ``_env``, ``_errors``, ``_files``: small modules every room may use."""

ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    FLOOR: {"protocol"},
    "store": {FLOOR, "protocol"},
    "runtime": {FLOOR, "protocol", "store"},
    "integrations": {FLOOR, "protocol", "store", "runtime"},
    "launcher": {FLOOR, "protocol"},
    "report": {FLOOR, "protocol", "store"},
    "diagnose": {FLOOR, "protocol", "launcher"},
    "verify": {FLOOR, "protocol", "launcher"},
    "tuner": {FLOOR, "protocol", "store", "launcher", "report", "verify"},
    "cli": {FLOOR, "protocol", "store", "runtime", "launcher", "report", "diagnose", "verify", "tuner"},
}
"""What each room may import. ``autobalance/__init__.py`` (``autobalance.plan`` -> runtime) and
``__main__.py`` (-> cli) are the doors, not rooms."""

DOORS = {f"{PKG}", f"{PKG}.__main__"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def resolve_imports(path: Path, root: Path, known: set[str]) -> list[tuple[int, str]]:
    """``(line, absolute module)`` for every import in ``path``; ``from X import y`` gives ``X.y``
    when that is a module of the tree or a private name (``from X import _helper`` reaches past
    ``X``'s ``__all__`` as much as importing a private module does), else ``X``."""
    name = module_name(path, root)
    package = name if is_package(path) else name.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, node.module] if node.module else base_parts)
            else:
                base = node.module or ""
            for alias in node.names:
                full = f"{base}.{alias.name}"
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                out.append((node.lineno, full if full in known or private else base))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.lineno, node.args[0].value))
    return out


def room_of(module: str) -> str | None:
    """The room of a module of the package (None: not ours, or a door)."""
    if module in DOORS or not (module == PKG or module.startswith(PKG + ".")):
        return None
    first = module.split(".")[1]
    return FLOOR if first.startswith("_") else first


def private_step(module: str) -> str | None:
    """The package whose private module ``module`` is (``a.b._c.d`` -> ``a.b``), else None."""
    parts = module.split(".")
    for i in range(2, len(parts)):
        if parts[i].startswith("_") and not parts[i].startswith("__"):
            return ".".join(parts[:i])
    return None


def violations(root: Path, allowed: dict[str, set[str]] = ALLOWED) -> list[str]:
    files = sorted((root / PKG).rglob("*.py"))
    known = {module_name(p, root) for p in files}
    found: list[str] = []
    edges: dict[str, set[str]] = {}
    for path in files:
        importer = module_name(path, root)
        src_room = room_of(importer)
        where = f"{path.relative_to(root)}"
        for line, target in resolve_imports(path, root, known):
            dst_room = room_of(target)
            if dst_room is None:
                continue
            owner = private_step(target)
            if owner is not None and owner != PKG and not (importer == owner or importer.startswith(owner + ".")):
                found.append(f"{where}:{line} imports {target}, a private module or name of {owner}")
            if src_room is None or dst_room == src_room:
                continue
            edges.setdefault(src_room, set()).add(dst_room)
            if dst_room not in allowed.get(src_room, set()):
                found.append(f"{where}:{line} imports {target}: {src_room} may not import {dst_room}")
    found.extend(f"import circle between rooms: {' -> '.join(c)}" for c in circles(edges))
    return found


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of rooms (depth-first search)."""
    out: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                out.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return out


def test_rooms_import_only_downward_and_no_private_modules_of_other_packages():
    """Fails if any module of the package imports against the arrows, in any form: e.g. a lazy
    ``from autobalance import tuner`` or a relative ``from ..tuner import _study`` inside runtime."""
    assert violations(ROOT) == []


def test_allowed_arrows_have_no_circle():
    assert circles({room: {d for d in deps if d in ALLOWED} for room, deps in ALLOWED.items()}) == []


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / PKG / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for d in [p for p in (tmp_path / PKG).rglob("*") if p.is_dir()] + [tmp_path / PKG]:
        (d / "__init__.py").touch()
    return tmp_path


def test_checker_finds_planted_violations(tmp_path):
    """Each import form the test claims to resolve, planted as a violation, is found: fails if the
    checker misses a lazy or relative import, ``from autobalance import tuner``, an
    ``importlib.import_module`` string, a private name or a circle between rooms."""
    root = _plant(tmp_path, {
        "runtime/_a.py": "def f():\n    from autobalance import tuner\n",          # lazy, from-package form
        "runtime/_b.py": "from ..tuner import _study\n",                           # relative, private
        "launcher/_c.py": "import autobalance.tuner._loop\n",                      # plain import, private
        "report/_d.py": "import importlib\nimportlib.import_module('autobalance.tuner')\n",
        "tuner/_study.py": "", "tuner/_loop.py": "",
        "store/_e.py": "from autobalance.runtime import x\n",                      # store -> runtime ...
        "runtime/_f.py": "from autobalance.store import y\n",                      # ... and back: a circle
        "report/_g.py": "from autobalance.store import _secret\n",                   # a private name, not a module
        "tuner/_ok.py": "from . import _study\nfrom autobalance.tuner._loop import z\n",  # own privates: fine
    })
    found = "\n".join(violations(root))
    assert "runtime/_a.py:2 imports autobalance.tuner: runtime may not import tuner" in found
    assert "runtime/_b.py:1 imports autobalance.tuner._study, a private module or name of autobalance.tuner" in found
    assert "launcher/_c.py:1 imports autobalance.tuner._loop, a private module or name" in found
    assert "report/_d.py:2 imports autobalance.tuner: report may not import tuner" in found
    assert "report/_g.py:1 imports autobalance.store._secret, a private module or name of autobalance.store" in found
    assert "store may not import runtime" in found
    assert "import circle between rooms: runtime -> store -> runtime" in found or \
        "import circle between rooms: store -> runtime -> store" in found
    assert "tuner/_ok.py" not in found


def test_protocol_imports_no_heavy_module():
    """The floor every room stands on: importing it loads neither torch nor optuna."""
    code = ("import sys, autobalance.protocol; "
            "print(sorted(m for m in ('torch', 'optuna', 'sqlalchemy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("room", sorted(set(ALLOWED) - {FLOOR}))
def test_every_room_is_a_package(room):
    assert (ROOT / PKG / room / "__init__.py").is_file()
