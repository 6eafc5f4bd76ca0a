"""The rooms' one-way arrows: the runtime imports nothing from the tuner, launcher, CLI or report;
the launcher nothing from the tuner or CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "autobalance"

FORBIDDEN = {
    "runtime": ("autobalance.tuner", "autobalance.launcher", "autobalance.cli", "autobalance.report"),
    "launcher": ("autobalance.tuner", "autobalance.cli", "autobalance.report"),
    "store": ("autobalance.tuner", "autobalance.launcher", "autobalance.cli", "autobalance.runtime"),
    "report": ("autobalance.tuner", "autobalance.launcher", "autobalance.runtime", "autobalance.cli",
               "autobalance.diagnose"),
    "diagnose": ("autobalance.tuner", "autobalance.cli", "autobalance.report"),
    "protocol": ("autobalance.tuner", "autobalance.launcher", "autobalance.cli", "autobalance.runtime",
                 "autobalance.report", "autobalance.store", "autobalance._"),
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_does_not_import_upstream(room):
    offenders = []
    for path in (PKG / room).rglob("*.py"):
        for name in imported_modules(path):
            if name.startswith(FORBIDDEN[room]):
                offenders.append(f"{path.relative_to(PKG)} imports {name}")
    assert offenders == []


def test_protocol_imports_no_heavy_module():
    """The floor every room stands on: importing it loads neither torch nor optuna."""
    import subprocess
    import sys

    code = ("import sys, autobalance.protocol; "
            "print(sorted(m for m in ('torch', 'optuna', 'sqlalchemy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
