"""Byte counts as text, one rule for every number a person reads (CLI, recommendations,
events, the dashboard): binary GiB (2^30), as nvidia-smi's MiB and the dashboard's
``format.js`` ``gib()``: one decimal from 10 GiB up, two below. Pure, O(1)."""

from __future__ import annotations

GIB = 2**30


def gib(value: float | None, digits: int | None = None, *, none: str = "-") -> str:
    """``value`` bytes as ``"N.N GiB"`` (``none`` when unknown); ``digits`` overrides the rule."""
    if value is None:
        return none
    g = value / GIB
    if digits is None:
        digits = 1 if abs(g) >= 10 else 2
    return f"{g:.{digits}f} GiB"


__all__ = ["GIB", "gib"]
