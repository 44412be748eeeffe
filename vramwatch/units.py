"""Byte counts and durations as text, one rule for every number a person reads (CLI,
recommendations, events, post-mortem, the dashboard): binary GiB (2^30) and MiB (2^20), a card's
capacity also in the whole MiB ``nvidia-smi`` prints, a runway in steps with hours beside them.
``dashboard/format.js`` mirrors these functions digit for digit (rounding included: half away
from zero as JavaScript's ``toFixed``, whole numbers as ``Math.round``), and a browser test holds
them to it. Pure, O(1)."""

from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Decimal

GIB = 2**30
MIB = 2**20


def _fixed(x: float, digits: int) -> str:
    """``x`` with ``digits`` decimals as JavaScript's ``toFixed``: the exact binary value, ties away from zero."""
    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def _whole(x: float) -> str:
    """``x`` rounded as JavaScript's ``Math.round`` (ties up), with thousands separators."""
    return f"{math.floor(x + 0.5):,}"


def gib(value: float | None, digits: int | None = None, *, none: str = "-") -> str:
    """``value`` bytes as ``"N.N GiB"`` (``none`` when unknown): one decimal from 10 GiB up, two
    below; ``digits`` overrides the rule."""
    if value is None:
        return none
    g = value / GIB
    if digits is None:
        digits = 1 if abs(g) >= 10 else 2
    return f"{_fixed(g, digits)} GiB"


def mib(value: float | None, *, none: str = "-") -> str:
    """``value`` bytes as ``"N.NN MiB"`` (a rate per step: a leak's slope), whole MiB from 100 up."""
    if value is None:
        return none
    m = value / MIB
    return f"{_fixed(m, 2)} MiB" if abs(m) < 100 else f"{_whole(m)} MiB"


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


def rate(bytes_per_step: float | None, *, none: str = "-") -> str:
    """A growth per step (a leak's slope) as ``"60.00 MiB/step"``, signed only when negative."""
    return none if bytes_per_step is None else f"{mib(bytes_per_step)}/step"


def smi_mib(value: float | None, *, none: str = "-") -> str:
    """Bytes as the whole MiB ``nvidia-smi`` prints (``143,771 MiB``): what operators quote."""
    return none if value is None else f"{_whole(value / MIB)} MiB"


def capacity(total: float | None, *, none: str = "-") -> str:
    """A card's capacity in GiB and as ``nvidia-smi`` prints it: ``"140.4 GiB (143,771 MiB)"``."""
    return none if total is None else f"{gib(total)} ({smi_mib(total)})"


def hours(seconds: float | None, *, none: str = "-") -> str:
    """Wall time as hours (``"2.3 h"``); under six minutes as minutes (``"4 min"``)."""
    if seconds is None:
        return none
    if seconds < 360:
        return f"{_whole(max(seconds, 0) / 60)} min"
    return f"{float(_fixed(seconds / 3600, 1)):,.1f} h"


def runway(steps: int | None, seconds: float | None, *, none: str = "-") -> str:
    """Steps to OOM with the wall time beside them: ``"1,234 steps (2.3 h)"``."""
    if steps is None:
        return none
    return f"{steps:,} steps" + ("" if seconds is None else f" ({hours(seconds)})")


__all__ = ["GIB", "MIB", "capacity", "duration", "gib", "hours", "mib", "rate", "runway", "smi_mib"]
