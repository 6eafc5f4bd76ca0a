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
