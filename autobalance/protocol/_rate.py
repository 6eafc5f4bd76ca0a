"""The objective's exchange rate between memory spread and step time, in one sentence a trial table
checks: what one point of spread (1 % of capacity) is worth in milliseconds of step time, and the
reference step every step time is divided by (fixed before the search, stored with the study)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autobalance.protocol._attrs import StudyAttr
from autobalance.protocol._units import memory_text

__all__ = ["RATE_SOURCES", "exchange_rate", "exchange_rate_text"]

RATE_SOURCES: dict[str, str] = {
    "baseline": "the script's own configuration",
    "reference": "the script's own configuration with every block checkpointed, as its own gave no step time",
    "first-measured": "the first trial that gave a step time, as no reference run did",
    "stored-before": "the first trial that gave a step time, in a study stored before the rate was recorded",
}
"""Where the reference step comes from (``StudyAttr.EXCHANGE_RATE["source"]``), in words."""


def exchange_rate(user_attrs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The study's exchange rate (``StudyAttr.EXCHANGE_RATE``); for a study stored before it was
    recorded, the same figures from its reference step and objective weights (source
    ``stored-before``); None while no reference step is fixed."""
    rate = user_attrs.get(StudyAttr.EXCHANGE_RATE)
    if isinstance(rate, dict) and rate.get("reference_step_s"):
        return dict(rate)
    reference = user_attrs.get(StudyAttr.REFERENCE)
    if not isinstance(reference, (int, float)) or isinstance(reference, bool) or reference <= 0:
        return None
    objective = user_attrs.get(StudyAttr.OBJECTIVE) or {}
    return {"reference_step_s": float(reference), "source": "stored-before", "trial": None,
            "weight_spread": float(objective.get("weight_spread", 1.0)),
            "weight_time": float(objective.get("weight_time", 1.0)),
            "world_size": objective.get("world_size"),
            "capacity_bytes": objective.get("caps_bytes") or user_attrs.get(StudyAttr.CAPACITY)}


def exchange_rate_text(user_attrs: Mapping[str, Any]) -> str | None:
    """``Exchange rate: 1 point of memory spread (1 % of capacity) weighs as much as 2.0 ms of step
    time ...``: the rate, the reference step and where it comes from, and the formula of a trial's
    value; None while no reference step is fixed."""
    rate = exchange_rate(user_attrs)
    if rate is None:
        return None
    ref_ms = 1000.0 * float(rate["reference_step_s"])
    w_s, w_t = float(rate.get("weight_spread", 1.0)), float(rate.get("weight_time", 1.0))
    trial = rate.get("trial")
    source = RATE_SOURCES.get(str(rate.get("source")), str(rate.get("source")))
    where = f"trial {trial}, {source}" if trial is not None else source
    reference = f"the reference step, {ref_ms:.1f} ms: {where}"
    if rate.get("world_size") == 1:
        return f"Exchange rate: one rank, nothing to trade; trials rank by step time, divided by {reference}."
    value = f"a trial's value = {w_s:g} x spread as % of capacity / 100 + {w_t:g} x step ms / {ref_ms:.1f}"
    if w_t == 0:
        trade = f"step time does not count (--weight-time 0; {reference})"
    elif w_s == 0:
        trade = f"memory spread does not count (--weight-spread 0; {reference})"
    else:
        trade = (f"1 point of memory spread ({_one_point(rate.get('capacity_bytes'))}) is worth "
                 f"{w_s / w_t * ref_ms / 100:.2f} ms of step time ({w_s / w_t:g} % of {reference})")
    return f"Exchange rate: {trade}; {value}."


def _one_point(capacity: Any) -> str:
    """``1 % of capacity, 152 KiB of 14.8 MiB`` (one capacity for every rank), else ``1 % of each
    rank's capacity``."""
    sizes = {float(c) for c in capacity} if isinstance(capacity, list) and capacity else set()
    if len(sizes) != 1 or not all(c > 0 for c in sizes):
        return "1 % of each rank's capacity" if sizes else "1 % of capacity"
    cap = sizes.pop() / 2**30
    return f"1 % of capacity, {memory_text(cap / 100)} of {memory_text(cap)}"
