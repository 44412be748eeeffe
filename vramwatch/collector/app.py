"""The collector's HTTP surface: ingest, read API, /metrics and the dashboard.

Ingest is all-or-nothing per request: a batch with one impossible sample is rejected
whole with 422, naming each bad sample's index and field, and nothing is stored.
"""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import orjson
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

from vramwatch import __about__
from vramwatch.collector.downsample import downsample
from vramwatch.collector.live import LiveState, SeriesState
from vramwatch.collector.store import FIELD_COLUMNS, Store, StoreError
from vramwatch.wire import WireError, gunzip_limited, parse_body, validate

log = logging.getLogger("vramwatch.collector")

DEFAULT_SERIES_FIELDS = (
    "allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "nvml_used_bytes", "total_bytes",
)
MAX_ERRORS_LISTED = 50


@dataclass
class Settings:
    db_path: str
    token: str | None = None
    #: also require the token for the dashboard, the read API and /metrics
    auth_read: bool = False
    max_body_bytes: int = 16 * 1024 * 1024
    max_decompressed_bytes: int = 64 * 1024 * 1024
    max_batch_samples: int = 50_000
    #: samples stamped further in the future than this are rejected (clock skew)
    max_future_s: float = 300.0
    #: runs with no sample for this long leave /metrics
    finished_after_s: float = 3600.0


def dashboard_dir() -> Path:
    """The static front-end: inside the wheel, or top-level ``dashboard/`` in a checkout."""
    packaged = Path(__file__).resolve().parent.parent / "_dashboard"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "dashboard"


def plotly_js_path() -> Path:
    import plotly

    return Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"


class JSONBytes(Response):
    """JSON via orjson: the API returns large numeric arrays (series, heatmaps)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def _json_error(status: int, detail: str, **extra: Any) -> Response:
    return JSONBytes({"detail": detail, **extra}, status_code=status)


def create_app(settings: Settings) -> FastAPI:
    from vramwatch.collector.metrics import build_registry, render

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        store = Store(settings.db_path)
        live = LiveState()
        started = time.perf_counter()
        replayed = live.rebuild(store.iter_replay())
        if replayed:
            log.info("rebuilt live state from %d stored samples in %.1f s", replayed, time.perf_counter() - started)
        registry, ingest_metrics = build_registry(live, finished_after_s=settings.finished_after_s)
        app.state.store, app.state.live = store, live
        app.state.registry, app.state.ingest_metrics = registry, ingest_metrics
        try:
            yield
        finally:
            store.close()

    app = FastAPI(
        title="vramwatch collector",
        version=__about__.__version__,
        lifespan=lifespan,
        default_response_class=JSONBytes,
    )
    app.state.settings = settings

    def _authorized(request: Request) -> bool:
        if not settings.token:
            return True
        header = request.headers.get("authorization", "")
        supplied = header[7:] if header[:7].lower() == "bearer " else request.query_params.get("token", "")
        return hmac.compare_digest(supplied.encode(), settings.token.encode())

    def require_ingest_auth(request: Request) -> None:
        if not _authorized(request):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    def require_read_auth(request: Request) -> None:
        if settings.auth_read and not _authorized(request):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    read = [Depends(require_read_auth)]

    # ------------------------------------------------------------------ ingest
    @app.post("/api/v1/samples", dependencies=[Depends(require_ingest_auth)])
    async def ingest(request: Request) -> Response:
        started = time.perf_counter()
        metrics = request.app.state.ingest_metrics
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
            metrics.observe(accepted=0, duplicates=0, rejected=0, seconds=time.perf_counter() - started)
            return _json_error(413, f"body: larger than {settings.max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > settings.max_body_bytes:
                return _json_error(413, f"body: larger than {settings.max_body_bytes} bytes")
            chunks.append(chunk)
        body = b"".join(chunks)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        try:
            if encoding == "gzip":
                body = gunzip_limited(body, settings.max_decompressed_bytes)
            elif encoding not in ("identity", ""):
                return _json_error(415, f"content-encoding: {encoding!r} not supported (use gzip or none)")
            items = parse_body(body)
        except WireError as exc:
            status = 413 if "exceeds" in exc.message else 400
            return _json_error(status, str(exc))
        if len(items) > settings.max_batch_samples:
            return _json_error(413, f"body: {len(items)} samples; at most {settings.max_batch_samples} per request")
        now = time.time()
        valid, errors = [], []
        for index, item in enumerate(items):
            try:
                valid.append(validate(item, now=now, max_future_s=settings.max_future_s))
            except WireError as exc:
                errors.append({"index": index, "field": exc.field, "message": exc.message})
        if errors:
            metrics.observe(accepted=0, duplicates=0, rejected=len(errors), seconds=time.perf_counter() - started)
            first = errors[0]
            return _json_error(
                422,
                f"sample {first['index']}: {first['field']}: {first['message']}"
                + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
                + "; nothing stored",
                accepted=0,
                rejected=len(errors),
                errors=errors[:MAX_ERRORS_LISTED],
            )
        try:
            result = request.app.state.store.insert(valid)
        except StoreError as exc:
            log.error("ingest failed: %s", exc)
            return _json_error(503, str(exc))
        request.app.state.live.ingest(valid, received_at=now)
        metrics.observe(
            accepted=result.accepted, duplicates=result.duplicates, rejected=0, seconds=time.perf_counter() - started
        )
        return JSONBytes({"accepted": result.accepted, "duplicates": result.duplicates, "rejected": 0})

    # ------------------------------------------------------------------ health + metrics
    @app.get("/healthz")
    def healthz(request: Request) -> dict[str, Any]:
        live: LiveState = request.app.state.live
        return {"status": "ok", "version": __about__.__version__, "series": len(live.snapshot())}

    @app.get("/metrics", dependencies=read)
    def metrics_endpoint(request: Request) -> Response:
        payload, content_type = render(request.app.state.registry, request.headers.get("accept"))
        return Response(payload, media_type=content_type)

    # ------------------------------------------------------------------ read API
    def _find_run(request: Request, run: str) -> list[SeriesState]:
        states = request.app.state.live.for_run(run)
        if not states:
            raise HTTPException(404, f"run: no run named {run!r}")
        return states

    @app.get("/api/v1/runs", dependencies=read)
    def runs(request: Request) -> list[dict[str, Any]]:
        return request.app.state.live.run_summaries()

    @app.get("/api/v1/runs/{run}/ranks", dependencies=read)
    def ranks(request: Request, run: str) -> list[dict[str, Any]]:
        return [
            {
                "run": s.run, "host": s.host, "rank": s.rank, "local_rank": s.local_rank, "uuid": s.uuid,
                "gpu": s.gpu, "incarnation": s.incarnation, "samples": s.samples, "last_seen": s.last_seen,
                "last_step": s.last["step"] if s.last else None, "last_ts": s.last["ts"] if s.last else None,
                "last": s.last_train or s.last, "verdict": s.engine.summary(), "events": list(s.events)[-50:],
            }
            for s in _find_run(request, run)
        ]

    @app.get("/api/v1/runs/{run}/events", dependencies=read)
    def events(
        request: Request, run: str, host: str | None = None, rank: Annotated[int | None, Query(ge=0)] = None
    ) -> list[dict[str, Any]]:
        out = []
        for s in _find_run(request, run):
            if (host is None or s.host == host) and (rank is None or s.rank == rank):
                out.extend({"run": s.run, "host": s.host, "rank": s.rank, **e} for e in s.events)
        out.sort(key=lambda e: (e.get("step", 0), e["rank"]))
        return out

    @app.get("/api/v1/runs/{run}/series", dependencies=read)
    def series(
        request: Request,
        run: str,
        rank: Annotated[int, Query(ge=0)],
        host: str | None = None,
        fields: str = ",".join(DEFAULT_SERIES_FIELDS),
        points: Annotated[int, Query(ge=10, le=20000)] = 2000,
        x: Annotated[str, Query(pattern="^(step|ts)$")] = "step",
        phase: str = "train",
        start: float | None = None,
        end: float | None = None,
    ) -> dict[str, Any]:
        names = [f.strip() for f in fields.split(",") if f.strip()]
        # "ts" is allowed as a field with x=step: the dashboard maps steps to wall time
        unknown = [f for f in names if f not in FIELD_COLUMNS]
        if unknown or not names:
            raise HTTPException(422, f"fields: unknown field {unknown[0] if unknown else ''!r}; "
                                     f"choose from {', '.join(k for k in FIELD_COLUMNS if k != 'ts')}")
        if start is not None and end is not None and end < start:
            raise HTTPException(422, "end: must not be before start")
        _find_run(request, run)
        xs, columns = request.app.state.store.query_columns(
            run, host, rank, names, phase=phase, x=x, start=start, end=end
        )
        out_x, out_cols, downsampled = downsample(xs, columns, points)
        return {"run": run, "host": host, "rank": rank, "x_axis": x, "x": out_x, "series": out_cols,
                "raw_points": len(xs), "downsampled": downsampled}

    @app.get("/api/v1/runs/{run}/phases", dependencies=read)
    def phases(
        request: Request, run: str, host: str | None = None, rank: Annotated[int | None, Query(ge=0)] = None
    ) -> list[dict[str, Any]]:
        _find_run(request, run)
        return request.app.state.store.phase_samples(run, host, rank)

    try:
        from vramwatch.collector.views import router as views_router
    except ImportError:  # the dashboard's extra views are optional in a minimal install
        views_router = None
    if views_router is not None:
        app.include_router(views_router, dependencies=read)

    # ------------------------------------------------------------------ dashboard
    static = dashboard_dir()

    @app.get("/vendor/plotly.min.js", dependencies=read, include_in_schema=False)
    def plotly_js() -> Response:
        return FileResponse(plotly_js_path(), media_type="application/javascript")

    @app.get("/", dependencies=read, include_in_schema=False)
    def index() -> Response:
        page = static / "index.html"
        if not page.exists():
            return _json_error(404, "dashboard files are missing from this installation")
        return FileResponse(page, media_type="text/html")

    if static.is_dir():
        app.mount("/static", StaticFiles(directory=static), name="static")

    return app
