"""A storage URL that is wrong, unreachable or read-only (issue matrix 8): one line on stderr
that names ``--storage`` and the (masked) URL, before any trial starts: no torchrun is launched and
no trial directory is made. A wrong URL is a usage error (exit code 2); a storage that cannot be
reached or written is a run failure (exit code 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tests.faults.conftest import (
    assert_kept,
    assert_no_processes,
    complete_trials,
    one_line,
    tune,
)


def _fails_before_any_trial(tmp_path: Path, url: str, *words: str, code: int = 1) -> str:
    proc = tune(url, cwd=tmp_path, trials=2, timeout=30)
    assert proc.returncode == code, proc.stderr[-3000:]
    line = one_line(proc.stderr)
    assert line.startswith("autobalance: error: --storage")
    for word in words:
        assert word in line, line
    assert not (tmp_path / "autobalance_runs").exists()  # no trial directory: nothing was launched
    assert_no_processes(tmp_path, within=0)
    return line


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("nosuchdb://x", ["nosuchdb://x", "unknown database or driver"]),
        ("sqlite:////no/such/directory/study.db", ["/no/such/directory", "does not exist"]),
        ("autobalance.db.txt", ["not a SQLAlchemy URL"]),
    ],
    ids=["unknown-scheme", "missing-directory", "not-a-url"],
)
def test_wrong_storage_url(tmp_path: Path, url: str, words: list[str]) -> None:
    _fails_before_any_trial(tmp_path, url, *words, code=2)


def test_unreachable_postgres(tmp_path: Path) -> None:
    """Nothing listens on port 1: the connection is refused (PostgreSQL down)."""
    _fails_before_any_trial(tmp_path, "postgresql+psycopg://postgres@127.0.0.1:1/test", "127.0.0.1:1",
                            "check that the server is running")


@pytest.mark.slow  # the seeded study runs a baseline trial
def test_read_only_sqlite(tmp_path: Path, seeded: str) -> None:
    """A database opened read-only (as a read-only mount or file would be)."""
    before = complete_trials(seeded)
    path = make_url(seeded).database
    _fails_before_any_trial(tmp_path, f"sqlite:///file:{path}?mode=ro&uri=true", "readonly",
                            "use a storage this user can write to")
    assert_kept(before, seeded)


@pytest.mark.postgres
def test_read_only_postgres(tmp_path: Path, postgres_server: str) -> None:
    url = make_url(postgres_server).update_query_dict({"options": "-cdefault_transaction_read_only=on"})
    _fails_before_any_trial(tmp_path, url.render_as_string(hide_password=False), "read-only transaction",
                            "use a storage this user can write to")


@pytest.mark.postgres
def test_wrong_postgres_database(tmp_path: Path, postgres_server: str) -> None:
    url = make_url(postgres_server).set(database="autobalance_no_such_database")
    _fails_before_any_trial(tmp_path, url.render_as_string(hide_password=False), "autobalance_no_such_database")
