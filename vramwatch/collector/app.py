"""The collector's HTTP surface: ingest, read API, /metrics and the dashboard.

Ingest is all-or-nothing per request: a batch with one impossible sample is rejected
whole with 422, naming each bad sample's index and field, and nothing is stored.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import shutil
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import orjson
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from vramwatch import __about__
from vramwatch.collector.downsample import downsample
from vramwatch.collector.live import LiveState, SeriesState
from vramwatch.collector.params import OptionalRank, Rank, check_range, field_list
from vramwatch.collector.routes_evidence import make_router as evidence_router
from vramwatch.collector.routes_evidence import reply_directives
from vramwatch.collector.snapshots import DirectiveBoard, SnapshotStore
from vramwatch.collector.store import FIELD_COLUMNS, RunFullError, Store, StoreBusyError, StoreError
from vramwatch.wire import WireError, gunzip_limited, parse_body, validate

log = logging.getLogger("vramwatch.collector")

DEFAULT_SERIES_FIELDS = (
    "allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "nvml_used_bytes", "total_bytes",
)
MAX_ERRORS_LISTED = 50
#: a commit on the event loop waits at most this long for a lock held elsewhere, then
#: moves to a worker thread
FAST_COMMIT_BUSY_S = 0.05
#: ranks are wire integers (at most 2**53); larger query values are a 422, not an overflow


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
    # ---- limits, so one bad client cannot fill the disk (docs/reliability.md)
    #: a run may store at most this many samples; past it its batches get 422 (None: no cap)
    max_samples_per_run: int | None = 100_000_000
    #: delete samples older than this many days (None: keep everything)
    retention_days: float | None = None
    #: refuse ingest (507, the hook spools and retries) while the DB's disk has less free space
    min_free_bytes: int = 256 * 1024**2
    # ---- durability
    #: seconds between background WAL checkpoints (PASSIVE, off the ingest path)
    checkpoint_interval_s: float = 2.0
    #: seconds between retention passes (when retention_days is set)
    maintenance_interval_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_decompressed_bytes", "max_batch_samples", "maintenance_interval_s",
                     "checkpoint_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)!r}")
        if self.max_samples_per_run is not None and self.max_samples_per_run <= 0:
            raise ValueError(f"max_samples_per_run: must be positive, got {self.max_samples_per_run!r}")
        if self.retention_days is not None and not self.retention_days > 0:
            raise ValueError(f"retention_days: must be positive, got {self.retention_days!r}")
        if self.min_free_bytes < 0:
            raise ValueError(f"min_free_bytes: must not be negative, got {self.min_free_bytes!r}")


def dashboard_dir() -> Path:
    """The static front-end: inside the wheel, or top-level ``dashboard/`` in a checkout."""
    packaged = Path(__file__).resolve().parent.parent / "_dashboard"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "dashboard"


def plotly_js_path() -> Path:
    """The full plotly.js bundle of the plotly package (4.8 MB, every trace type)."""
    import plotly

    return Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"


def dashboard_plotly_js_path() -> Path:
    """plotly.js as the dashboard loads it: the partial (cartesian) bundle vendored in the
    dashboard (1.5 MB, every trace the dashboard draws), else the full one."""
    partial = dashboard_dir() / "vendor" / "plotly-cartesian.min.js"
    return partial if partial.is_file() else plotly_js_path()


class JSONBytes(Response):
    """JSON via orjson: the API returns large numeric arrays (series, heatmaps)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def _json_error(status: int, detail: str, **extra: Any) -> Response:
    return JSONBytes({"detail": detail, **extra}, status_code=status)


TOKEN_COOKIE = "vramwatch_token"


def sample_json_schema() -> dict[str, Any]:
    """JSON Schema of one sample, derived from the wire field table (for the OpenAPI document)."""
    from vramwatch import wire

    return wire.sample_json_schema()


INGEST_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "Samples as a JSON array, one JSON object, or NDJSON; optionally gzip "
                       "(Content-Encoding: gzip). All or nothing: one invalid sample rejects the batch (422).",
        "content": {
            "application/json": {"schema": {"anyOf": [
                {"$ref": "#/components/schemas/Sample"},
                {"type": "array", "items": {"$ref": "#/components/schemas/Sample"}},
            ]}},
            "application/x-ndjson": {"schema": {"type": "string"}},
        },
    },
}


def _digest(text: str) -> bytes:
    # compare fixed-length digests: compare_digest on raw strings leaks their length
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def token_matches(supplied: str | None, token: str) -> bool:
    """Constant-time comparison of a supplied bearer token with the configured one."""
    return hmac.compare_digest(_digest(supplied or ""), _digest(token))


def supplied_token(request: Request) -> str | None:
    """The token a request carries: ``Authorization: Bearer``, else the dashboard's cookie,
    else ``?token=`` (a browser's first visit)."""
    header = request.headers.get("authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip()
    return request.cookies.get(TOKEN_COOKIE) or request.query_params.get("token")


class _DiskGuard:
    """Free space under the database, re-read at most once a second (ingest asks per POST)."""

    def __init__(self, path: str, min_free_bytes: int) -> None:
        self.directory = str(Path(path).resolve().parent)
        self.min_free_bytes = min_free_bytes
        self._checked = 0.0
        self._free = 0

    def free_bytes(self) -> int:
        now = time.monotonic()
        if now - self._checked > 1.0:
            try:
                self._free = shutil.disk_usage(self.directory).free
            except OSError:
                self._free = self.min_free_bytes  # cannot tell: let SQLite report real errors
            self._checked = now
        return self._free

    def low(self) -> bool:
        return self.min_free_bytes > 0 and self.free_bytes() < self.min_free_bytes


class _ProtectedStaticFiles(StaticFiles):
    """Static dashboard files behind the same read check as the API (``--auth-read``)."""

    def __init__(self, *args: Any, allowed: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._allowed(Request(scope)):
            response = _json_error(401, "missing or wrong bearer token")
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


async def _maintenance(app: FastAPI, settings: Settings) -> None:
    """Periodic, in a worker thread: PASSIVE WAL checkpoint (bounds the -wal file without
    stalling ingest), and retention every ``maintenance_interval_s``."""
    store: Store = app.state.store
    last_retention = time.monotonic()
    while True:
        await asyncio.sleep(settings.checkpoint_interval_s)
        try:
            await asyncio.to_thread(store.checkpoint, "PASSIVE")
            if settings.retention_days is not None and \
                    time.monotonic() - last_retention >= settings.maintenance_interval_s:
                last_retention = time.monotonic()
                cutoff = time.time() - settings.retention_days * 86400.0
                deleted = await asyncio.to_thread(store.delete_before, cutoff)
                if deleted:
                    log.info("retention: deleted %d samples older than %g days", deleted, settings.retention_days)
        except StoreError as exc:
            log.warning("maintenance: %s", exc)


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
        app.state.disk = _DiskGuard(settings.db_path, settings.min_free_bytes)
        app.state.snapshots = SnapshotStore.beside(settings.db_path)
        app.state.directives = DirectiveBoard()
        maintenance = asyncio.create_task(_maintenance(app, settings))
        try:
            yield
        finally:
            maintenance.cancel()
            try:
                await maintenance
            except asyncio.CancelledError:
                pass
            # every ingest commits before it answers, so there is nothing buffered to flush:
            # closing folds the WAL into the main file (TRUNCATE) and closes every connection
            store.close()
            log.info("database %s closed cleanly", settings.db_path)

    app = FastAPI(
        title="vramwatch collector",
        version=__about__.__version__,
        lifespan=lifespan,
        default_response_class=JSONBytes,
    )
    app.state.settings = settings
    # /metrics for thousands of ranks and /ranks polls are megabytes of repetitive text;
    # Prometheus and browsers ask for gzip. Level 1: most of the gain for little CPU.
    app.add_middleware(GZipMiddleware, minimum_size=16 * 1024, compresslevel=1)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            spec.setdefault("components", {}).setdefault("schemas", {})["Sample"] = sample_json_schema()
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    def _authorized(request: Request) -> bool:
        if not settings.token:
            return True
        return token_matches(supplied_token(request), settings.token)

    def _read_allowed(request: Request) -> bool:
        return not settings.auth_read or _authorized(request)

    auth_failures_logged: dict[str, float] = {}

    def _refuse(request: Request) -> HTTPException:
        # say who failed (never what they sent), at most once a minute per client address
        client = request.client.host if request.client else "?"
        now = time.monotonic()
        if now - auth_failures_logged.get(client, -1e9) > 60.0:
            if len(auth_failures_logged) > 4096:  # many addresses: forget, never grow unbounded
                auth_failures_logged.clear()
            auth_failures_logged[client] = now
            log.warning("refused %s %s from %s: missing or wrong bearer token", request.method,
                        request.url.path, client)
        return HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    def require_ingest_auth(request: Request) -> None:
        # machines write: only the Authorization header counts (a browser's cookie must not)
        header = request.headers.get("authorization", "")
        supplied = header[7:].strip() if header[:7].lower() == "bearer " else None
        if settings.token and not token_matches(supplied, settings.token):
            raise _refuse(request)

    def require_read_auth(request: Request) -> None:
        if settings.auth_read and not _authorized(request):
            raise _refuse(request)

    read = [Depends(require_read_auth)]
    app.include_router(evidence_router(require_ingest_auth, require_read_auth))

    # ------------------------------------------------------------------ ingest
    # One writer at a time, and the live engines fed in commit order. Normally a commit takes
    # about a millisecond and runs right on the event loop (a thread hop costs more than it
    # saves under load). When the database is locked by someone else, or the lock is held
    # by a waiting commit, the batch waits in a worker thread instead: only ingest stalls,
    # never the event loop (health, reads, /metrics).
    commit_lock = threading.Lock()

    def _commit(state: Any, valid: list[Any], now: float, busy_timeout_s: float | None) -> Any:
        result = state.store.insert(valid, max_samples_per_run=settings.max_samples_per_run,
                                    busy_timeout_s=busy_timeout_s)
        raised = state.live.ingest(valid, received_at=now)
        if raised:
            state.directives.on_events(raised, lambda run: [x.key for x in state.live.for_run(run)], now)
        return result

    def _commit_waiting(state: Any, valid: list[Any], now: float) -> Any:
        with commit_lock:
            return _commit(state, valid, now, None)  # the store's full busy timeout (10 s)

    async def commit(state: Any, valid: list[Any], now: float) -> Any:
        if commit_lock.acquire(blocking=False):
            try:
                return _commit(state, valid, now, FAST_COMMIT_BUSY_S)
            except StoreBusyError:
                pass  # locked elsewhere: wait for it off the loop
            finally:
                commit_lock.release()
        return await asyncio.to_thread(_commit_waiting, state, valid, now)

    @app.post("/api/v1/samples", dependencies=[Depends(require_ingest_auth)], openapi_extra=INGEST_OPENAPI)
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
        if request.app.state.disk.low():
            free = request.app.state.disk.free_bytes()
            log.warning("ingest refused: %d MiB free on the database's disk", free // 2**20)
            metrics.observe(accepted=0, duplicates=0, rejected=0, seconds=time.perf_counter() - started)
            return _json_error(
                507, f"disk: only {free // 2**20} MiB free for the database, below the "
                     f"{settings.min_free_bytes // 2**20} MiB reserve (min_free_bytes); retry later, nothing stored")
        try:
            result = await commit(request.app.state, valid, now)
        except RunFullError as exc:
            metrics.observe(accepted=0, duplicates=0, rejected=len(valid), seconds=time.perf_counter() - started)
            return _json_error(422, f"{exc}; nothing stored", accepted=0, rejected=len(valid), errors=[])
        except StoreError as exc:
            log.error("ingest failed: %s", exc)
            return _json_error(503, str(exc))
        metrics.observe(
            accepted=result.accepted, duplicates=result.duplicates, rejected=0, seconds=time.perf_counter() - started
        )
        reply: dict[str, Any] = {"accepted": result.accepted, "duplicates": result.duplicates, "rejected": 0}
        directives = reply_directives(request.app.state, valid)
        if directives:
            reply["directives"] = directives
        return JSONBytes(reply)

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

    @app.get("/api/v1/meta", dependencies=read)
    def meta() -> dict[str, Any]:
        from vramwatch import verdicts

        return verdicts.meta()

    @app.get("/api/v1/runs", dependencies=read)
    def runs(request: Request) -> list[dict[str, Any]]:
        return request.app.state.live.run_summaries()

    @app.get("/api/v1/runs/{run:path}/ranks", dependencies=read)
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

    @app.get("/api/v1/runs/{run:path}/events", dependencies=read)
    def events(
        request: Request, run: str, host: str | None = None, rank: OptionalRank = None
    ) -> list[dict[str, Any]]:
        out = []
        for s in _find_run(request, run):
            if (host is None or s.host == host) and (rank is None or s.rank == rank):
                out.extend({"run": s.run, "host": s.host, "rank": s.rank, **e} for e in s.events)
        out.sort(key=lambda e: (e.get("step", 0), e["rank"]))
        return out

    @app.get("/api/v1/runs/{run:path}/series", dependencies=read)
    def series(
        request: Request,
        run: str,
        rank: Rank,
        host: str | None = None,
        fields: str = ",".join(DEFAULT_SERIES_FIELDS),
        points: Annotated[int, Query(ge=10, le=20000)] = 2000,
        x: Annotated[str, Query(pattern="^(step|ts)$")] = "step",
        phase: str = "train",
        start: Annotated[float | None, Query(allow_inf_nan=False)] = None,
        end: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    ) -> dict[str, Any]:
        # "ts" is allowed as a field with x=step: the dashboard maps steps to wall time
        names = field_list(fields, FIELD_COLUMNS, [k for k in FIELD_COLUMNS if k != "ts"])
        check_range(start, end)
        _find_run(request, run)
        xs, columns = request.app.state.store.query_columns(
            run, host, rank, names, phase=phase, x=x, start=start, end=end
        )
        out_x, out_cols, downsampled = downsample(xs, columns, points)
        return {"run": run, "host": host, "rank": rank, "x_axis": x, "x": out_x, "series": out_cols,
                "raw_points": len(xs), "downsampled": downsampled}

    @app.get("/api/v1/runs/{run:path}/phases", dependencies=read)
    def phases(
        request: Request, run: str, host: str | None = None, rank: OptionalRank = None
    ) -> list[dict[str, Any]]:
        _find_run(request, run)
        return request.app.state.store.phase_samples(run, host, rank)

    try:
        from vramwatch.collector.views import router as views_router
    except ImportError:  # the dashboard's extra views are optional in a minimal install
        views_router = None
    if views_router is not None:
        app.include_router(views_router, dependencies=read)
    from vramwatch.collector.routes_decisions import router as decisions_router

    app.include_router(decisions_router, dependencies=read)

    # ------------------------------------------------------------------ dashboard
    static = dashboard_dir()

    @app.get("/vendor/plotly.min.js", dependencies=read, include_in_schema=False)
    def plotly_js() -> Response:
        return FileResponse(dashboard_plotly_js_path(), media_type="application/javascript")

    @app.get("/", dependencies=read, include_in_schema=False)
    def index(request: Request) -> Response:
        page = static / "index.html"
        if not page.exists():
            return _json_error(404, "dashboard files are missing from this installation")
        response = FileResponse(page, media_type="text/html")
        if settings.auth_read and settings.token and token_matches(request.query_params.get("token"), settings.token):
            # a browser opened /?token=...: keep it in a cookie the page's own requests carry,
            # never readable by scripts, never sent to other sites
            response.set_cookie(TOKEN_COOKIE, settings.token, httponly=True, samesite="strict", path="/")
        return response

    if static.is_dir():
        app.mount("/static", _ProtectedStaticFiles(directory=static, allowed=_read_allowed), name="static")

    return app
