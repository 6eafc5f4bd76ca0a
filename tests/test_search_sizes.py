"""The search stays readable: no class in ``tuner/search`` over 300 lines, the advisor (the Optuna glue
left of the decision path) under 150 (fast; reads the source, imports nothing)."""

from __future__ import annotations

import ast
from pathlib import Path

SEARCH = Path(__file__).resolve().parents[1] / "autobalance" / "tuner" / "search"


def class_lengths(root: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out[f"{path.name}:{node.name}"] = (node.end_lineno or node.lineno) - node.lineno + 1
    return out


def test_no_class_of_the_search_is_over_300_lines_and_the_advisor_is_under_150() -> None:
    lengths = class_lengths(SEARCH)
    assert lengths, "no class found: the search moved?"
    assert {k: v for k, v in lengths.items() if v > 300} == {}
    assert lengths["_policy.py:ModelAdvisor"] < 150


def test_the_measure_sees_a_long_class(tmp_path: Path) -> None:
    (tmp_path / "big.py").write_text("class Big:\n" + "    x = 1\n" * 301)
    assert class_lengths(tmp_path) == {"big.py:Big": 302}
