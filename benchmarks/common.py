"""Shared pieces of the benchmarks: the GPT benchmark scenario, result writing, and running a child
command with a timeout that ends its whole process tree."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GPT = str(REPO / "examples" / "gpt" / "train.py")

# The benchmark scenario: a ~270M-parameter GPT (16 x 1024, 1024 tokens, 32k vocabulary) whose
# rank 0 holds an EMA copy of the weights and a 3 GiB cached validation batch (~4 GiB of extras).
GPT_ARGS = ["--n-layer", "16", "--n-embd", "1024", "--n-head", "16", "--block-size", "1024",
            "--vocab", "32768", "--samples", "256", "--micro-batch", "8", "--val-cache-mib", "3072",
            "--dropout", "0.0"]


@dataclass(kw_only=True)
class Bounded:
    """What :func:`run_tree` ran to."""

    returncode: int | None
    """The command's exit code; None when it was stopped at its timeout."""
    stdout: str
    stderr: str
    wall_s: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_tree(cmd: list[str], *, timeout_s: float, grace_s: float = 30.0, merge_stderr: bool = False,
             log_path: str | None = None, **popen: Any) -> Bounded:
    """Run ``cmd`` in its own session, capturing its output as text (``merge_stderr``: both streams,
    interleaved, in ``stdout``). Past ``timeout_s`` its process group gets SIGTERM (``autobalance
    tune`` then kills its trials and marks them interrupted) and, ``grace_s`` later, SIGKILL;
    whatever the group still holds when the command is done (Inductor's compile workers, a stray
    rank) is SIGKILLed too. The output goes through files, not pipes: a grandchild that inherited a
    pipe would hold its reader until the timeout after the command itself had ended. ``log_path``: the
    output file is that path, written as the command runs (what a caller cut short still has)."""
    started = time.monotonic()
    opened = open(log_path, "w+") if log_path else tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
    with opened as out, tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if merge_stderr else err, text=True,
                                start_new_session=True, **popen)
        returncode: int | None
        try:
            try:
                returncode = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    _signal_group(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=60)
                returncode = None
        finally:
            _signal_group(proc.pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if returncode is None:
        stderr += f"\n[benchmark] timed out after {timeout_s:g} s; its process group was stopped\n"
    return Bounded(returncode=returncode, stdout=stdout, stderr=stderr, wall_s=time.monotonic() - started)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "host": platform.node()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    try:
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def write_result(name: str, data: dict[str, Any]) -> str:
    out = os.environ.get("OUT") or str(REPO / "benchmarks" / "results")
    os.makedirs(out, exist_ok=True)
    data = {"benchmark": name, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(), **data}
    path = os.path.join(out, f"{name}.json")
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1, default=str)
    print(f"wrote {path}", flush=True)
    return path


def per_rank(outcome: Any) -> dict[str, Any]:
    """Per-rank figures of a launcher outcome, in GiB and ms."""
    ranks = {}
    for r, report in sorted(outcome.reports.items()):
        rep = report.to_dict()  # the rank's report as its JSON object
        mem = rep["memory"]
        ranks[r] = {
            "peak_device_gib": mem["peak_device"] / 2**30,
            "peak_reserved_gib": mem["peak_reserved"] / 2**30,
            "peak_allocated_gib": mem["peak_allocated"] / 2**30,
            "outside_pytorch_gib": mem["outside_pytorch"] / 2**30,
            "nvml_used_peak_gib": (mem["nvml_used_peak"] or 0) / 2**30,
            "step_time_ms": (rep["step_time_s"] or 0) * 1000,
            "startup_s": (rep.get("timing") or {}).get("startup_s"),
        }
    return ranks
