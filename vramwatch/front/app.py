"""The federating front: one dashboard and API over every shard's collector.

``vramwatch serve --peers URL[,URL...]`` (or ``--peers-file``, ``--peers-prometheus``) runs
this app instead of a collector. It stores nothing and can run as several replicas.

* Runs list, a run's ranks, events, heatmap, advice, post-mortem and snapshots are merged
  across shards (:mod:`vramwatch.front.merge`); each rank row carries its ``shard``.
* Series, chart and phase requests for one rank go to the shard that owns it.
* Every cross-shard request is concurrent and bounded by ``timeout_s``; a shard that does
  not answer leaves its ranks listed as ``unreachable`` with their last known verdict.
* ``/metrics`` counts cross-shard requests by shard and outcome, and their latency.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vramwatch import __about__, verdicts
from vramwatch.front import merge
from vramwatch.front.fanout import Fanout
from vramwatch.front.peers import Peer, PeerSource

_API = "/api/v1/runs/"
#: per-rank requests forwarded to the owning shard
_OWNED = ("series", "chart", "phases")
#: run-level requests merged across shards, and how
_MERGED = {
    "ranks": merge.merge_ranks,
    "events": merge.merge_lists,
    "snapshots": lambda answers: merge.merge_lists(answers, order=("ts", "rank")),
}


@dataclass
class FrontSettings:
    peers: PeerSource
    #: token this front requires for reads (None: open, like a collector without --auth-read)
    token: str | None = None
    #: token sent to the shards
    peer_token: str | None = None
    timeout_s: float = 2.0
    cache_ttl_s: float = 1.0


def _quote(run: str) -> str:
    from urllib.parse import quote

    return quote(run, safe="")


async def _peers(settings: FrontSettings) -> list[Peer]:
    # a file re-read or a Prometheus discovery may block: never on the event loop
    return await asyncio.to_thread(settings.peers.current)


async def _gather(request: Request, path: str, params: dict[str, Any] | None = None) -> list[merge.ShardAnswer]:
    settings: FrontSettings = request.app.state.settings
    return await request.app.state.fanout.get_all(await _peers(settings), path, params)


async def _run_level(request: Request, run: str, what: str) -> Any:
    params = dict(request.query_params)
    params.pop("since", None)  # each shard has its own versions: the front serves full lists
    answers = await _gather(request, _API + _quote(run) + "/" + what, params)
    if all(a.data is None for a in answers):
        raise HTTPException(404, f"run: no shard knows run {run!r}")
    if what in _MERGED:
        return _MERGED[what](answers)
    if what == "heatmap":
        return merge.merge_heatmap(answers)
    if what == "postmortem":
        return merge.merge_postmortem(run, answers)
    if what == "advice":
        return merge.merge_advice(answers)
    raise HTTPException(404, f"{what}: not served by the front")


async def _owner(request: Request, run: str, rank: int, host: str | None) -> Peer:
    by_name = {p.name: p for p in await _peers(request.app.state.settings)}
    for row in merge.merge_ranks(await _gather(request, _API + _quote(run) + "/ranks")):
        if row.get("rank") == rank and (host is None or row.get("host") == host):
            peer = by_name.get(row["shard"])
            if peer is not None:
                return peer
    raise HTTPException(404, f"rank: no shard owns rank {rank} of run {run!r}")


async def _per_run(request: Request, run: str, what: str) -> Any:
    """Run-level answers merged; one rank's series/chart/phases from the shard that owns it."""
    if what not in _OWNED:
        return await _run_level(request, run, what)
    rank_text = request.query_params.get("rank")
    if rank_text is None:
        if what == "phases":
            return merge.merge_lists(await _gather(request, _API + _quote(run) + "/phases"))
        raise HTTPException(422, "rank: required")
    if not rank_text.isdigit():
        raise HTTPException(422, f"rank: not a non-negative integer: {rank_text!r}")
    peer = await _owner(request, run, int(rank_text), request.query_params.get("host"))
    answer = await request.app.state.fanout.get_one(peer, _API + _quote(run) + "/" + what,
                                                     dict(request.query_params))
    if answer.error is not None and not answer.stale:
        return JSONResponse({"detail": f"shard {peer.name}: {answer.error}", "shard": peer.name},
                            status_code=404 if answer.error == "404" else 504)
    return answer.data


def _add_status_routes(app: FastAPI, read: list[Any]) -> None:
    @app.get("/healthz")
    async def healthz(request: Request) -> dict[str, Any]:
        answers = await _gather(request, "/healthz")
        return {"status": "ok", "role": "front", "version": __about__.__version__, "shards": len(answers),
                "unreachable": request.app.state.fanout.unreachable(answers)}

    @app.get("/metrics", dependencies=read)
    def metrics(request: Request) -> Response:
        return Response(generate_latest(request.app.state.fanout.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/v1/meta", dependencies=read)
    def meta() -> dict[str, Any]:
        return {**verdicts.meta(), "role": "front"}

    @app.get("/api/v1/shards", dependencies=read)
    async def shards(request: Request) -> list[dict[str, Any]]:
        answers = await _gather(request, "/healthz")
        peers = await _peers(request.app.state.settings)
        return [{"shard": a.shard, "url": p.url, "reachable": a.error is None, "error": a.error}
                for a, p in zip(answers, peers, strict=False)]

    @app.get("/api/v1/runs", dependencies=read)
    async def runs(request: Request) -> list[dict[str, Any]]:
        return merge.merge_runs(await _gather(request, "/api/v1/runs"))

    app.add_api_route(_API + "{run:path}/{what}", _per_run, methods=["GET"], dependencies=read)


def _add_pages(app: FastAPI, read: list[Any]) -> None:
    from fastapi.staticfiles import StaticFiles

    from vramwatch.collector.pages import dashboard_dir, dashboard_plotly_js_path

    static = dashboard_dir()

    @app.get("/vendor/plotly.min.js", dependencies=read, include_in_schema=False)
    def plotly_js() -> Response:
        return FileResponse(dashboard_plotly_js_path(), media_type="application/javascript")

    @app.get("/", dependencies=read, include_in_schema=False)
    def index() -> Response:
        return FileResponse(static / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=static), name="static")


def create_front_app(settings: FrontSettings) -> FastAPI:
    from vramwatch.collector.deps import token_matches

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.fanout = Fanout(token=settings.peer_token, timeout_s=settings.timeout_s,
                                  cache_ttl_s=settings.cache_ttl_s)
        try:
            yield
        finally:
            await app.state.fanout.close()

    app = FastAPI(title="vramwatch front", version=__about__.__version__, lifespan=lifespan)
    app.state.settings = settings
    # merged rank tables are megabytes of repetitive JSON; browsers ask for gzip
    app.add_middleware(GZipMiddleware, minimum_size=16 * 1024, compresslevel=1)

    def require_read(request: Request) -> None:
        if not settings.token:
            return
        header = request.headers.get("authorization", "")
        supplied = header[7:].strip() if header[:7].lower() == "bearer " else request.cookies.get("vramwatch_token")
        if not token_matches(supplied, settings.token):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    read = [Depends(require_read)]
    _add_status_routes(app, read)
    _add_pages(app, read)
    return app
