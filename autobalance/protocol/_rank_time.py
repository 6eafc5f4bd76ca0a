"""Each rank's time in words, and which rank is slow: its own work per sample (busy time, without
its wait at the gradient all-reduce) against the fastest rank's. In DDP every rank records the same
step time, so only the busy times tell the ranks apart; ``diagnose``, ``trials`` and the report name
a rank by this one rule and write the per-rank times in this one notation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SLOW_RATIO", "SlowRank", "busy_wait_text", "slow_rank"]

SLOW_RATIO = 1.2
"""A rank is named slow when its busy time per sample is at least this many times the fastest rank's."""


@dataclass(frozen=True, kw_only=True)
class SlowRank:
    rank: int
    """The slowest rank per sample."""
    fastest: int
    ratio: float
    """Its busy time per sample over the fastest rank's."""
    ms_per_sample: list[float | None]
    """Every rank's busy ms per sample (None: not measured)."""

    def text(self) -> str:
        """``rank 1 is 2.05x slower per sample than rank 0 (busy 7.81 vs 3.81 ms per sample)``."""
        slow, fast = self.ms_per_sample[self.rank], self.ms_per_sample[self.fastest]
        return (f"rank {self.rank} is {self.ratio:.2f}x slower per sample than rank {self.fastest} "
                f"(busy {slow:.3g} vs {fast:.3g} ms per sample)")


def slow_rank(busy_ms: Sequence[float | None], samples: Sequence[int | None], *,
              ratio: float = SLOW_RATIO) -> SlowRank | None:
    """The rank whose busy ms per sample (``busy_ms[r] / samples[r]``: one optimizer step's) is at
    least ``ratio`` times the fastest rank's; None with fewer than two measured ranks or none that slow."""
    per_sample: list[float | None] = [
        float(b) / s if b is not None and b > 0 and s else None
        for b, s in zip(busy_ms, list(samples) + [None] * (len(busy_ms) - len(samples)), strict=False)
    ]
    known = [(v, r) for r, v in enumerate(per_sample) if v is not None]
    if len(known) < 2:
        return None
    (slow, r_slow), (fast, r_fast) = max(known), min(known)
    if slow < ratio * fast:
        return None
    return SlowRank(rank=r_slow, fastest=r_fast, ratio=slow / fast, ms_per_sample=per_sample)


def busy_wait_text(busy_ms: Sequence[float | None], wait_ms: Sequence[float | None]) -> str:
    """Each rank's busy and all-reduce wait ms per step, ``busy/wait`` in rank order:
    ``181/166 333/5.9`` (rank 0 busy 181 ms, waiting 166 ms); ``-`` for a figure not measured, and
    for none at all (a study from before they were measured)."""
    if not any(v is not None for v in [*busy_ms, *wait_ms]):
        return "-"

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3g}" if v < 100 else f"{v:.0f}"

    ranks = max(len(busy_ms), len(wait_ms))
    return " ".join(f"{ms(busy_ms[r] if r < len(busy_ms) else None)}/{ms(wait_ms[r] if r < len(wait_ms) else None)}"
                    for r in range(ranks))
