"""What the CLI tells a user: one exit code per class of error, output into a pipe that is never cut
at 80 columns nor wrapped mid-command, and messages that say what happened."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest

from autobalance import (
    ConfigError,
    HardwareMismatchError,
    LaunchError,
    StorageError,
    StorageURLError,
    StudyNotFoundError,
    TrialScriptError,
    UsageError,
    VerificationError,
)
from autobalance._errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, exit_code
from autobalance.protocol import StudyAttr, memory_text

REPO = Path(__file__).resolve().parents[1]
GPT = str(REPO / "examples" / "gpt" / "train.py")
RANKS = 8


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``autobalance ARGS`` with stdout and stderr pipes and COLUMNS unset, as in a CI log."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "autobalance", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


def test_one_exit_code_per_class_of_error() -> None:
    for exc in (UsageError("x"), ConfigError("x"), StudyNotFoundError("x"), StorageURLError("x")):
        assert exit_code(exc) == EXIT_USAGE == 2, exc
    for exc in (StorageError("x"), TrialScriptError("x"), LaunchError("x"), VerificationError("x"),
                HardwareMismatchError("x")):
        assert exit_code(exc) == EXIT_FAILURE == 1, exc
    assert exit_code(KeyboardInterrupt()) == EXIT_INTERRUPTED == 130


def _study_with_long_rows(db: Path) -> str:
    url = f"sqlite:///{db}"
    study = optuna.create_study(study_name="s", storage=url)
    config = {"micro_batches": [13] * RANKS, "accumulation": 4, "global_batch": 13 * RANKS * 4,
              "checkpoint": [[0, 1, 2, 3, 4, 5]] * RANKS, "dtype": "bf16", "bucket_cap_mb": 25.0,
              "gradient_as_bucket_view": True}
    for number in range(2):
        study.add_trial(optuna.trial.create_trial(
            state=optuna.trial.TrialState.COMPLETE, values=[1.2345 + number], params={}, distributions={},
            user_attrs={"config": config, "status": "ok", "baseline": number == 0, "feasible": True,
                        "peak_device_gib": [10.123 + r for r in range(RANKS)], "spread_gib": 7.0,
                        "step_time_ms": 123.4},
            system_attrs={"constraints": [-0.1]},
        ))
    return url


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["tune", GPT, "--device", "cpu", "--trials", "0"], 2),
        (["tune", GPT, "--device", "cpu", "--storage", "notaurl"], 2),
        (["tune", "no_such_script.py", "--device", "cpu"], 2),
        (["tune", GPT, "--device", "cpu", "--memory-cap-gib", "lots"], 2),
        (["studies", "--no-such-flag"], 2),  # click's own usage error
        (["best", "--study-name", "nope", "--storage", "sqlite:///known.db"], 2),
        (["tune", GPT, "--device", "cpu", "--storage", "postgresql+psycopg://postgres@127.0.0.1:1/test"], 1),
    ],
    ids=["bad-value", "storage-not-a-url", "missing-script", "caps-not-numbers", "unknown-option",
         "unknown-study", "storage-unreachable"],
)
def test_exit_codes_of_the_command(tmp_path: Path, args: list[str], code: int) -> None:
    _study_with_long_rows(tmp_path / "known.db")
    proc = run(args, tmp_path)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "autobalance_runs").exists()


def test_trials_table_into_a_pipe_is_not_cut(tmp_path: Path) -> None:
    url = _study_with_long_rows(tmp_path / "a.db")
    proc = run(["trials", "--study-name", "s", "--storage", url], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if "(baseline)" in line)
    whole = "; ".join(f"rank {r}: 13,13,13,13 ckpt 0-5" for r in range(RANKS)) + " | bf16 bucket=25MB view"
    assert whole in row  # whole, on one line
    assert " ".join(memory_text(10.123 + r) for r in range(RANKS)) in row
    assert len(row) > 80


def _frozen(number: int, **attrs: Any) -> SimpleNamespace:
    return SimpleNamespace(number=number, user_attrs=attrs)


def test_suggested_commands_into_a_pipe_are_one_line_each(capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from autobalance.cli._common import console
    from autobalance.cli._views import print_result

    monkeypatch.delenv("COLUMNS", raising=False)
    config = {"micro_batches": [8, 8], "accumulation": 1, "global_batch": 16, "checkpoint": [[], []], "dtype": "fp32",
              "bucket_cap_mb": 25.0}
    storage = "sqlite:///" + "/very/long/path/to/the/study" * 4 + "/autobalance.db"
    result = SimpleNamespace(baseline=_frozen(0, config=config, status="ok"), best=_frozen(3, config=config, status="ok"),
                             trials_run=4, wall_s=12.0, study_name="gpt-cpu", storage=storage, notes=[], saved=True)
    print_result(result, settings=SimpleNamespace(script="examples/gpt/train.py"), console=console())
    lines = capsys.readouterr().out.splitlines()
    use = next(line for line in lines if line.startswith("Use it in production:"))
    assert use.endswith("and AUTOBALANCE_CONFIG_FILE=best.json)")
    assert f"AUTOBALANCE_STORAGE={storage} torchrun ... examples/gpt/train.py" in use
    see = next(line for line in lines if line.startswith("See it:"))
    assert see.endswith("-o report.html")


def test_nothing_feasible_says_what_the_trials_ran_into(tmp_path: Path) -> None:
    """Trials that ran fine but left less than the headroom free are not 'out of memory or failed'."""
    from autobalance.tuner import nothing_feasible

    study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'a.db'}")
    study.set_user_attr(StudyAttr.OBJECTIVE, {"headroom": 0.05})
    for peak in (0.97, 0.98, 0.99):  # of a 1 GiB card: over the 0.95 usable, under the card
        study.add_trial(optuna.trial.create_trial(
            state=optuna.trial.TrialState.COMPLETE, values=[1.0], params={}, distributions={},
            user_attrs={"status": "ok", "feasible": False, "peak_device_gib": [peak, 0.5],
                        "capacity_gib": [1.0, 1.0], "usable_gib": [0.95, 0.95]},
            system_attrs={"constraints": [0.02]}))
    study.add_trial(optuna.trial.create_trial(
        state=optuna.trial.TrialState.COMPLETE, values=[9.0], params={}, distributions={},
        user_attrs={"status": "oom", "feasible": False, "peak_device_gib": [1.0, 0.5], "capacity_gib": [1.0, 1.0]},
        system_attrs={"constraints": [1.0]}))
    text = nothing_feasible(study)
    assert text.startswith("of 4 trial(s), 3 ran but left less than the headroom free")
    assert "1 ran out of memory" in text and "--headroom 0.05" in text
    assert "Try a smaller --headroom (e.g. 0), a larger --memory-cap-gib or more --trials." in text
    assert "failed" not in text


@pytest.mark.slow  # one real (warm) baseline trial
def test_a_script_without_plan_is_told_so_not_called_a_crash(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text("print('training without autobalance')\n")
    proc = run(["tune", str(script), "--trials", "2", "--nproc-per-node", "2", "--device", "cpu",
                "--storage", f"sqlite:///{tmp_path / 'a.db'}", "--trial-timeout", "120"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("autobalance: error: the baseline trial (the script's own configuration) measured nothing")
    assert re.search(r"rank [01] finished normally without calling autobalance\.plan\(\): nothing was measured", line)
    assert "'crash'" not in line


def test_every_commands_short_help_in_top_level_help_is_a_whole_phrase(tmp_path: Path) -> None:
    """`autobalance --help | cat`: click cuts a docstring's first sentence at its first full stop
    ("Save a chosen trial (e.g.") or at 45 characters ("...a short real torchrun..."); each command
    gives its own short help, a whole phrase on one line."""
    import typer

    from autobalance.cli import app

    proc = run(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    listed = proc.stdout.split("Commands:", 1)[1].splitlines()
    entries: dict[str, str] = {}
    for line in listed:
        if re.match(r"^  \S", line):
            name, _, text = line.strip().partition(" ")
            entries[name] = text.strip()
        elif line.strip():
            raise AssertionError(f"a short help wrapped onto a second line: {line!r}")
    names = set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert set(entries) == names
    for name, text in entries.items():
        assert text and text[0].isupper() and text.endswith("."), (name, text)
        assert not text.endswith(("...", "e.g.", "i.e.", "etc.", "vs.")), (name, text)
        assert text.count("(") == text.count(")"), (name, text)
        command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
        assert command.short_help == text, name  # its own, not cut from the docstring
