"""The collector application, in FastAPI's "bigger applications" shape.

``create_app(settings)`` wires the routers (``ingest``, ``api``, ``views``, ``pages``) to
the state the lifespan builds on ``app.state`` — the store, the live state, the metrics
registry, the ingest path and the dashboard's view caches — and closes all of it, caches
first, store last, when the server stops.

:class:`~vramwatch.collector.serving.door.FrontDoor` wraps it: the ``Host`` check, a quiet end
for requests cancelled by shutdown, and the two hot routes (ingest, ``/healthz``) served
without the framework's routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.middleware.gzip import GZipMiddleware

from vramwatch import __about__
from vramwatch.collector.ingest import routes as ingest
from vramwatch.collector.ingest.processes import ProcessBook
from vramwatch.collector.reads import api
from vramwatch.collector.reads.heavy import HeavyReads
from vramwatch.collector.serving import pages
from vramwatch.collector.serving.deps import RateLimitedLog, require_ingest_auth, require_read_auth
from vramwatch.collector.serving.door import FrontDoor
from vramwatch.collector.serving.openapi import INGEST_OPERATION, sample_json_schema
from vramwatch.collector.serving.pages import dashboard_dir, dashboard_plotly_js_path
from vramwatch.collector.serving.responses import JSONBytes, install_error_handlers
from vramwatch.collector.settings import Settings, background
from vramwatch.collector.snapshots.diffs import DiffCache
from vramwatch.collector.snapshots.directives import DirectiveBoard, SnapshotStore
from vramwatch.collector.snapshots.routes import make_router as evidence_router
from vramwatch.collector.state.live import LiveState, tune_gc_for_serving
from vramwatch.collector.state.restore import restore
from vramwatch.collector.store import Store, StoreError

log = logging.getLogger("vramwatch.collector")

__all__ = [
    "Settings", "create_app", "dashboard_dir", "dashboard_plotly_js_path", "sample_json_schema",
]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def allowed_hosts_for(bind_host: str, allowed_hosts: Sequence[str] | None) -> frozenset[str] | None:
    """Host names (without port) a request may name; None: any. Explicit ``allowed_hosts``
    win; a loopback bind allows only loopback names; a wildcard or LAN bind allows any
    (set ``--allowed-host`` to restrict it). The collector's rule and the front's."""
    if allowed_hosts is not None:
        return frozenset(h.lower().strip("[]") for h in allowed_hosts)
    host = bind_host.strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    return frozenset((*LOOPBACK_NAMES, host.lower())) if loopback else None


async def _maintenance(app: FastAPI, settings: Settings) -> None:
    """Periodic, in a worker thread: PASSIVE WAL checkpoint (bounds the -wal file without
    stalling ingest), eviction of quiet runs' live state, and retention every
    ``maintenance_interval_s``."""
    store: Store = app.state.store
    live: LiveState = app.state.live
    last_slow = time.monotonic()
    while True:
        await asyncio.sleep(settings.checkpoint_interval_s)
        try:
            await asyncio.to_thread(store.checkpoint, "PASSIVE")
            if time.monotonic() - last_slow < settings.maintenance_interval_s:
                continue
            last_slow = time.monotonic()
            evicted = live.evict_quiet(time.time() - settings.finished_after_s)
            if evicted:
                log.info("evicted the live state of %d finished run(s)", len(evicted))
            if settings.retention_days is not None:
                cutoff = time.time() - settings.retention_days * 86400.0
                result = await asyncio.to_thread(store.retain, cutoff)
                if result.samples:
                    log.info("retention: deleted %d samples older than %g days", result.samples,
                             settings.retention_days)
                live.forget(result.runs)
                live.forget_series(result.keys)
        except StoreError as exc:
            log.warning("maintenance: %s", exc)


def close_state(app: Any, settings: Settings) -> None:
    """Caches first, the store last (its close folds the WAL into the main file). A failure
    is one line and a flag server.py turns into a non-zero exit."""
    views = _views()
    if views is not None:
        views.forget_caches(settings.db_path)
    heavy = getattr(app.state, "heavy", None)
    if heavy is not None:  # its idle threads end; one still computing ends with its work
        heavy.close()
    try:
        app.state.store.close()
    except (StoreError, OSError) as exc:
        app.state.shutdown_error = f"database {settings.db_path} was not closed cleanly: {exc}"
        log.error("%s", app.state.shutdown_error)
        return
    log.info("database %s closed cleanly", settings.db_path)


class _Views:
    """The dashboard's view module, when installed: its router and its per-database caches
    (the routes find them by database path; the lifespan creates them and drops them)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.router = module.router

    def create_caches(self, db_path: str) -> tuple[Any, Any]:
        return self.module.heatmap_cache(db_path), self.module.envelope_cache(db_path)

    def forget_caches(self, db_path: str) -> None:
        for registry in (self.module._caches, self.module._envelopes):
            cache = registry.pop(db_path, None)
            close = getattr(cache, "close", None)
            if close is not None:
                close()


def _views() -> _Views | None:
    try:
        from vramwatch.collector.reads import charts as views
    except ImportError:  # the dashboard's extra views are optional in a minimal install
        return None
    return _Views(views)


def open_state(app: Any, settings: Settings) -> None:
    """Open the store and rebuild the live state of running runs on ``app.state`` (the lifespan
    does it when nothing did before). ``vramwatch serve`` calls it before it listens, so a
    database that cannot be read (damaged pages the restore reaches) fails as one
    :class:`StoreError` line instead of a traceback in the lifespan.
    Cost: the restore's replay of recent runs (seconds for millions of samples)."""
    from vramwatch.collector.exporters.metrics import build_registry

    store = Store(settings.db_path, exclusive=True)  # a second collector on the file refuses to start
    live = LiveState(silent_after_s=settings.silent_after_s, kept_suspected=store.suspected_records)
    tune_gc_for_serving()
    try:
        done = restore(live, store, cutoff=time.time() - settings.finished_after_s)
    except StoreError:  # the store's reads translate sqlite3's errors (a damaged page): close, then say it
        with contextlib.suppress(StoreError, sqlite3.Error):
            store.close()
        raise
    if done["samples"] or done["retired_runs"]:
        log.info("rebuilt live state from %d stored samples in %.1f s (%d finished runs listed, not replayed)",
                 done["samples"], done["seconds"], done["retired_runs"])
    app.state.store, app.state.live = store, live
    app.state.processes = ProcessBook.beside(settings.db_path)
    app.state.registry, app.state.ingest_metrics = build_registry(live, finished_after_s=settings.finished_after_s,
                                                                  processes=app.state.processes)
    app.state.ingestor = ingest.Ingestor(app.state, settings)
    app.state.snapshots = SnapshotStore.beside(
        settings.db_path, max_snapshot_bytes=settings.max_snapshot_bytes, max_snapshots=settings.max_snapshots,
        max_total_bytes=settings.max_snapshots_bytes, max_concurrent_uploads=settings.max_concurrent_uploads,
        owner=True)
    app.state.diffs = DiffCache(app.state.snapshots)
    app.state.heavy = HeavyReads()
    app.state.directives = DirectiveBoard(manual_interval_s=settings.capture_interval_s)
    views = _views()
    if views is not None:
        app.state.heatmaps, app.state.envelopes = views.create_caches(settings.db_path)


def create_app(settings: Settings) -> FrontDoor:
    """The ASGI application: :class:`FrontDoor` around the FastAPI app (``.state``,
    ``.routes`` and the rest are the FastAPI app's)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if getattr(app.state, "store", None) is None:
            open_state(app, settings)
        guard = getattr(app.state, "guard", None)
        if guard is not None:  # accept() failures: one rate-limited line, not a traceback each
            asyncio.get_running_loop().set_exception_handler(guard.loop_exception)
        try:
            async with background(_maintenance(app, settings)), contextlib.AsyncExitStack() as hooks:
                for hook in settings.lifespan_hooks:  # extensions: OTLP export, `vramwatch watch`
                    await hooks.enter_async_context(hook(app))
                yield
        finally:
            # every ingest commits before it answers, so there is nothing buffered to flush
            close_state(app, settings)

    app = FastAPI(title="vramwatch collector", version=__about__.__version__, lifespan=lifespan,
                  default_response_class=JSONBytes)
    app.state.settings = settings
    app.state.shutdown_error = None
    app.state.refusals = RateLimitedLog(log)
    install_error_handlers(app)
    # /metrics for thousands of ranks and /ranks polls are megabytes of repetitive text;
    # Prometheus and browsers ask for gzip. Level 1: most of the gain for little CPU.
    app.add_middleware(GZipMiddleware, minimum_size=16 * 1024, compresslevel=1)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            spec["paths"] = {ingest.PATH: {"post": INGEST_OPERATION}, **spec["paths"]}
            spec.setdefault("components", {}).setdefault("schemas", {})["Sample"] = sample_json_schema()
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.router.routes.append(ingest.Route())
    app.include_router(evidence_router(require_ingest_auth, require_read_auth))
    app.include_router(api.health_router)
    app.include_router(api.router)
    views = _views()
    if views is not None:
        app.include_router(views.router, dependencies=[Depends(require_read_auth)])
    from vramwatch.collector.reads.advice import router as decisions_router

    app.include_router(decisions_router, dependencies=[Depends(require_read_auth)])
    app.include_router(pages.router)
    pages.mount_static(app)
    return FrontDoor(app, allowed_hosts_for(settings.bind_host, settings.allowed_hosts))
