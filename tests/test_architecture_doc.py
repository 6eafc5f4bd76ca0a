"""``docs/architecture.md`` stays true where a test can tell (issue 32): its drawing of the rooms'
arrows is the layering test's ``ALLOWED``, and every module of ``autobalance/tuner`` and
``autobalance/tuner/search`` is named in it."""

from __future__ import annotations

import re

from tests.test_layering import ALLOWED, FLOOR, PKG, ROOT

DOC = (ROOT / "docs" / "architecture.md").read_text()
ARROW = re.compile(r"^(\w+) ─*► (.+)$")


def drawn_arrows() -> dict[str, set[str]]:
    """``room -> the rooms it may import`` from the drawing (the floor and ``protocol`` implied above
    ``launcher``)."""
    block = DOC.split("```\ncli ─")[1].split("```")[0]
    arrows: dict[str, set[str]] = {"protocol": set()}
    for line in ("cli ─" + block).splitlines():
        match = ARROW.match(line)
        if match:
            arrows[match[1]] = {name.strip() for name in match[2].split(",")}
    for room, targets in arrows.items():
        if room not in ("launcher", "store", FLOOR, "protocol"):
            targets |= {FLOOR, "protocol"}
    return arrows


def test_the_drawing_is_the_layering_tests_arrows():
    assert drawn_arrows() == ALLOWED


def test_every_tuner_module_is_named():
    modules = [p for d in ("tuner", "tuner/search") for p in sorted((ROOT / PKG / d).glob("_*.py"))
               if p.name != "__init__.py"]
    assert len(modules) > 20
    missing = [str(p.relative_to(ROOT)) for p in modules if f"`{p.stem}`" not in DOC and f"`{p.name}`" not in DOC
               and f"`{p.stem}." not in DOC and f"/{p.stem}." not in DOC]
    assert missing == []


def test_the_model_phase_path_names_what_the_code_has():
    """The ``model`` phase's path written out in the doc names functions and methods that exist, in
    the files it says (``Class.method`` in backticks: a class of that file; ``_file.py``: a file of
    ``tuner/`` or ``tuner/search/``)."""
    import importlib

    section = DOC.split("**One `model`-phase decision")[1].split("\n## ")[0]
    files = re.findall(r"`(_\w+\.py)`", section)
    assert len(files) >= 5
    where = {}
    for name in dict.fromkeys(files):
        paths = [p for d in ("tuner", "tuner/search") if (p := ROOT / PKG / d / name).exists()]
        assert paths, name
        where[name] = ".".join(paths[0].relative_to(ROOT).with_suffix("").parts)
    modules = [importlib.import_module(m) for m in where.values()]
    named = re.findall(r"`([A-Z]\w+)\.(\w+)", section)
    assert len(named) >= 8
    missing = [f"{cls}.{attr}" for cls, attr in named
               if not any(hasattr(getattr(m, cls, None), attr) for m in modules)]
    assert missing == [], missing
    functions = [f for f in re.findall(r"`([a-z]\w+)` \(`_", section)]
    assert functions and all(any(hasattr(m, f) for m in modules) for f in functions), functions
