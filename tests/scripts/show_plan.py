"""Writes, per rank, the configuration autobalance.plan() resolved (for production-load tests)
to SHOW_PLAN_DIR/rank<R>.json."""

from __future__ import annotations

import json
import os

import autobalance as ab

plan = ab.plan(micro_batch=4, on_mismatch=os.environ.get("SHOW_PLAN_POLICY", "warn"))
with open(os.path.join(os.environ["SHOW_PLAN_DIR"], f"rank{plan.rank}.json"), "w") as fh:
    json.dump({"rank": plan.rank, "source": plan.source, "config": plan.config.to_dict()}, fh)
