"""Memory figures in words: the unit chosen by size (GiB, MiB, KiB, bytes), so a tiny peak never
reads ``0.000 GiB``. The one formatting function every output uses (the CLI, the report, the tuner's
console, production loading's lines); it lives in the protocol because ``over_limit`` prints memory
too and the protocol imports nothing else of autobalance."""

from __future__ import annotations

import math

__all__ = ["GIB", "MIB", "memory_pair", "memory_text"]

GIB = 2**30
"""Bytes in a GiB: every figure the rooms exchange is in GiB; this turns bytes into it."""
MIB = 2**20

_UNITS = (("GiB", 1.0), ("MiB", 1 / 1024), ("KiB", 1 / 1024**2))


def _unit(gib: float) -> tuple[str, float]:
    size = abs(gib)
    return next(((name, scale) for name, scale in _UNITS if size >= scale), ("B", 1 / 1024**3))


def memory_text(gib: float | None, *, digits: int = 3, unit_of: float | None = None) -> str:
    """``gib`` (a size in GiB) in the largest unit it is at least one of: ``15.7 GiB``, ``14.3 MiB``,
    ``512 KiB``, ``300 B``; ``digits`` significant digits, never an exponent (``1000 MiB``, not
    ``1e+03``); ``-`` for None. ``unit_of``: take the unit of that size instead (two figures compared
    side by side, ``14.3 MiB > 14.1 MiB``, read in one unit)."""
    if gib is None:
        return "-"
    name, scale = _unit(float(gib if unit_of is None else unit_of))
    value = float(gib) / scale
    if name == "B":
        return f"{value:.0f} B"
    magnitude = math.floor(math.log10(abs(value))) if value else 0
    decimals = max(0, digits - 1 - magnitude)
    return f"{value:.{decimals}f} {name}"


def memory_pair(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` (GiB) by :func:`memory_text` in the unit of the larger, with as many digits
    (3 to 8) as it takes for two different sizes not to read the same: ``14.3 MiB`` vs ``14.1 MiB``,
    ``14.14 MiB`` vs ``14.13 MiB``."""
    unit = max(abs(a), abs(b))
    for digits in range(3, 9):
        pair = memory_text(a, digits=digits, unit_of=unit), memory_text(b, digits=digits, unit_of=unit)
        if pair[0] != pair[1] or a == b:
            return pair
    return pair
