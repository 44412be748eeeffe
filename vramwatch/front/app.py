"""The federating front: one dashboard and API over every shard's collector.

``vramwatch serve --peers URL[,URL...]`` (or ``--peers-file``, ``--peers-prometheus``) runs
this app instead of a collector. It stores nothing and can run as several replicas.

* Runs list, a run's ranks, events, heatmap, advice, compare figures, post-mortem and
  snapshots are merged across shards (:mod:`vramwatch.front.merge`); each rank row carries
  its ``shard``. Advice and compare are decided on the union of the shards' ranks.
* Captures are forwarded to the shards holding the ranks; snapshot downloads are streamed
  from the shard that stores them.
* Series, chart and phase requests for one rank go to the shard that owns it.
* Every cross-shard request is concurrent and bounded (:mod:`vramwatch.front.fanout`: one
  total deadline ``timeout_s`` per fan-out, ``max_peer_bytes`` per answer, at most
  ``max_concurrent_peers`` at once); a shard that does not answer leaves its ranks listed as
  ``unreachable`` with their last known verdict; a malformed answer is a 502 naming the shard.
* Reads need the token whenever the front holds a peer token (its shards then require read
  credentials, so the front asks its readers for them too); the token goes only to peers the
  operator named or allowed (:mod:`vramwatch.front.peers`).
* ``/metrics`` counts cross-shard requests by shard and outcome, and their latency.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from vramwatch import __about__, verdicts
from vramwatch.collector.serving.params import OptionalRank
from vramwatch.collector.serving.responses import install_error_handlers
from vramwatch.collector.settings import Settings
from vramwatch.collector.snapshots.routes import CaptureRequest
from vramwatch.decisions.compare import RunFigures
from vramwatch.decisions.compare import compare as compare_runs
from vramwatch.front import merge
from vramwatch.front.fanout import MAX_CONCURRENT, MAX_PEER_BYTES, Fanout, stream_chunks
from vramwatch.front.peers import Peer, PeerSource
from vramwatch.remote import MALFORMED, detail_text

_API = "/api/v1/runs/"
#: per-rank requests forwarded to the owning shard
_OWNED = ("series", "chart", "phases")
#: requests a shard may take seconds to answer the first time (snapshot diffs, then cached there)
_SLOW = {"suspects": 30.0}
DIFF_TIMEOUT_S = 30.0


def _snapshots(run: str, answers: Sequence[merge.ShardAnswer], params: dict[str, Any]) -> list[dict[str, Any]]:
    return [merge.snapshot_via_front(s) for s in merge.merge_lists(answers, order=("ts", "rank"))]


def _last(value: Any) -> Any:
    """A query value as the shards read it: of a repeated scalar parameter, the last one."""
    return value[-1] if isinstance(value, list) else value


#: run-level requests merged across shards, and how: (run, every shard's answer, query) -> document
_MERGED: dict[str, Callable[[str, Sequence[merge.ShardAnswer], dict[str, Any]], Any]] = {
    "ranks": lambda run, answers, params: merge.merge_ranks(answers),
    "events": lambda run, answers, params: merge.merge_lists(answers),
    "snapshots": _snapshots,
    "heatmap": lambda run, answers, params: merge.merge_heatmap(answers, int(_last(params.get("cols", 240)))),
    "postmortem": lambda run, answers, params: merge.merge_postmortem(run, answers),
    "suspects": lambda run, answers, params: merge.merge_lists(answers, order=("rank",)),
    "processes": lambda run, answers, params: merge.merge_lists(answers, order=("rank",)),
    "advice": lambda run, answers, params: merge.merge_advice(answers),
    "figures": lambda run, answers, params: merge.merge_figures(run, answers),
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
    #: where it listens, and the Host names a request may carry (a collector's rule:
    #: ``collector.app.allowed_hosts_for``; a loopback bind allows loopback names only)
    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] | None = None
    #: read deadlines and connection cap: the collector's guard and defaults (collector/serving/guard.py)
    header_timeout_s: float = Settings.header_timeout_s
    body_timeout_s: float = Settings.body_timeout_s
    max_connections: int = Settings.max_connections
    health_reserve: int = Settings.health_reserve
    #: the largest answer read from a shard (inflated), and shard requests at once
    max_peer_bytes: int = MAX_PEER_BYTES
    max_concurrent_peers: int = MAX_CONCURRENT

    def __post_init__(self) -> None:
        if self.peer_token and not self.token:
            raise ValueError("a front that sends a token to its shards must ask its readers for one: "
                             "set VRAMWATCH_TOKEN or --token-file")
        for name in ("timeout_s", "max_peer_bytes", "max_concurrent_peers"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)!r}")


def _quote(run: str) -> str:
    from urllib.parse import quote

    return quote(run, safe="")


async def _peers(settings: FrontSettings) -> list[Peer]:
    # a file's re-read may block: never on the event loop (discovery never runs here at all)
    if settings.peers.reads_files:
        return await asyncio.to_thread(settings.peers.current)
    return settings.peers.current()


#: what reading a shard document of the wrong shape raises (bucket 0 divides by zero)
_BAD_SHAPE = (*MALFORMED, ZeroDivisionError, OverflowError)


def _culprit(answers: Sequence[merge.ShardAnswer], read: Callable[[Sequence[merge.ShardAnswer]], Any]) -> str:
    """The first shard whose answer alone fails ``read`` (the one to name in a 502)."""
    for answer in answers:
        try:
            read([answer])
        except _BAD_SHAPE:
            return answer.shard
    return "a shard"


def _merged(what: str, answers: Sequence[merge.ShardAnswer], read: Callable[[Sequence[merge.ShardAnswer]], Any]
            ) -> Any:
    """``read(answers)``; a shard answer of the wrong shape (another version of vramwatch, or
    something else at that address) is a 502 naming the shard and ``what``, not a 500."""
    try:
        return read(answers)
    except _BAD_SHAPE as exc:
        shard = _culprit(answers, read)
        raise HTTPException(502, f"shard {shard}: a malformed {what} answer ({type(exc).__name__}: {exc})"[:500]
                            ) from None


@contextlib.contextmanager
def _malformed_is_502(what: str) -> Iterator[None]:
    """Around code that reads shard answers of several requests (compare): one of the wrong shape
    is a 502 naming ``what``, not a 500."""
    try:
        yield
    except _BAD_SHAPE as exc:
        raise HTTPException(502, f"{what}: a shard answered a malformed document ({type(exc).__name__}: {exc})"
                            ) from None


async def _gather(request: Request, path: str, params: dict[str, Any] | None = None, *,
                  timeout_s: float | None = None) -> list[merge.ShardAnswer]:
    settings: FrontSettings = request.app.state.settings
    timeout = None if timeout_s is None else max(timeout_s, settings.timeout_s)
    return await request.app.state.fanout.get_all(await _peers(settings), path, params, timeout_s=timeout)


async def _run_level(request: Request, run: str, what: str) -> Any:
    # repeated keys (advice's ``reference``) stay lists
    params: dict[str, Any] = {k: (v if len(v) > 1 else v[0]) for k in request.query_params
                              if (v := request.query_params.getlist(k))}
    # each shard has its own versions and pages: the front serves full lists (rows carry no
    # ``version``, so the dashboard does not ask the front for deltas)
    for key in ("since", "compact", "offset", "limit"):
        params.pop(key, None)
    answers = await _gather(request, _API + _quote(run) + "/" + what, params, timeout_s=_SLOW.get(what))
    if all(a.data is None for a in answers):
        refused = next((a for a in answers if a.refused and a.status != 404), None)
        if refused is not None and refused.status:  # a shard refused the parameters: say so, as a collector would
            raise HTTPException(refused.status, refused.error)
        raise HTTPException(404, f"run: no shard knows run {run!r}")
    return _merged(what, answers, lambda some: _MERGED[what](run, some, params))


async def _owner(request: Request, run: str, rank: int, host: str | None) -> Peer:
    by_name = {p.name: p for p in await _peers(request.app.state.settings)}
    answers = await _gather(request, _API + _quote(run) + "/ranks")
    for row in _merged("ranks", answers, merge.merge_ranks):
        if row.get("rank") == rank and (host is None or row.get("host") == host):
            peer = by_name.get(row["shard"])
            if peer is not None:
                return peer
    raise HTTPException(404, f"rank: no shard owns rank {rank} of run {run!r}")


async def _per_rank(request: Request, run: str, what: str, rank: int | None) -> Any:
    """One rank's series/chart/phases from the shard that owns it (``rank`` parsed as a
    collector parses it: :data:`~vramwatch.collector.serving.params.OptionalRank`); phases of no
    rank merged from every shard."""
    if rank is None:
        if what == "phases":
            answers = await _gather(request, _API + _quote(run) + "/phases")
            return _merged("phases", answers, merge.merge_lists)
        raise HTTPException(422, "rank: required")
    peer = await _owner(request, run, rank, request.query_params.get("host"))
    answer = await request.app.state.fanout.get_one(peer, _API + _quote(run) + "/" + what,
                                                     dict(request.query_params))
    if answer.error is not None and not answer.stale:
        return JSONResponse({"detail": f"shard {peer.name}: {answer.error}", "shard": peer.name},
                            status_code=answer.status if answer.refused and answer.status else 504)
    return answer.data


def _add_status_routes(app: FastAPI, read: list[Any]) -> None:
    @app.get("/healthz")
    async def healthz(request: Request) -> dict[str, Any]:
        # liveness never waits on a shard: the outcomes known now (refreshed in the background)
        peers = await _peers(request.app.state.settings)
        return {"status": "ok", "role": "front", "version": __about__.__version__, "shards": len(peers),
                "unreachable": request.app.state.fanout.health(peers)}

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
        answers = await _gather(request, "/api/v1/runs")
        return _merged("runs", answers, merge.merge_runs)



def _route(what: str) -> Callable[..., Any]:
    if what in _OWNED:
        async def handler(request: Request, run: str, rank: OptionalRank = None) -> Any:
            return await _per_rank(request, run, what, rank)
    else:
        async def handler(request: Request, run: str) -> Any:  # type: ignore[misc]
            return await _run_level(request, run, what)

    handler.__name__ = f"front_{what}"
    handler.__doc__ = (f"A run's {what} from the shard that owns the rank" if what in _OWNED
                       else f"A run's {what}, merged across every shard")
    return handler


async def _compare(request: Request, a: Annotated[str, Query(min_length=1)],
                   b: Annotated[str, Query(min_length=1)]) -> dict[str, Any]:
    """Two runs side by side per rank, each joined from every shard holding part of it."""
    answers = await asyncio.gather(*(_gather(request, _API + _quote(r) + "/figures") for r in (a, b)))
    figures = []
    with _malformed_is_502("figures"):
        for field, run, shard_answers in (("a", a, answers[0]), ("b", b, answers[1])):
            doc = merge.merge_figures(run, shard_answers)
            if doc is None:
                raise HTTPException(404, f"{field}: no shard knows run {run!r}")
            figures.append(RunFigures.from_dict(doc))
        return compare_runs(figures[0], figures[1]).as_dict()


async def _capture(request: Request, run: str) -> Any:
    """Ask a run's ranks for an allocator snapshot: forwarded to the shard owning the rank, or to
    every shard holding the run. The shards validate the body (their 4xx comes back as is)."""
    try:  # at most MAX_SMALL_BODY: the front door refused larger ones before this read
        raw = await request.body()
    except ClientDisconnect:  # the client left mid-body: nobody to answer, nothing to log
        return Response(status_code=400)
    try:  # the collector's own model: a body a shard would refuse is refused here, before routing on it
        asked = CaptureRequest.model_validate_json(raw or b"null")
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None
    body = asked.model_dump(exclude_unset=True)
    if asked.rank is not None:
        peers = [await _owner(request, run, asked.rank, asked.host)]
    else:
        answers = await _gather(request, _API + _quote(run) + "/ranks")
        by_name = {p.name: p for p in await _peers(request.app.state.settings)}
        peers = [by_name[a.shard] for a in answers if a.data and not a.stale and a.shard in by_name]
        if not peers:
            raise HTTPException(404, f"run: no reachable shard holds run {run!r}")
    fanout: Fanout = request.app.state.fanout
    replies = await asyncio.gather(*(fanout.post_one(p, _API + _quote(run) + "/capture", body) for p in peers))
    done = [read for status, data in replies if status == 200 and (read := _capture_reply(data)) is not None]
    if not done:
        status, data = replies[0]
        if status == 200:
            raise HTTPException(502, f"shard {peers[0].name}: a malformed capture answer: {str(data)[:200]}")
        detail = detail_text(data.get("detail") if isinstance(data, dict) else data)
        raise HTTPException(status if 400 <= status < 500 else 504, f"shard {peers[0].name}: {detail}")
    return {"run": run, "directives": sum(n for n, _ in done), "ranks": sorted({r for _, ranks in done for r in ranks})}


def _capture_reply(data: Any) -> tuple[int, list[int]] | None:
    """(directives, ranks) of a shard's capture answer; None when it is malformed (that shard then
    counts as not done, like one that failed, and the others' captures still answer)."""
    try:
        return int(data["directives"]), [int(r) for r in data["ranks"]]
    except MALFORMED:
        return None


async def _download(request: Request, snapshot_id: str, shard: str | None = None) -> Response:
    """A snapshot streamed from the shard that stores it (``shard``: its name, as the front's snapshot
    list gives it; without it every shard is asked in turn)."""
    peers = [p for p in await _peers(request.app.state.settings) if shard is None or p.name == shard]
    if not peers:
        raise HTTPException(404, f"shard: no shard named {shard!r}")
    fanout: Fanout = request.app.state.fanout
    for peer in peers:
        reply = await fanout.open_stream(peer, "/api/v1/snapshots/" + _quote(snapshot_id))
        if reply is not None:
            headers = {k: v for k, v in reply.headers.items() if k.lower() in ("content-disposition", "content-length")}
            return StreamingResponse(stream_chunks(reply), media_type=reply.headers.get("content-type"),
                                     headers=headers, background=BackgroundTask(reply.aclose))
    raise HTTPException(404, f"snapshot: no shard has snapshot {snapshot_id!r}")


async def _snapshot_diff(request: Request, run: str) -> Any:
    """Two snapshots' per-site diff from the shard that stores them (the run's ranks, hence its
    snapshots, live on one shard per rank: the shard that has both answers)."""
    params: dict[str, Any] = {k: (v if len(v) > 1 else v[0]) for k in request.query_params
                              if (v := request.query_params.getlist(k))}
    answers = await _gather(request, _API + _quote(run) + "/snapshots/diff", params, timeout_s=DIFF_TIMEOUT_S)
    done = next((a for a in answers if isinstance(a.data, dict) and not a.stale), None)
    if done is not None:
        return {**done.data, "shard": done.shard}
    refused = next((a for a in answers if a.refused and a.status != 404), None)
    if refused is not None and refused.status:
        raise HTTPException(refused.status, refused.error)
    missing = next((a for a in answers if a.status == 404), None)
    raise HTTPException(404 if missing else 504, missing.error if missing else
                        "snapshot: no shard answered in time")


def _add_run_routes(app: FastAPI, read: list[Any]) -> None:
    """The collector's read API, route by route (so the dashboard's OpenAPI check finds each)."""
    from vramwatch.collector.snapshots.routes import require_json

    app.add_api_route(_API + "{run:path}/snapshots/diff", _snapshot_diff, methods=["GET"], dependencies=read)
    for what in (*_MERGED, *_OWNED):
        app.add_api_route(_API + "{run:path}/" + what, _route(what), methods=["GET"], dependencies=read,
                          name=f"front_{what}")
    # JSON only, as on a collector: a cross-site form cannot ask for captures through the front either
    app.add_api_route(_API + "{run:path}/capture", _capture, methods=["POST"],
                      dependencies=[*read, Depends(require_json)])
    app.add_api_route("/api/v1/compare", _compare, methods=["GET"], dependencies=read)
    app.add_api_route("/api/v1/snapshots/{snapshot_id}", _download, methods=["GET"], dependencies=read)


def _add_pages(app: FastAPI, read: list[Any]) -> None:
    from fastapi.staticfiles import StaticFiles

    from vramwatch.collector.serving.pages import dashboard_dir, dashboard_plotly_js_path

    static = dashboard_dir()

    @app.get("/vendor/plotly.min.js", dependencies=read, include_in_schema=False)
    def plotly_js() -> Response:
        return FileResponse(dashboard_plotly_js_path(), media_type="application/javascript")

    @app.get("/", dependencies=read, include_in_schema=False)
    def index() -> Response:
        return FileResponse(static / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=static), name="static")


def create_front_app(settings: FrontSettings) -> FastAPI:
    from vramwatch.collector.serving.deps import supplied_token, token_matches

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import httpx

        from vramwatch.collector.settings import background

        app.state.fanout = Fanout(token=settings.peer_token, timeout_s=settings.timeout_s,
                                  cache_ttl_s=settings.cache_ttl_s, max_bytes=settings.max_peer_bytes,
                                  max_concurrent=settings.max_concurrent_peers)
        # discovery has a client of its own, with no credentials: Prometheus gets no peer token
        discovery = httpx.AsyncClient(follow_redirects=False)
        try:
            if settings.peers.prometheus:
                await settings.peers.discover(discovery)  # bounded: the first list before serving
            discovering = settings.peers.keep_discovering(discovery) if settings.peers.prometheus else None
            async with background(discovering) if discovering else contextlib.nullcontext():
                yield
        finally:
            await discovery.aclose()
            await app.state.fanout.close()

    app = FastAPI(title="vramwatch front", version=__about__.__version__, lifespan=lifespan)
    app.state.settings = settings
    install_error_handlers(app)
    # merged rank tables are megabytes of repetitive JSON; browsers ask for gzip
    app.add_middleware(GZipMiddleware, minimum_size=16 * 1024, compresslevel=1)

    def require_read(request: Request) -> None:
        if not settings.token:
            return
        if not token_matches(supplied_token(request), settings.token):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    read = [Depends(require_read)]
    _add_status_routes(app, read)
    _add_run_routes(app, read)
    _add_pages(app, read)
    return app
