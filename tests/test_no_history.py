"""What a user reads speaks of the product, not of its work history: no issue numbers ("issue 40",
"issues 30 and 34", "#35" after "issue") in the README, the docs, the command line's help, or any
string the package prints (its string constants other than docstrings; comments and docstrings are
for the developers). The check is tested on planted text, so it cannot pass by seeing nothing."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from autobalance.cli import app

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ISSUE = re.compile(r"\bissues? +#?\d+", re.IGNORECASE)


def mentions(text: str) -> list[str]:
    return [m[0] for m in ISSUE.finditer(text)]


def printed_strings(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every string constant in ``source`` that is not a docstring (of a module,
    class or function, or an attribute's docstring right after its assignment); f-strings' parts too."""
    tree = ast.parse(source)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        if (isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
            docstrings.add(id(body[0].value))
        for stmt, following in itertools.pairwise(body):
            if (isinstance(stmt, ast.Assign | ast.AnnAssign) and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)):
                docstrings.add(id(following.value))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_the_check_sees_a_planted_mention():
    assert mentions("## Compile scope (issue 40)") == ["issue 40"]
    assert mentions("as Issue #22 asked, and issues 30") == ["Issue #22", "issues 30"]
    assert mentions("benchmarks/issue40_gpu.sh, tissue 3") == []  # a file's name, another word
    planted = '"""Docstring: issue 7 is fine here."""\nX = 1\n"""About X (issue 8)."""\nprint(f"see issue {n} and issue 9")\n'
    assert [text for _, text in printed_strings(planted) if mentions(text)] == [" and issue 9"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_issue_numbers_in_the_readme_and_docs(page: Path):
    found = [(n, line.strip()) for n, line in enumerate(page.read_text().splitlines(), 1) if mentions(line)]
    assert found == [], f"{page.relative_to(REPO)}: {found}"


def test_no_issue_numbers_in_what_the_package_prints():
    found = []
    for path in sorted((REPO / "autobalance").rglob("*.py")):
        for line, text in printed_strings(path.read_text()):
            if mentions(text):
                found.append(f"{path.relative_to(REPO)}:{line}: {text[:80]!r}")
    assert found == []


def test_no_issue_numbers_in_the_command_line_help():
    runner = CliRunner()
    top = runner.invoke(app, ["--help"])
    assert top.exit_code == 0, top.output
    names = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert {"tune", "best", "trials", "report", "export", "diagnose"} <= set(names), names
    for name in names:
        result = runner.invoke(app, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)
        assert mentions(result.output) == [], (name, mentions(result.output))
    assert mentions(top.output) == []
