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


__all__ = ["GIB", "MIB", "gib", "mib"]
