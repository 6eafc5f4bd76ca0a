"""The baseline-versus-best speed-up, claimed only when the measured steps support it.

The rule (:func:`speed_up`): a trial's step time is the median of its measured steps (the slowest
rank's), and ``step_time_iqr_pct`` records how much those steps spread (the worst rank's
interquartile range, % of its median). A trial's step time is taken to lie anywhere in
``median - IQR .. median + IQR`` (a whole IQR either side: on CPU a trial measures 3 steps, too few
for a narrower claim; this is the step-to-step variation, not the memory spread). A speed-up is claimed only when the two intervals separate, the baseline's
fastest plausible step still slower than the best's slowest; the speed-up is then shown with its
range (``baseline low / best high`` to ``baseline high / best low``). When the intervals overlap,
the difference is within noise and is said so, with the range. Without a recorded spread (one
measured step, a study stored before the attribute) the ratio is shown and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SpeedUp", "speed_up"]


@dataclass(frozen=True, kw_only=True)
class SpeedUp:
    """Baseline step time over best step time, and what the measured spread allows."""

    ratio: float
    low: float | None = None
    """The smallest speed-up the two step-time intervals allow (None: a spread was not recorded)."""
    high: float | None = None
    """The largest (``inf`` when the best's interval reaches zero)."""

    @property
    def known(self) -> bool:
        """Both trials recorded their steps' spread."""
        return self.low is not None and self.high is not None

    @property
    def supported(self) -> bool:
        """The intervals separate: the best is faster (or slower) beyond the steps' noise."""
        return self.known and (self.low > 1.0 or self.high < 1.0)  # type: ignore[operator]

    def text(self) -> str:
        """``1.52x (1.31-1.78x)``; ``within noise (4.33x measured, 0.39x to no bound given the
        step-to-step variation)``; ``1.52x (step-to-step variation not recorded)``."""
        if not self.known:
            return f"{self.ratio:.2f}x (step-to-step variation not recorded)"
        high = "no bound" if math.isinf(self.high) else f"{self.high:.2f}x"  # type: ignore[arg-type]
        if self.supported:
            return f"{self.ratio:.2f}x ({self.low:.2f}-{high})"
        return f"within noise ({self.ratio:.2f}x measured, {self.low:.2f}x to {high} given the step-to-step variation)"


def _interval(ms: float, iqr_pct: float | None) -> tuple[float, float] | None:
    if iqr_pct is None:
        return None
    half = ms * float(iqr_pct) / 100
    return ms - half, ms + half


def speed_up(*, baseline_ms: float, baseline_iqr_pct: float | None, best_ms: float,
             best_iqr_pct: float | None) -> SpeedUp:
    """The speed-up of the best over the baseline by the rule of this module's docstring: each step
    time ``+-`` its IQR (``iqr_pct``: % of the median; None when not recorded)."""
    ratio = float(baseline_ms) / float(best_ms)
    base, best = _interval(float(baseline_ms), baseline_iqr_pct), _interval(float(best_ms), best_iqr_pct)
    if base is None or best is None:
        return SpeedUp(ratio=ratio)
    low = max(base[0], 0.0) / best[1]
    high = math.inf if best[0] <= 0 else base[1] / best[0]
    return SpeedUp(ratio=ratio, low=low, high=high)
