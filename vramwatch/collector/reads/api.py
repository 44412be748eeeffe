"""The read API router: runs, ranks, events, series, phases, meta; plus /healthz and /metrics.

Everything but ``/series`` and ``/phases`` answers from live state (no database I/O).
Bounds: ``/ranks`` answers at most ``limit`` rows (default and cap
:data:`~vramwatch.collector.state.rows.MAX_RANK_ROWS`, ``offset`` pages); ``?compact=1`` drops
the latest sample's fields the table does not show and the events (~350 B per rank);
``?since=<version>`` answers only rows changed since that version (delta polling).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import Response

from vramwatch import __about__, verdicts
from vramwatch.collector.serving.deps import LiveDep, StoreDep, require_read_auth
from vramwatch.collector.serving.params import (
    Bound,
    OptionalRank,
    Phase,
    Points,
    Rank,
    check_range,
    field_list,
    require_rank,
)
from vramwatch.collector.state.live import LiveState, SeriesState
from vramwatch.collector.state.rows import COMPACT_COLUMNS, MAX_RANK_ROWS, ROW_EVENTS, rank_rows
from vramwatch.collector.store import FIELD_COLUMNS, Store
from vramwatch.runlife import RunStory

DEFAULT_SERIES_FIELDS = (
    "allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "nvml_used_bytes", "total_bytes",
)

#: /healthz is open (load balancers, the hook's start-up check); everything else here
#: follows --auth-read
health_router = APIRouter()
router = APIRouter(dependencies=[Depends(require_read_auth)])


@health_router.get("/healthz")
def healthz(live: LiveDep) -> dict[str, Any]:
    return {"status": "ok", "version": __about__.__version__, "series": len(live)}


@router.get("/metrics")
def metrics_endpoint(request: Request) -> Response:
    from vramwatch.collector.exporters.metrics import render

    payload, content_type = render(request.app.state.registry, request.headers.get("accept"))
    return Response(payload, media_type=content_type)


@router.get("/api/v1/meta")
def meta() -> dict[str, Any]:
    """The verdict vocabulary (states, severity, liveness, run statuses, headroom names)."""
    return {**verdicts.meta(), "version": __about__.__version__, "max_rank_rows": MAX_RANK_ROWS}


def find_run(live: LiveState, run: str, store: Store | None = None) -> list[SeriesState]:
    """The run's series: live, or (with ``store``) an evicted run rebuilt on demand; else 404."""
    states = live.for_run(run)
    if not states and store is not None:
        states = live.revived(run, store.iter_samples)
    if not states:
        raise HTTPException(404, f"run: no run named {run!r}")
    return states


@router.get("/api/v1/runs")
def runs(live: LiveDep) -> list[dict[str, Any]]:
    return live.run_summaries()


def _mark_liveness_changes(live: LiveState, states: list[SeriesState], story: RunStory) -> None:
    # liveness changes with time, not only with ingest (a rank is judged killed once its peers
    # went on): a rank whose liveness changed since it was last shown counts as changed, so
    # delta polls see it
    index = story.index()
    for state in states:
        rank = index.get((state.host, state.rank))
        shown = "" if rank is None else str(rank.liveness)
        if shown != state.shown_liveness:
            state.shown_liveness = shown
            live.touch(state)


@router.get("/api/v1/runs/{run:path}/ranks", response_model=None)
def ranks(
    live: LiveDep,
    store: StoreDep,
    run: str,
    compact: bool = False,
    since: Annotated[int | None, Query(ge=0)] = None,
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_RANK_ROWS)] = MAX_RANK_ROWS,
) -> list[Any] | dict[str, Any]:
    """Rows of the run's ranks (by rank). Plain: a list of row objects, as before. With
    ``compact`` or ``since``: ``{"run", "version", "total", "rows"}`` (compact: ``columns``
    names the values of each row list); keep ``version`` for the next ``since``."""
    states = find_run(live, run, store)
    story = live.story(run, states, time.time())
    _mark_liveness_changes(live, states, story)
    version = live.version
    if since is not None:
        states = [s for s in states if s.version > since]
    page = rank_rows(live.freeze_states(states[offset:offset + limit], story, events=0 if compact else ROW_EVENTS),
                     compact=compact)
    if not compact and since is None:
        return page
    doc: dict[str, Any] = {"run": run, "version": version, "total": len(states), "rows": page}
    if compact:
        doc["columns"] = list(COMPACT_COLUMNS)
    return doc


@router.get("/api/v1/runs/{run:path}/events")
def events(live: LiveDep, store: StoreDep, run: str, host: str | None = None,
           rank: OptionalRank = None) -> list[dict[str, Any]]:
    """The engines' events in time order (``ts``: the sample that raised it), each with its process
    (``incarnation``) and ``attempt`` (1 for the rank's first process, 2 after one restart ...)."""
    out = []
    for s in find_run(live, run, store):
        if (host is None or s.host == host) and (rank is None or s.rank == rank):
            attempt = {rec.incarnation: i for i, rec in enumerate(s.life.records(), 1)}
            out.extend({"run": s.run, "host": s.host, "rank": s.rank, **e,
                        "attempt": attempt.get(e.get("incarnation", ""), len(attempt))} for e in s.events)
    out.sort(key=lambda e: (e.get("ts") or 0.0, e.get("step", 0), e["rank"]))
    return out


@router.get("/api/v1/runs/{run:path}/series")
def series(
    live: LiveDep,
    store: StoreDep,
    run: str,
    rank: Rank,
    host: str | None = None,
    fields: str = ",".join(DEFAULT_SERIES_FIELDS),
    points: Points = 2000,
    x: Annotated[str, Query(pattern="^(step|ts)$")] = "step",
    phase: Phase = "train",
    start: Bound = None,
    end: Bound = None,
) -> dict[str, Any]:
    # "ts" is allowed as a field with x=step: the dashboard maps steps to wall time
    names = field_list(fields, FIELD_COLUMNS, [k for k in FIELD_COLUMNS if k != "ts"])
    check_range(start, end)
    require_rank(((s.host, s.rank) for s in find_run(live, run, store)), run, rank, host)
    window = store.series_window(run, host, rank, names, phase=phase, x=x, start=start, end=end, points=points)
    return {"run": run, "host": host, "rank": rank, "x_axis": x, "x": window.x, "series": window.series,
            "raw_points": window.raw_points, "downsampled": window.downsampled}


@router.get("/api/v1/runs/{run:path}/phases")
def phases(live: LiveDep, store: StoreDep, run: str, host: str | None = None,
           rank: OptionalRank = None) -> list[dict[str, Any]]:
    find_run(live, run, store)
    return store.phase_samples(run, host, rank)
