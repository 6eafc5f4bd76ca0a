"""Writes, per rank, the configuration autobalance.plan() resolved (for production-load tests)
to SHOW_PLAN_DIR/rank<R>.json, with every storage access the rank made while resolving it: an
audit hook records each SQLite connection and each open() of a path containing SHOW_PLAN_WATCH."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

watch = os.environ.get("SHOW_PLAN_WATCH")
touched: list[str] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not watch:
        return
    if event == "sqlite3.connect" and watch in str(args[0]):
        touched.append(f"sqlite3.connect {args[0]}")
    elif event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)) and watch in os.fsdecode(args[0]):
        touched.append(f"open {os.fsdecode(args[0])}")


sys.addaudithook(_audit)

import autobalance as ab  # noqa: E402

plan = ab.plan(micro_batch=4, on_mismatch=os.environ.get("SHOW_PLAN_POLICY", "warn"))
result = {"rank": plan.rank, "source": plan.source, "config": plan.config.to_dict(), "touched": list(touched)}
with open(os.path.join(os.environ["SHOW_PLAN_DIR"], f"rank{plan.rank}.json"), "w") as fh:
    json.dump(result, fh)
