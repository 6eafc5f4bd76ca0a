"""Several tuner processes on one study at once (issue matrix 6): two on SQLite, four on PostgreSQL.

Every requested trial is recorded exactly once (the study ends with exactly ``--trials`` counted
trials, all measured), trial numbers are unique, no worker fails with "database is locked", and
only one worker runs the baseline: the others wait for it (see ``autobalance/tuner/_study.py``).
A worker that asked for a trial beyond the total at the same moment as another records it as a
FAIL ``surplus`` trial without launching anything; that is allowed here but nothing else is.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from optuna.trial import TrialState

from tests.faults.conftest import (
    CLI_TIMEOUT,
    assert_no_processes,
    counted,
    env_for,
    load,
    sqlite_url,
    tune_cmd,
)
from tests.tune_helpers import assert_no_hold_timed_out

pytestmark = pytest.mark.slow

TRIALS = 6


def _run_workers(url: str, tmp_path: Path, n: int, *, study: str) -> list[subprocess.CompletedProcess[str]]:
    """``n`` tuners at once. The baseline trial (whichever worker runs it) waits until the other
    n - 1 tuners have said they wait for it (their stderr files), so "only one runs the baseline, the
    others wait" is observed every time, not only when the start-up timing happens to allow it."""
    env = env_for(tmp_path, AB_HOLD_FIRST_LAUNCH=f"{tmp_path}/worker*/stderr.log|Waiting for the baseline trial|{n - 1}")
    procs = []
    for i in range(n):
        cwd = tmp_path / f"worker{i}"
        cwd.mkdir()
        err = open(cwd / "stderr.log", "w")
        # --no-verify: what is checked is the trials' bookkeeping, not what each worker saves after them
        procs.append((cwd, err, subprocess.Popen(tune_cmd(url, "--no-verify", trials=TRIALS, study=study, timeout=180), cwd=cwd,
                                                 env=env, text=True, stdout=subprocess.PIPE, stderr=err)))
    done = []
    for cwd, err, proc in procs:
        try:
            out, _ = proc.communicate(timeout=CLI_TIMEOUT)
        except subprocess.TimeoutExpired:
            for _, _, p in procs:
                p.kill()
            raise
        finally:
            err.close()
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, (cwd / "stderr.log").read_text()))
    assert_no_hold_timed_out(tmp_path)  # the baseline's hold gave up: the others never said they wait
    return done


def _check_study(url: str, study: str, results: list[subprocess.CompletedProcess[str]]) -> None:
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "database is locked" not in r.stderr + r.stdout
    s = load(url, study)
    trials = s.get_trials(deepcopy=False)
    numbers = [t.number for t in trials]
    assert sorted(numbers) == list(range(len(trials)))  # unique, no gaps
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    others = [t for t in trials if t.state != TrialState.COMPLETE]
    assert len(complete) == TRIALS, [(t.number, t.state.name, t.user_attrs.get("status")) for t in trials]
    assert all(t.user_attrs["status"] == "ok" for t in complete)
    assert all(t.state == TrialState.FAIL and t.user_attrs.get("status") == "surplus" for t in others)
    assert counted(url, study) == TRIALS
    # one baseline, run by one worker; every other worker waited for it
    baselines = [t for t in trials if t.user_attrs.get("baseline")]
    assert len(baselines) == 1
    assert s.user_attrs["autobalance:baseline_trial"] == baselines[0].number
    waited = sum("Waiting for the baseline trial" in r.stderr for r in results)
    assert waited == len(results) - 1


def _launched(tmp_path: Path) -> int:
    """Trials started by all workers together (one directory each; a trial measured a second time,
    ``-again``, is the same trial)."""
    return len([p for p in tmp_path.glob("worker*/autobalance_runs/*/trial-*") if not p.name.endswith("-again")])


def _no_configuration_twice(url: str, study: str, tmp_path: Path) -> None:
    """No configuration launched twice (issue 41: both workers sample with one seed, so they propose
    the same configurations): a proposal another worker runs or ran is waited for and reused."""
    trials = [t for t in load(url, study).get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    ran = [json.dumps(t.user_attrs["config"], sort_keys=True) for t in trials if t.user_attrs.get("reused_from") is None]
    assert len(ran) == len(set(ran)), ran
    assert _launched(tmp_path) == len(ran)  # one trial directory per configuration, no second baseline
    for t in trials:
        if t.user_attrs.get("reused_from") is not None:
            source = next(s for s in trials if s.number == t.user_attrs["reused_from"])
            assert source.user_attrs["config"] == t.user_attrs["config"]


def test_two_workers_on_one_sqlite_study(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "study.db")
    results = _run_workers(url, tmp_path, 2, study="s")
    _check_study(url, "s", results)
    _no_configuration_twice(url, "s", tmp_path)
    assert_no_processes(tmp_path)


@pytest.mark.postgres
def test_four_workers_on_one_postgres_study(tmp_path: Path, pg_fresh_schema: str) -> None:
    """On an empty schema, so the four also race to create the tables (Optuna's own creation is
    not safe against that; the tuner retries)."""
    results = _run_workers(pg_fresh_schema, tmp_path, 4, study="s")
    _check_study(pg_fresh_schema, "s", results)
    _no_configuration_twice(pg_fresh_schema, "s", tmp_path)
    assert_no_processes(tmp_path)
