"""Query parameters shared by the read API (``app.py``) and the dashboard views
(``views.py``): one parser each, so both answer bad input with the same 422."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

from fastapi import HTTPException, Query

from vramwatch.wire import PHASE_PATTERN

MAX_RANK = 2**53
Rank = Annotated[int, Query(ge=0, le=MAX_RANK)]
OptionalRank = Annotated[int | None, Query(ge=0, le=MAX_RANK)]
#: a phase name as the wire allows it (an empty or 10 kB name is a typo, not "no samples")
Phase = Annotated[str, Query(pattern="^" + PHASE_PATTERN + "$")]
Points = Annotated[int, Query(ge=10, le=20000)]
Bound = Annotated[float | None, Query(allow_inf_nan=False)]


def field_list(text: str, allowed: Iterable[str], shown: Iterable[str] | None = None) -> list[str]:
    """``a,b,c`` → names, each one of ``allowed``; else 422 naming the first unknown one."""
    allowed = set(allowed)
    names = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in names if f not in allowed]
    if unknown or not names:
        choices = ", ".join(shown if shown is not None else sorted(allowed))
        raise HTTPException(422, f"fields: unknown field {unknown[0] if unknown else ''!r}; choose from {choices}")
    return names


def check_range(start: float | None, end: float | None) -> None:
    if start is not None and end is not None and end < start:
        raise HTTPException(422, "end: must not be before start")


def require_rank(known: Iterable[tuple[str, int]], run: str, rank: int, host: str | None) -> None:
    """404 naming the rank (and host) unless ``(host, rank)`` is among the run's ``known`` series:
    one rank's document of a rank the run never had is a wrong address, not an empty chart."""
    if not any(r == rank and (host is None or h == host) for h, r in known):
        where = "" if host is None else f" on host {host!r}"
        raise HTTPException(404, f"rank: no rank {rank}{where} in run {run!r}")
