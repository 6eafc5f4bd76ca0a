"""Every numeric constant the search and the time budget decide by lives in one module,
``autobalance/tuner/search/_constants.py``, each with the measurement it comes from: a numeric
module-level constant anywhere else in ``autobalance/tuner`` fails here (a number, an arithmetic of
numbers, or a tuple, list, set or dict of them)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUNER = ROOT / "autobalance" / "tuner"
HOME = TUNER / "search" / "_constants.py"

UNITS = {"_UNIT_BYTES", "_UNIT_S", "GPU_MEMORY_GIB"}
"""Unit conversions and facts, not decisions (``GIB`` is the protocol's, ``protocol._units``): ``_settings``' byte and duration units
and the memory the GPUs ``--memory-cap`` names report (``_settings`` is imported by ``--help`` without
the search, so it cannot read ``_constants``). Every other numeric module constant of ``tuner/`` lives in
``_constants``."""
ELSEWHERE: dict[str, set[str]] = {}
"""Not moved yet, by name (a new one fails): none."""


def _numeric(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_numeric(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return bool(node.values) and all(_numeric(v) for v in node.values)
    return False


def numeric_constants(path: Path) -> list[str]:
    """The module-level names of ``path`` bound to a numeric value."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if _numeric(value):
            out += [t.id for t in targets if isinstance(t, ast.Name)]
    return out


def test_no_numeric_constant_outside_the_constants_module():
    found = {}
    for path in sorted(TUNER.rglob("*.py")):
        if path == HOME:
            continue
        rel = str(path.relative_to(TUNER))
        names = [n for n in numeric_constants(path) if n not in UNITS and n not in ELSEWHERE.get(rel, set())]
        if names:
            found[rel] = names
    assert found == {}, f"move these to {HOME.relative_to(ROOT)}, with the measurement each comes from: {found}"


def test_the_finder_sees_what_it_must(tmp_path: Path):
    """The finder flags numbers, arithmetic and containers of numbers, not strings, names or flags."""
    sample = tmp_path / "sample.py"
    sample.write_text("A = 3\nB: float = 0.5\nC = 7 / 3\nD = (0.22, 0.30)\nE = {'cuda': 45.0}\nF = {'x': {'y': 1.0}}\n"
                      "G = 'text'\nH = A\nI = ('a', 'b')\nJ = -1\nK = True\n")
    assert numeric_constants(sample) == ["A", "B", "C", "D", "E", "F", "J"]


def test_every_constant_in_the_home_is_documented():
    """Each constant of ``_constants`` carries a docstring (the measurement it comes from)."""
    body = ast.parse(HOME.read_text()).body
    undocumented = []
    for i, node in enumerate(body):
        if isinstance(node, ast.Assign) and _numeric(node.value):
            nxt = body[i + 1] if i + 1 < len(body) else None
            if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                undocumented += [t.id for t in node.targets if isinstance(t, ast.Name)]
    assert undocumented == []
    assert len(numeric_constants(HOME)) >= 30
