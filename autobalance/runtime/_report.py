"""Per-rank trial reports: one JSON file per rank, written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from autobalance.protocol import report_path

__all__ = ["report_path", "write_report"]


def write_report(trial_dir: str, rank: int, report: dict[str, Any]) -> str:
    """Write to a temporary file in the same directory, fsync, then rename into place."""
    path = report_path(trial_dir, rank)
    fd, tmp = tempfile.mkstemp(prefix=f".rank{rank}.", suffix=".tmp", dir=trial_dir)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
