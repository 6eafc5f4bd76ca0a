"""The launcher's torchrun (``autobalance.launcher._torchrun_main``): torchrun's exit code and error
text, ended without the interpreter's teardown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autobalance.launcher._torchrun import TORCHRUN
from autobalance.launcher._torchrun_main import exit_code

pytestmark = pytest.mark.slow


def _run(module: str, script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, "--standalone", "--nproc-per-node", "2", str(script)],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_it_exits_as_torchrun_exits_and_says_what_torchrun_says(tmp_path: Path) -> None:
    ok = tmp_path / "ok.py"
    ok.write_text("import torch.distributed as d\nd.init_process_group('gloo'); d.barrier(); d.destroy_process_group()\n")
    failing = tmp_path / "fail.py"
    failing.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    assert _run(TORCHRUN, ok).returncode == 0
    ours, theirs = _run(TORCHRUN, failing), _run("torch.distributed.run", failing)
    assert ours.returncode == theirs.returncode == 1
    for words in ("ChildFailedError", "exitcode  : 3", "rank      : 1"):
        assert words in ours.stderr and words in theirs.stderr, (words, ours.stderr[-2000:])


def test_exit_codes_of_sys_exit_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert (exit_code(None), exit_code(0), exit_code(4)) == (0, 0, 4)
    assert exit_code("usage: bad") == 1 and "usage: bad" in capsys.readouterr().err
