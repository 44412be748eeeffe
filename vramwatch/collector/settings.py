"""The collector's settings: every limit a client can reach has a field here and a default
(docs/reliability.md lists each bound, its default and the test that holds it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any


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
    #: runs with no sample for this long leave /metrics, and their live state is evicted
    finished_after_s: float = 3600.0
    #: one silence window for every rank (``serve --silent-after``); None: each rank's own, from
    #: its step time (vramwatch.verdicts.silence_window)
    silent_after_s: float | None = None
    # ---- limits, so one bad client cannot fill the disk or the memory (docs/reliability.md)
    #: a run may store at most this many samples; past it its batches get 422 (None: no cap)
    max_samples_per_run: int | None = 100_000_000
    #: live series (run, host, rank) held in memory at once; a batch that would add more: 422
    max_series: int = 20_000
    #: series of one run; a batch that would add more: 422
    max_ranks_per_run: int = 16_384
    #: delete samples older than this many days (None: keep everything)
    retention_days: float | None = None
    #: refuse ingest (507, the hook spools and retries) while the DB's disk has less free space
    min_free_bytes: int = 256 * 1024**2
    # ---- allocator snapshots (vramwatch/collector/snapshots/directives.py)
    #: one snapshot's upload (gzip) at most; the folder's snapshots and bytes (oldest evicted)
    max_snapshot_bytes: int = 64 * 2**20
    max_snapshots: int = 10_000
    max_snapshots_bytes: int = 2 * 2**30
    #: uploads received at once (others wait up to a minute, then 503)
    max_concurrent_uploads: int = 4
    #: a person's capture request reaches a rank at most this often (429 otherwise)
    capture_interval_s: float = 60.0
    # ---- connections (vramwatch/collector/serving/guard.py)
    #: a request's headers must arrive within this many seconds of its first byte (or of the
    #: connection's start)
    header_timeout_s: float = 10.0
    #: and its body within this many seconds of the end of the headers
    body_timeout_s: float = 10.0
    #: open connections; past it a new connection gets 503 at once (hooks back off and retry)
    max_connections: int = 8192
    #: extra connections past ``max_connections`` that may only ask ``/healthz``
    health_reserve: int = 16
    #: request bodies decoded at once; others wait up to ``ingest_queue_s``, then 503
    max_concurrent_ingest: int = 4
    ingest_queue_s: float = 5.0
    #: Host header values accepted (DNS rebinding); None: loopback names when bound to a
    #: loopback address, any name otherwise (see app.allowed_hosts_for)
    allowed_hosts: tuple[str, ...] | None = None
    #: seconds SIGTERM waits for running requests before cancelling them
    shutdown_timeout_s: float = 10.0
    # ---- durability
    #: seconds between background WAL checkpoints (PASSIVE, off the ingest path)
    checkpoint_interval_s: float = 2.0
    #: seconds between retention passes (when retention_days is set)
    maintenance_interval_s: float = 60.0
    #: the address the server is bound to (set by server.py; used for the Host check)
    bind_host: str = field(default="127.0.0.1")
    #: ``hook(app) -> async context manager`` entered after the store and live state are up,
    #: exited before the store closes (collector/exporters/otlp.py, collector/exporters/device_watch.py)
    lifespan_hooks: tuple[Callable[[Any], AbstractAsyncContextManager[None]], ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_decompressed_bytes", "max_batch_samples", "maintenance_interval_s",
                     "checkpoint_interval_s", "max_series", "max_ranks_per_run", "header_timeout_s",
                     "body_timeout_s", "max_connections", "max_concurrent_ingest", "ingest_queue_s",
                     "shutdown_timeout_s", "max_snapshot_bytes", "max_snapshots", "max_snapshots_bytes",
                     "max_concurrent_uploads"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)!r}")
        if self.max_samples_per_run is not None and self.max_samples_per_run <= 0:
            raise ValueError(f"max_samples_per_run: must be positive, got {self.max_samples_per_run!r}")
        if self.retention_days is not None and not self.retention_days > 0:
            raise ValueError(f"retention_days: must be positive, got {self.retention_days!r}")
        if self.min_free_bytes < 0:
            raise ValueError(f"min_free_bytes: must not be negative, got {self.min_free_bytes!r}")
        if self.silent_after_s is not None and not 0 < self.silent_after_s <= 86400:
            raise ValueError(f"silent_after_s: must be in (0, 86400], got {self.silent_after_s!r}")
        if self.capture_interval_s < 0:
            raise ValueError(f"capture_interval_s: must not be negative, got {self.capture_interval_s!r}")
        if self.health_reserve < 0:
            raise ValueError(f"health_reserve: must not be negative, got {self.health_reserve!r}")


@contextlib.asynccontextmanager
async def background(work: Coroutine[Any, Any, None]) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``work`` as a task while the block runs (a collector's maintenance, a lifespan hook's
    loop); when the block ends, however it ends, the task is cancelled and awaited."""
    task = asyncio.create_task(work)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
