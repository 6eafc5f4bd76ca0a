"""Fixtures of the fault-injection suite: real ``autobalance tune`` runs (CPU, gloo, 2 ranks) of
``tests/scripts/faulty.py``, a study whose baseline is already recorded, process checks, PostgreSQL.

Every fault test asserts three things: the trial's state and reason, that no process of the trial
remains (:func:`assert_no_processes`: the process table is scanned for the test's tmp dir, which
every trial process carries in its environment), and that no COMPLETE trial was lost
(:func:`complete_trials` before and after).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState

from tests.pg_helpers import throwaway_schema
from tests.services import service_missing
from tests.tune_helpers import FAULTY, processes_with

STUDY = "s"
POSTGRES_ENV = "AUTOBALANCE_TEST_POSTGRES_URL"
POSTGRES_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
TIMEOUT = 90.0
"""--trial-timeout of trials that should succeed (generous: other test runs share the 2 cores)."""
CLI_TIMEOUT = 420.0
"""Wall-clock limit of one ``autobalance`` command in a test (a hung tuner fails the test, not CI)."""

COMMON = ("--nproc-per-node", "2", "--device", "cpu", "--strategy", "optuna", "--seed", "0",
          "--prune-factor", "0", "--steps", "2", "--warmup", "1")
"""Flags of every tune run here; the objective they imply must match the seeded study's."""


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "AB_FAULT_COUNTER": str(tmp_path / "launches"),
            **extra}


def tune_cmd(url: str, *extra: str, trials: int, study: str = STUDY, timeout: float = TIMEOUT,
             script: str = FAULTY) -> list[str]:
    return [sys.executable, "-m", "autobalance", "tune", script, "--trials", str(trials), "--storage", url,
            "--study-name", study, "--trial-timeout", f"{timeout:g}", *COMMON, *extra]


def run_cli(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env or env_for(cwd), timeout=timeout)


def tune(url: str, *extra: str, cwd: Path, trials: int, study: str = STUDY, timeout: float = TIMEOUT,
         env: dict[str, str] | None = None, script: str = FAULTY) -> subprocess.CompletedProcess[str]:
    return run_cli(tune_cmd(url, *extra, trials=trials, study=study, timeout=timeout, script=script), cwd=cwd,
                   env=env)


def sqlite_url(db: Path) -> str:
    return f"sqlite:///{db}"


def load(url: str, study: str = STUDY) -> optuna.Study:
    return optuna.load_study(study_name=study, storage=url)


def complete_trials(url: str, study: str = STUDY) -> dict[int, tuple[float, ...]]:
    """COMPLETE trials by number, with their values: what a fault must never lose or change."""
    try:
        trials = load(url, study).get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    except KeyError:
        return {}
    return {t.number: tuple(t.values) for t in trials}


def assert_kept(before: dict[int, tuple[float, ...]], url: str, study: str = STUDY) -> None:
    after = complete_trials(url, study)
    assert {n: after.get(n) for n in before} == before, "a COMPLETE trial was lost or changed"


def counted(url: str, study: str = STUDY) -> int:
    from autobalance.tuner import Tuner

    return Tuner.counted_trials(load(url, study))


def by_status(url: str, study: str = STUDY) -> dict[str, list[FrozenTrial]]:
    out: dict[str, list[FrozenTrial]] = {}
    for t in load(url, study).get_trials(deepcopy=False):
        out.setdefault(str(t.user_attrs.get("status")), []).append(t)
    return out


def assert_no_processes(marker: Path | str, *, within: float = 20.0) -> None:
    """No live process mentions ``marker`` (the test's tmp dir) in its command line or environment;
    waits up to ``within`` seconds for processes that are being torn down."""
    deadline = time.monotonic() + within
    left = processes_with(str(marker))
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = processes_with(str(marker))
    assert not left, f"processes of the trial outlived it: {_describe(left)}"


def _describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{pid}: {cmdline[:160]}")
        except OSError:
            out.append(str(pid))
    return out


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, f"expected a one-line error, got:\n{stderr}"
    return lines[0]


def copy_db(src: Path, dst: Path) -> None:
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)


# --------------------------------------------------------------------------- the seeded study
@pytest.fixture(scope="session")
def seeded_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite study whose baseline (trial 0, ok) is recorded: made once per run, copied by ``seeded``.

    Under pytest-xdist the workers share it: the first to need it makes it under a file lock in the
    run's common temporary directory, and the other waits for it instead of tuning it again."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "seeded-study"
    db, made = root / "seed.db", root / "made"
    with open(shared / "seeded-study.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():  # not made yet, or a worker's attempt failed: start over
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            proc = tune(sqlite_url(db), cwd=root, trials=1)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert [t.user_attrs["status"] for t in load(sqlite_url(db)).trials] == ["ok"]
            made.touch()
    return db


@pytest.fixture
def seeded(tmp_path: Path, seeded_template: Path) -> str:
    """URL of a private copy of the seeded study (baseline done: the next trial launched is trial 1)."""
    db = tmp_path / "study.db"
    copy_db(seeded_template, db)
    return sqlite_url(db)


# --------------------------------------------------------------------------- PostgreSQL
@pytest.fixture(scope="session")
def postgres_server() -> str:
    """The PostgreSQL URL under test; skips with a visible reason when no server answers."""
    from sqlalchemy import create_engine, text

    from autobalance.store import mask_url

    url = os.environ.get(POSTGRES_ENV) or POSTGRES_DEFAULT
    engine = create_engine(url, connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        first = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        service_missing(f"PostgreSQL fault tests skipped: no server answers at {mask_url(url)} ({first}); "
                    f"set {POSTGRES_ENV} to a reachable server.")
    finally:
        engine.dispose()
    return url


@pytest.fixture
def pg_study(postgres_server: str) -> Iterator[str]:
    """A unique study name on the PostgreSQL server; the study and its saved rows are deleted after."""
    name = f"faults-{uuid.uuid4().hex[:10]}"
    yield name
    drop_pg_study(postgres_server, name)


@pytest.fixture
def pg_fresh_schema(postgres_server: str) -> Iterator[str]:
    """A URL whose tables live in a new, empty schema (dropped after): the first workers on it
    create Optuna's and autobalance's tables concurrently."""
    with throwaway_schema(postgres_server, prefix="autobalance_faults") as url:
        yield url


def drop_pg_study(url: str, name: str) -> None:
    from sqlalchemy import create_engine, inspect, text

    try:
        optuna.delete_study(study_name=name, storage=url)
    except KeyError:
        pass
    engine = create_engine(url)
    try:
        if "autobalance_saved_config" in inspect(engine).get_table_names():
            with engine.begin() as conn:
                conn.execute(text("DELETE FROM autobalance_saved_config WHERE study_name = :n"), {"n": name})
    finally:
        engine.dispose()


def wait_for(predicate: Any, *, timeout: float, what: str, poll: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
