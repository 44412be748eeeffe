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
    """``seconds`` as a person reads a runway or an age: ``"45 s"``, ``"12 min"``, ``"7 h 9 min"``,
    ``"3.2 days"`` (``none`` when unknown; negative reads as 0); rounded half up, minutes carried
    into hours (7,199 s is ``"2 h 0 min"``). The one spelling of a duration: ``format.js``
    ``duration()`` is the same rule."""
    if seconds is None:
        return none
    s = max(0.0, float(seconds))
    if s < 90:
        return f"{_whole(s)} s"
    if s < 90 * 60:
        return f"{_whole(s / 60)} min"
    if s < 48 * 3600:
        h, m = divmod(math.floor(s / 60 + 0.5), 60)
        return f"{h} h {m} min"
    return f"{_fixed(s / 86400, 1)} days"


def rate(bytes_per_step: float | None, *, none: str = "-") -> str:
    """A growth per step (a leak's slope) as ``"60.00 MiB/step"``, signed only when negative."""
    return none if bytes_per_step is None else f"{mib(bytes_per_step)}/step"


def smi_mib(value: float | None, *, none: str = "-") -> str:
    """Bytes as the whole MiB ``nvidia-smi`` prints (``143,771 MiB``): what operators quote."""
    return none if value is None else f"{_whole(value / MIB)} MiB"


def capacity(total: float | None, *, none: str = "-") -> str:
    """A card's capacity in GiB and as ``nvidia-smi`` prints it: ``"140.4 GiB (143,771 MiB)"``."""
    return none if total is None else f"{gib(total)} ({smi_mib(total)})"


def runway(steps: int | None, seconds: float | None, *, none: str = "-") -> str:
    """Steps to OOM with the wall time beside them: ``"1,234 steps (2 h 18 min)"``."""
    if steps is None:
        return none
    return f"{steps:,} steps" + ("" if seconds is None else f" ({duration(seconds)})")


__all__ = ["GIB", "MIB", "capacity", "duration", "gib", "mib", "rate", "runway", "smi_mib"]
