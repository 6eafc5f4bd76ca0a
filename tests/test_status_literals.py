"""No status written as a string literal outside ``protocol``: a status is compared, assigned and
keyed as a ``protocol.Status`` member (``Status.OK``, never ``"ok"``), so that renaming or adding a
status is one edit and a typo is an ``AttributeError``, not a comparison that is quietly never true.

The checker walks the package's syntax trees and flags a string literal equal to a ``Status`` value
where it stands for a status:

- compared (``==``, ``!=``, ``in``, ``not in``, alone or in a tuple/list/set) with an expression that
  names a status (a name or attribute containing ``status``, ``TrialAttr.STATUS``, ``.get("status")``);
- assigned to a name or attribute containing ``status``, passed as ``status=``, or the value of a dict
  entry keyed by a status name (``{"status": "ok"}``);
- the keys of a dict literal keyed by statuses (two keys or more, every one a ``Status`` value).
"""

from __future__ import annotations

import ast
from pathlib import Path

from autobalance.protocol import Status

PKG = Path(__file__).resolve().parent.parent / "autobalance"
VALUES = frozenset(s.value for s in Status)


def _names_status(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and "status" in n.id.lower():
            return True
        if isinstance(n, ast.Attribute) and "status" in n.attr.lower():
            return True
        if isinstance(n, ast.Constant) and n.value == "status":
            return True
    return False


def _status_strings(node: ast.AST | None) -> list[ast.Constant]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in VALUES:
        return [node]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [c for e in node.elts for c in _status_strings(e)]
    return []


def _findings(tree: ast.AST) -> list[ast.Constant]:
    found: list[ast.Constant] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, operand in enumerate(operands):
                literals = _status_strings(operand)
                if literals and any(_names_status(o) for j, o in enumerate(operands) if j != i):
                    found += literals
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_names_status(t) for t in targets):
                found += _status_strings(node.value)
        elif isinstance(node, ast.keyword):
            if node.arg is not None and "status" in node.arg.lower():
                found += _status_strings(node.value)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if key is not None and _names_status(key):
                    found += _status_strings(value)
            keys = [k for k in node.keys if k is not None]
            if len(keys) >= 2 and len(keys) == len(node.keys) and all(_status_strings(k) for k in keys):
                found += [k for k in keys if isinstance(k, ast.Constant)]
    return found


def status_literals(root: Path) -> list[str]:
    """``path:line: 'value'`` for every status written as a string literal under ``root`` (a package
    directory), ``protocol`` (where the values are defined) excepted."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts and rel.parts[0] == "protocol":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        out += [f"{rel}:{c.lineno}: {c.value!r}" for c in _findings(tree)]
    return sorted(set(out))


def test_no_status_written_as_a_string_literal_outside_protocol():
    found = status_literals(PKG)
    assert not found, "use protocol.Status, not a string literal:\n" + "\n".join(found)


def test_checker_finds_planted_status_literals(tmp_path):
    root = tmp_path / "autobalance"
    (root / "report").mkdir(parents=True)
    (root / "protocol").mkdir()
    (root / "report" / "_a.py").write_text(
        "def f(r, attrs, row):\n"
        "    if r.status == 'ok':\n"                                  # 2: attribute compared
        "        pass\n"
        "    if attrs.get('status') in ('timeout', 'crash'):\n"       # 4: .get("status") in a tuple
        "        pass\n"
        "    if 'pruned' != row.status:\n"                            # 6: literal on the left
        "        pass\n"
        "    status = 'predicted_oom'\n"                              # 8: assigned
        "    g(status='oom')\n"                                       # 9: keyword
        "    d = {'status': 'stale'}\n"                               # 10: dict entry
        "    colours = {'ok': 'green', 'oom': 'red'}\n"               # 11: keyed by statuses
        "    return d, colours\n"
    )
    (root / "report" / "_fine.py").write_text(
        "from autobalance.protocol import Status\n"
        "def f(r, level, kind):\n"
        "    if r.status == Status.OK or level == 'error' or kind in ('ok', 'oom'):\n"  # not a status
        "        pass\n"
        "    text = 'ok'\n"                                            # not a status name
        "    connect = {'timeout': 60}\n"                              # one key: not a status table
        "    words = {'oom': 'ran out', 'over': 'above the cap'}\n"    # not every key a status
        "    return text, connect, words\n"
    )
    (root / "protocol" / "_status.py").write_text("def f(status):\n    return status == 'ok'\n")  # where they live
    assert status_literals(root) == sorted([
        "report/_a.py:2: 'ok'", "report/_a.py:4: 'timeout'", "report/_a.py:4: 'crash'",
        "report/_a.py:6: 'pruned'", "report/_a.py:8: 'predicted_oom'", "report/_a.py:9: 'oom'",
        "report/_a.py:10: 'stale'", "report/_a.py:11: 'ok'", "report/_a.py:11: 'oom'",
    ])
