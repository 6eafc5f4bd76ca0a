"""No import circle inside ``autobalance/tuner`` (issue 32: ``_loop`` and ``_tuner`` imported each
other). Every import form counts, as in ``tests/test_layering.py`` whose walker this reuses: module
level, inside functions, under ``TYPE_CHECKING``, relative, ``importlib.import_module``. The checker is
tested on a planted tree, so it cannot pass by seeing nothing."""

from __future__ import annotations

from pathlib import Path

from tests.test_layering import PKG, ROOT, circles, module_name, resolve_imports

PACKAGE = f"{PKG}.tuner"


def tuner_circles(root: Path) -> list[list[str]]:
    """One cycle per strongly connected group of modules of ``autobalance.tuner`` (its sub-packages
    included); ``from X import name`` counts as an import of module ``X``."""
    files = sorted((root / PKG).rglob("*.py"))
    known = {module_name(p, root) for p in files}
    edges: dict[str, set[str]] = {}
    for path in files:
        importer = module_name(path, root)
        if not (importer == PACKAGE or importer.startswith(PACKAGE + ".")):
            continue
        for _, target in resolve_imports(path, root, known):
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target != importer and (target == PACKAGE or target.startswith(PACKAGE + ".")):
                edges.setdefault(importer, set()).add(target)
    return circles(edges)


def test_no_import_circle_inside_the_tuner():
    assert tuner_circles(ROOT) == []


def test_checker_finds_planted_circles(tmp_path: Path):
    files = {
        "__init__.py": "",
        "tuner/__init__.py": "",
        "tuner/_loop.py": "from autobalance.tuner._launching import Stopped\n",
        "tuner/_launching.py": "def launch():\n    from . import _loop\n",  # inside a function, relative
        "tuner/_a.py": "import typing\nif typing.TYPE_CHECKING:\n    from autobalance.tuner.search._b import B\n",
        "tuner/search/__init__.py": "",
        "tuner/search/_b.py": "import importlib\nX = importlib.import_module('autobalance.tuner._a')\n",
        "tuner/_fine.py": "from autobalance.tuner import _loop\n",  # one way only: no circle
        "launcher/__init__.py": "from autobalance.tuner import _fine\n",  # outside the tuner: not its business
    }
    for rel, text in files.items():
        path = tmp_path / PKG / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    found = {frozenset(c) for c in tuner_circles(tmp_path)}
    assert found == {frozenset({"autobalance.tuner._loop", "autobalance.tuner._launching"}),
                     frozenset({"autobalance.tuner._a", "autobalance.tuner.search._b"})}
