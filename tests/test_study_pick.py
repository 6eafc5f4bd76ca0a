"""``best``, ``report``, ``trials`` and ``export`` without ``--study-name``: the only study in the storage,
or the most recently tuned one, said in one line on stderr; with several and none tuned lately, or none
at all, one line (exit code 2) listing them."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from autobalance import BalanceConfig
from autobalance._errors import UsageError
from autobalance.cli import app
from autobalance.cli._study import RECENT_S, StudyActivity, choose_study
from autobalance.store import ConfigStore, current_fingerprint

NOW = 1_800_000_000.0
WHERE = "sqlite:///autobalance.db"


def test_the_only_study() -> None:
    name, line = choose_study([StudyActivity(name="work-adopted", last=None)], where=WHERE, now=NOW)
    assert name == "work-adopted"
    assert line == "autobalance: study work-adopted (the only study in sqlite:///autobalance.db)"


def test_the_most_recently_tuned_of_several() -> None:
    studies = [StudyActivity(name="a", last=NOW - 3 * 86400), StudyActivity(name="b", last=NOW - 240),
               StudyActivity(name="c", last=None)]
    name, line = choose_study(studies, where=WHERE, now=NOW)
    assert name == "b"
    assert line == ("autobalance: study b, the most recently tuned of 3 in sqlite:///autobalance.db (4 min ago; "
                    "also a, c); --study-name picks another")


def test_several_none_recent_and_none_at_all_are_one_line_each() -> None:
    studies = [StudyActivity(name="a", last=NOW - 3 * 86400), StudyActivity(name="b", last=NOW - RECENT_S - 60),
               StudyActivity(name="c", last=None)]
    with pytest.raises(UsageError) as info:
        choose_study(studies, where=WHERE, now=NOW)
    assert str(info.value) == ("--study-name not given and sqlite:///autobalance.db holds 3 studies, none tuned in "
                               "the last 24 hours: b (24 h ago), a (3 days ago), c (no trial yet); pass --study-name "
                               "NAME.")
    with pytest.raises(UsageError, match="holds no study with a saved configuration; run `autobalance tune"):
        choose_study([], where=WHERE, now=NOW, saved=True)


def _study(url: str, name: str, *, ago_s: float) -> None:
    study = optuna.create_study(study_name=name, storage=url)
    trial = optuna.trial.create_trial(value=1.0)
    when = dt.datetime.now() - dt.timedelta(seconds=ago_s)  # Optuna keeps naive local times
    trial.datetime_start, trial.datetime_complete = when, when + dt.timedelta(seconds=1)
    study.add_trial(trial)


def _save(url: str, name: str) -> None:
    with ConfigStore(url=url) as store:
        store.save(study_name=name, trial_number=0, config=BalanceConfig.any_split(rank_samples=[5, 3]),
                   figures={"step_time_ms": 10.0}, fingerprint=current_fingerprint(device_type="cpu", world_size=2,
                                                                                   nnodes=1), saved_by="test")


def test_the_commands_take_the_most_recent_study_and_say_so(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ab.db'}"
    _study(url, "old", ago_s=3 * 86400)
    _study(url, "work-adopted", ago_s=60)
    _save(url, "work-adopted")
    runner = CliRunner()
    result = runner.invoke(app, ["trials", "--storage", url, "--json"])
    assert result.exit_code == 0, result.output
    assert "autobalance: study work-adopted, the most recently tuned of 2 in" in result.stderr
    assert [row["number"] for row in json.loads(result.stdout)] == [0]  # stdout stays the JSON alone
    result = runner.invoke(app, ["best", "--storage", url, "--format", "json"])
    assert result.exit_code == 0, result.output
    assert "study work-adopted (the only study with a saved configuration in" in result.stderr
    assert json.loads(result.stdout)["study_name"] == "work-adopted"
    out = tmp_path / "best.json"
    result = runner.invoke(app, ["export", "--storage", url, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["study_name"] == "work-adopted"


def test_several_studies_none_recent_list_them(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ab.db'}"
    _study(url, "a", ago_s=3 * 86400)
    _study(url, "b", ago_s=2 * 86400)
    result = CliRunner().invoke(app, ["trials", "--storage", url])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"autobalance: error: --study-name not given and {url} holds 2 studies, none tuned in the last 24 hours: "
        "b (2 days ago), a (3 days ago); pass --study-name NAME."]
    named = CliRunner().invoke(app, ["trials", "--storage", url, "--study-name", "a", "--json"])
    assert named.exit_code == 0 and named.stderr == "", named.output  # a name given: nothing said


def test_report_takes_the_only_study(tmp_path: Path) -> None:
    from tests.synthetic_study import build_study

    build_study(tmp_path / "ab.db", name="only")
    out = tmp_path / "r.html"
    result = CliRunner().invoke(app, ["report", "--storage", f"sqlite:///{tmp_path / 'ab.db'}", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "autobalance: study only (the only study in" in result.stderr
    assert out.stat().st_size > 10_000
