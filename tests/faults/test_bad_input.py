"""Bad input: one line that names the argument, the value and the fix; exit code 2; nothing written
(no database file, no trial directory, no change to an existing study)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from autobalance._errors import UsageError
from autobalance.tuner import check_caps, check_gpus
from tests.faults.conftest import (
    STUDY,
    assert_no_processes,
    load,
    one_line,
    run_cli,
    sqlite_url,
    tune,
    tune_cmd,
)
from tests.tune_helpers import FAULTY

GIB = 2**30


def _usage_error(tmp_path: Path, cmd: list[str]) -> str:
    proc = run_cli(cmd, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_line(proc.stderr)
    assert line.startswith("autobalance: error: ")
    assert not (tmp_path / "autobalance_runs").exists()
    assert_no_processes(tmp_path, within=0)
    return line


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"script": "missing.py"}, ["SCRIPT='", "missing.py", "does not exist", "check the path"]),
        ({"script": "notes.txt"}, ["SCRIPT='", "notes.txt", "is not a Python file", "train.py"]),
        ({"--trials": "0"}, ["--trials=0", "must be at least 1"]),
        ({"--trials": "-3"}, ["--trials=-3", "must be at least 1"]),
        ({"--global-batch": "1"}, ["--global-batch=1", "smaller than the 2 ranks", "use at least 2"]),
        ({"--global-batch": "0"}, ["--global-batch=0", "use at least 2"]),
        ({"--memory-cap-gib": "1,2,3"}, ["--memory-cap-gib has 3 values for 2 ranks", "one per rank"]),
        ({"--memory-cap-gib": "100000"}, ["--memory-cap-gib=100000", "larger than this host's memory",
                                          "use at most"]),
        ({"--sampler": "cmaes"}, ["--sampler='cmaes'", "tpe, gp, random"]),
        ({"--runs-dir": "/proc/autobalance-runs"}, ["--runs-dir='/proc/autobalance-runs'", "not writable",
                                                    "writable directory"]),
    ],
    ids=["missing-script", "non-python-script", "trials-0", "trials-negative", "global-batch-below-ranks",
         "global-batch-0", "caps-per-rank", "cap-larger-than-host", "unknown-sampler", "runs-dir-unwritable"],
)
def test_bad_tune_arguments(tmp_path: Path, change: dict[str, str], words: list[str]) -> None:
    (tmp_path / "notes.txt").write_text("not a script\n")
    db = tmp_path / "study.db"
    cmd = tune_cmd(sqlite_url(db), trials=3, script=str(tmp_path / change.pop("script", FAULTY)))
    for flag, value in change.items():
        if flag in cmd:
            cmd[cmd.index(flag) + 1] = value
        else:
            cmd += [flag, value]
    line = _usage_error(tmp_path, cmd)
    for word in words:
        assert word in line, line
    assert not db.exists()  # pure argument errors are found before the storage is touched


def test_cuda_without_a_gpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the no-GPU message is covered by test_nproc_per_node_against_visible_gpus")
    cmd = tune_cmd(sqlite_url(tmp_path / "study.db"), trials=3)
    cmd[cmd.index("--device") + 1] = "cuda"
    line = _usage_error(tmp_path, cmd)
    assert "--device=cuda but no CUDA device is visible; use --device cpu" in line


def test_nproc_per_node_against_visible_gpus() -> None:
    """``--nproc-per-node`` larger than the visible GPUs (a function of the visible count, so it
    runs on any machine)."""
    check_gpus(device="cuda", nproc_per_node=2, visible=2)
    check_gpus(device="cpu", nproc_per_node=64, visible=0)  # CPU ranks need no GPU
    with pytest.raises(UsageError, match=r"--nproc-per-node=4 is larger than the 2 visible GPU\(s\); use at most 2"):
        check_gpus(device="cuda", nproc_per_node=4, visible=2)
    with pytest.raises(UsageError, match="no CUDA device is visible; use --device cpu"):
        check_gpus(device="cuda", nproc_per_node=1, visible=0)


def test_memory_cap_against_the_card() -> None:
    check_caps(caps_bytes=[40 * GIB, 80 * GIB], capacities=[80 * GIB, 80 * GIB], device="cuda")
    with pytest.raises(UsageError, match=r"--memory-cap-gib=96 for rank 1 is larger than its card \(80.0 GiB\); "
                                         r"use at most 80.0"):
        check_caps(caps_bytes=[40 * GIB, 96 * GIB], capacities=[80 * GIB, 80 * GIB], device="cuda")


@pytest.mark.parametrize(
    ("toml", "words"),
    [
        ("[tune]\ntrials = 3\nsteps = \n", ["is malformed TOML", "line 3", "fix that line"]),
        ("[tune]\ntrials = \"many\"\n", ["trials = 'many'", "not a whole number", "fix that key"]),
        ("[tune]\nheadroom = [0.1]\n", ["headroom = [0.1]", "not a number"]),
        ("[tune]\ntrails = 3\n", ["unknown key 'trails'", "known keys"]),
    ],
    ids=["malformed", "wrong-type", "list-for-number", "unknown-key"],
)
def test_bad_study_toml(tmp_path: Path, toml: str, words: list[str]) -> None:
    (tmp_path / "study.toml").write_text(toml)
    db = tmp_path / "study.db"
    line = _usage_error(tmp_path, [*tune_cmd(sqlite_url(db), trials=3), "--config", "study.toml"])
    assert "--config='study.toml'" in line
    for word in words:
        assert word in line, line
    assert not db.exists()


@pytest.mark.slow  # the seeded study runs a baseline trial
@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--headroom", "0.2"], ["another search space/objective", "differs in: headroom"]),
        (["--global-batch", "32"], ["another search space", "--global-batch=32", "global batch 8"]),
        (["--multi-objective"], ["1 objective(s)", "asks for 2"]),
    ],
    ids=["other-objective", "other-global-batch", "other-directions"],
)
def test_study_name_exists_with_another_search_space(tmp_path: Path, seeded: str, flags: list[str],
                                                     words: list[str]) -> None:
    study = load(seeded)
    attrs, trials = study.user_attrs, len(study.trials)
    proc = tune(seeded, *flags, cwd=tmp_path, trials=3)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_line(proc.stderr)
    assert f"--study-name={STUDY!r}" in line and "new --study-name" in line
    for word in words:
        assert word in line, line
    study = load(seeded)
    assert study.user_attrs == attrs and len(study.trials) == trials  # nothing written
    assert not (tmp_path / "autobalance_runs").exists()


@pytest.mark.slow  # the seeded study runs a baseline trial
@pytest.mark.parametrize("command", ["best", "export", "trials", "report"])
def test_unknown_study_lists_the_available_ones(tmp_path: Path, seeded: str, command: str) -> None:
    study = load(seeded)
    trials = len(study.trials)
    cmd = [sys.executable, "-m", "autobalance", command, "--study-name", "nope", "--storage", seeded]
    if command in ("export", "report"):
        cmd += ["-o", str(tmp_path / "out.file")]
    proc = run_cli(cmd, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_line(proc.stderr)
    assert "'nope'" in line and f"'{STUDY}'" in line.replace("available: s", "available: 's'"), line
    assert not (tmp_path / "out.file").exists()
    assert len(load(seeded).trials) == trials


@pytest.mark.parametrize("command", ["best", "trials", "studies"])
def test_reading_commands_never_create_a_database(tmp_path: Path, command: str) -> None:
    db = tmp_path / "typo.db"
    cmd = [sys.executable, "-m", "autobalance", command, "--storage", sqlite_url(db)]
    if command != "studies":
        cmd[4:4] = ["--study-name", "s"]
    line = _usage_error(tmp_path, cmd)
    assert f"--storage={sqlite_url(db)} does not exist" in line
    assert not os.path.exists(db)
