"""Never hang and never leak: every child process the package, the benchmarks and the examples start
has a timeout, and its whole tree can be ended.

The rule, checked on the source by AST (``subprocess`` imported under any name, or its functions
imported directly):

- ``subprocess.run`` / ``call`` / ``check_call`` / ``check_output`` pass ``timeout=``;
- ``subprocess.Popen`` passes ``start_new_session=True`` (its caller then ends the group: the
  launcher's ``kill_trial_processes``, ``benchmarks.common.run_tree``), and the file waits with a
  timeout somewhere (``wait(timeout=...)`` / ``communicate(timeout=...)``);
- no ``os.system`` / ``os.popen`` (no timeout possible).

The checker is proved on planted sources, so it cannot pass by seeing nothing. ``run_tree`` itself is
run: a child that leaves a grandchild behind, past its timeout and after a normal exit.
"""

from __future__ import annotations

import ast
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.common import run_tree
from tests.tune_helpers import processes_with

REPO = Path(__file__).resolve().parents[1]
CHECKED = ("autobalance", "benchmarks", "examples")
BOUNDED = {"run", "call", "check_call", "check_output"}


def _problems(source: str, where: str) -> Iterator[str]:
    tree = ast.parse(source)
    modules: set[str] = set()  # names bound to the subprocess module
    direct: dict[str, str] = {}  # local name -> subprocess function
    os_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "subprocess":
                    modules.add(alias.asname or "subprocess")
                if alias.name == "os":
                    os_names.add(alias.asname or "os")
        elif isinstance(node, ast.ImportFrom) and node.module == "subprocess":
            for alias in node.names:
                direct[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in ("system", "popen"):
                    yield f"{where}:{node.lineno}: os.{alias.name} (no timeout): use subprocess with timeout="
    popens: list[int] = []
    waits_bounded = False
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name: str | None = None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in modules:
            name = func.attr
        elif isinstance(func, ast.Name) and func.id in direct:
            name = direct[func.id]
        keywords = {k.arg: k.value for k in node.keywords}
        if isinstance(func, ast.Attribute) and func.attr in ("wait", "communicate") and "timeout" in keywords:
            waits_bounded = True
        if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in os_names
                and func.attr in ("system", "popen")):
            yield f"{where}:{node.lineno}: os.{func.attr} (no timeout): use subprocess with timeout="
        if name in BOUNDED and "timeout" not in keywords:
            yield f"{where}:{node.lineno}: subprocess.{name} without timeout="
        if name == "Popen":
            session = keywords.get("start_new_session")
            if not (isinstance(session, ast.Constant) and session.value is True):
                yield f"{where}:{node.lineno}: subprocess.Popen without start_new_session=True (its tree cannot be ended)"
            popens.append(node.lineno)
    if popens and not waits_bounded:
        yield f"{where}:{popens[0]}: subprocess.Popen, but no wait(timeout=) or communicate(timeout=) in the file"


def _sources() -> Iterator[tuple[str, str]]:
    for top in CHECKED:
        for path in sorted((REPO / top).rglob("*.py")):
            yield path.read_text(), str(path.relative_to(REPO))


def test_every_child_process_has_a_timeout_and_an_endable_tree() -> None:
    seen = 0
    problems: list[str] = []
    for source, where in _sources():
        seen += "subprocess" in source
        problems += _problems(source, where)
    assert seen >= 5  # the launcher, the warm pool, the benchmarks: the scan saw them
    assert problems == []


@pytest.mark.parametrize(("source", "found"), [
    ("import subprocess\nsubprocess.run(['x'])\n", "subprocess.run without timeout="),
    ("import subprocess as sp\nsp.check_output(['x'])\n", "subprocess.check_output without timeout="),
    ("from subprocess import call as c\nc(['x'])\n", "subprocess.call without timeout="),
    ("import subprocess\np = subprocess.Popen(['x'])\np.wait(timeout=5)\n", "without start_new_session=True"),
    ("import subprocess\np = subprocess.Popen(['x'], start_new_session=True)\np.wait()\n", "no wait(timeout=)"),
    ("import os\nos.system('x')\n", "os.system (no timeout)"),
    ("from os import popen\n", "os.popen (no timeout)"),
])
def test_the_checker_finds_planted_problems(source: str, found: str) -> None:
    problems = list(_problems(source, "planted.py"))
    assert len(problems) == 1 and found in problems[0], problems


def test_the_checker_accepts_bounded_calls() -> None:
    source = ("import subprocess\nsubprocess.run(['x'], timeout=3)\n"
              "p = subprocess.Popen(['x'], start_new_session=True)\np.communicate(timeout=9)\n")
    assert list(_problems(source, "ok.py")) == []


def _parent_with_grandchild(marker: str, then: str) -> list[str]:
    """A Python child that starts a sleeping grandchild (named by ``marker``), then runs ``then``."""
    code = (f"import subprocess, sys, time\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', '{marker}'])\n"
            f"{then}\n")
    return [sys.executable, "-c", code]


def _gone(marker: str, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return processes_with(marker) == []


def test_run_tree_ends_the_whole_tree_at_its_timeout(tmp_path: Path) -> None:
    marker = f"ab-run-tree-timeout-{tmp_path.name}"
    done = run_tree(_parent_with_grandchild(marker, "time.sleep(300)"), timeout_s=2, grace_s=2)
    assert done.timed_out and done.returncode is None
    assert "timed out after 2 s" in done.stderr
    assert done.wall_s < 60
    assert _gone(marker)


def test_run_tree_ends_what_a_finished_command_left_behind(tmp_path: Path) -> None:
    marker = f"ab-run-tree-exit-{tmp_path.name}"
    done = run_tree(_parent_with_grandchild(marker, "print('done')"), timeout_s=120)
    assert done.returncode == 0 and done.stdout.strip() == "done"
    assert _gone(marker)
