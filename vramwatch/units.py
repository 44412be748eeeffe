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


def rate(bytes_per_step: float | None, *, none: str = "-") -> str:
    """A growth per step (a leak's slope) as ``"60.00 MiB/step"``, signed only when negative."""
    return none if bytes_per_step is None else f"{mib(bytes_per_step)}/step"


def smi_mib(value: float | None, *, none: str = "-") -> str:
    """Bytes as the whole MiB ``nvidia-smi`` prints (``143,771 MiB``): what operators quote."""
    return none if value is None else f"{value / MIB:,.0f} MiB"


def capacity(total: float | None, *, none: str = "-") -> str:
    """A card's capacity in GiB and as ``nvidia-smi`` prints it: ``"140.4 GiB (143,771 MiB)"``."""
    return none if total is None else f"{gib(total)} ({smi_mib(total)})"


def hours(seconds: float | None, *, none: str = "-") -> str:
    """Wall time as hours (``"2.3 h"``); under six minutes as minutes (``"4 min"``)."""
    if seconds is None:
        return none
    if seconds < 360:
        return f"{max(seconds, 0) / 60:.0f} min"
    return f"{seconds / 3600:,.1f} h"


def runway(steps: int | None, seconds: float | None, *, none: str = "-") -> str:
    """Steps to OOM with the wall time beside them: ``"1,234 steps (2.3 h)"``."""
    if steps is None:
        return none
    return f"{steps:,} steps" + ("" if seconds is None else f" ({hours(seconds)})")


__all__ = ["GIB", "MIB", "capacity", "gib", "hours", "mib", "rate", "runway", "smi_mib"]
