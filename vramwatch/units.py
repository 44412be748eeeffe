"""Byte counts as text, one rule for every number a person reads (CLI, recommendations,
events, the dashboard): binary GiB (2^30), as nvidia-smi's MiB and the dashboard's
``format.js`` ``gib()``: one decimal from 10 GiB up, two below. Pure, O(1)."""

from __future__ import annotations

GIB = 2**30
MIB = 2**20


def gib(value: float | None, digits: int | None = None, *, none: str = "-") -> str:
    """``value`` bytes as ``"N.N GiB"`` (``none`` when unknown); ``digits`` overrides the rule."""
    if value is None:
        return none
    g = value / GIB
    if digits is None:
        digits = 1 if abs(g) >= 10 else 2
    return f"{g:.{digits}f} GiB"


def mib(value: float | None, *, none: str = "-") -> str:
    """``value`` bytes as ``"N.NN MiB"`` (a rate per step: a leak's slope); ``none`` when unknown."""
    if value is None:
        return none
    m = value / MIB
    return f"{m:.2f} MiB" if abs(m) < 100 else f"{m:,.0f} MiB"


def duration(seconds: float | None, *, none: str = "-") -> str:
    """``seconds`` as a person reads a runway: ``"45 s"``, ``"12 min"``, ``"7 h 9 min"``, ``"3.2 days"``
    (``none`` when unknown; negative reads as 0). The dashboard's ``format.js`` ``duration()`` is
    the same rule."""
    if seconds is None:
        return none
    s = max(0.0, float(seconds))
    if s < 90:
        return f"{s:.0f} s"
    if s < 90 * 60:
        return f"{s / 60:.0f} min"
    if s < 48 * 3600:
        h = int(s // 3600)
        return f"{h} h {round((s - h * 3600) / 60)} min"
    return f"{s / 86400:.1f} days"


__all__ = ["GIB", "MIB", "duration", "gib", "mib"]
