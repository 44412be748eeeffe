"""``POST /api/v1/samples``: the ingest router.

Every request ends in one :class:`IngestAnswer` (status, document, sample counts), recorded in
the ingest metrics exactly once, whatever the path: 200, 401, 413, 415, 422, 503, 507.
Failures are typed exceptions mapped to a status in :func:`_outcome_of`, never matched on
message text.

Ingest is all-or-nothing per request: a batch with one impossible sample is rejected
whole with 422, naming each bad sample's index and field, and nothing is stored.

Bounds (docs/reliability.md): at most ``max_concurrent_ingest`` bodies are read and
decoded at once (others wait ``ingest_queue_s``, then 503 with Retry-After: queued
requests do not hold their bodies in memory); bodies are decoded in bounded blocks by one
function (:func:`vramwatch.collector.ingest.body.decode_body`).

Where the work runs: one threshold, :data:`INLINE_BYTES` of JSON text. A body holding at most
that much (a hook's batch always does) is decoded on the event loop and committed there when
the writer is free (a thread hop would cost more than the work: ~8 % of ingest CPU at
1000-sample batches, docs/benchmarks.md); anything bigger is decoded and committed in a worker
thread, so a big request never freezes ``/healthz``. On the loop a body gets the C passes and at
most :data:`INLINE_SLOW_ITEMS` items parsed or validated one by one in Python (a hook's batch
with a bad sample); one that needs more (seconds for 1 MiB of hostile tiny items) is decoded
again in a worker thread. Every other body is decoded once.

The route: :func:`route` is the one ``POST /api/v1/samples``. The front door
(:class:`~vramwatch.collector.serving.door.FrontDoor`) calls it before any routing, and the app's
router holds the same callable (for the app without its front door); the OpenAPI document
describes it from :data:`~vramwatch.collector.serving.openapi.INGEST_OPERATION`.

Cost (docs/benchmarks.md, "Ingest against its limit"): :func:`route` is plain ASGI (headers
read from the scope, the body from ``receive``, the reply sent as two messages), so a request
pays no FastAPI routing, dependency resolution or Request/Response objects; a valid body is
decoded and validated in one C pass per block; per 1000 samples the store's insert and the
engines are most of what is left.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import starlette.routing
from fastapi import HTTPException, Request
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from vramwatch.collector.ingest.body import (
    BodyError,
    BodyTooLargeError,
    DecodedBody,
    InflatedTooLargeError,
    SlowBody,
    decode_body,
    gzip_size,
)
from vramwatch.collector.serving.deps import RateLimitedLog, bearer_value, refuse, token_matches
from vramwatch.collector.settings import Settings
from vramwatch.collector.snapshots.routes import reply_directives
from vramwatch.collector.state.live import SeriesLimitError
from vramwatch.collector.store import InsertResult, RunFullError, Store, StoreBusyError, StoreError, SuspectedReport
from vramwatch.runlife import SuspectedOom

log = logging.getLogger("vramwatch.collector")

MAX_ERRORS_LISTED = 50
#: The one threshold for moving work off the event loop: a body of at most this many bytes of
#: JSON text (its length, or what a gzip body's trailer declares; inflating on the loop stops
#: there) is decoded and committed on the loop, anything bigger in a worker thread. A hook's
#: batch is at most this (delivery's max_batch_bytes): ~3 ms of C to decode, about as much to
#: commit 1000 samples.
INLINE_BYTES = 1024 * 1024
#: On the event loop a body may have at most this many items parsed or validated one by one in
#: Python (a hook's batch with a bad sample: ~1,000, a few ms); past it, the body is decoded again
#: in a worker thread (1 MiB of tiny refused items: 32,000 validations, a second and more)
INLINE_SLOW_ITEMS = 2048
#: the flush interval hinted to hooks: one POST per rank per this many seconds keeps the
#: collector near this many requests per second in all (see flush_hint)
HINT_TARGET_RPS = 400.0
HINT_MIN_S, HINT_MAX_S = 1.0, 30.0
#: suspected OOMs waiting for the database (locked elsewhere) at most; past it the oldest go
SUSPECTED_PENDING_MAX = 4096

#: media types a hook or a tool may send; a browser's cross-site "simple" POST
#: (text/plain, forms, no type at all) is refused before it is read
JSON_MEDIA_TYPES = frozenset({
    "application/json", "application/x-ndjson", "application/ndjson", "application/jsonl",
    "application/x-jsonlines", "application/jsonlines",
})


@dataclass
class IngestAnswer:
    """The result of one ingest request: what is answered and what is counted."""

    status: int
    doc: dict[str, Any]
    accepted: int = 0
    duplicates: int = 0
    rejected: int = 0
    headers: dict[str, str] = field(default_factory=dict)


class IngestRefused(Exception):
    """A request refused before its samples were looked at (status and one-line detail)."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers or {}


class DiskGuard:
    """Free space under the database against the reserve (``min_free_bytes`` plus the WAL,
    so the final checkpoint at shutdown has room), both re-read at most once a second."""

    def __init__(self, store: Store, min_free_bytes: int) -> None:
        self.store = store
        self.directory = str(Path(store.path).resolve().parent)
        self.min_free_bytes = min_free_bytes
        self._checked = 0.0
        self._free = 0
        self._reserve = min_free_bytes

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked > 1.0:
            try:
                self._free = shutil.disk_usage(self.directory).free
            except OSError:
                self._free = self.min_free_bytes  # cannot tell: let SQLite report real errors
            self._reserve = self.store.reserve_bytes(self.min_free_bytes)
            self._checked = now

    def check(self) -> None:
        if self.min_free_bytes <= 0:
            return
        self._refresh()
        if self._free < self._reserve:
            free = self._free
            log.warning("ingest refused: %d MiB free on the database's disk", free // 2**20)
            raise IngestRefused(
                507, f"disk: only {free // 2**20} MiB free for the database, below the "
                     f"{self._reserve // 2**20} MiB reserve (min_free_bytes plus the WAL); retry later, "
                     "nothing stored")


class Ingestor:
    """The write path's state, created in the lifespan: one writer at a time, live engines
    fed in commit order, and the slots that bound concurrent bodies."""

    def __init__(self, app_state: Any, settings: Settings) -> None:
        self.state = app_state
        self.settings = settings
        self.disk = DiskGuard(app_state.store, settings.min_free_bytes)
        self.commit_lock = threading.Lock()
        self.slots = asyncio.Semaphore(settings.max_concurrent_ingest)
        #: clients that left before sending their whole body: counted, one log line now and then
        self.clients_left = 0
        self._left_log = RateLimitedLog(log, interval_s=10.0)
        #: suspected OOMs the engines raised that the store has not taken yet (:meth:`_keep_suspected`)
        self._suspected: list[SuspectedReport] = []
        self._suspected_log = RateLimitedLog(log, interval_s=60.0)

    # A hook-sized batch is committed right on the event loop (a thread hop costs more than it
    # saves under load). When the database is locked by someone else, the lock is held by a
    # waiting commit, or the body was not small (INLINE_BYTES), it runs in a worker thread
    # instead: only ingest stalls, never the event loop (health, reads, /metrics).
    def _commit(self, samples: list[Any], now: float, busy_timeout_s: float | None) -> InsertResult:
        settings, live = self.settings, self.state.live
        live.check_capacity(samples, max_series=settings.max_series, max_ranks_per_run=settings.max_ranks_per_run)
        result = self.state.store.insert(samples, max_samples_per_run=settings.max_samples_per_run,
                                         busy_timeout_s=busy_timeout_s)
        raised = live.ingest(samples, received_at=now, accepted=result.accepted_by_series)
        if raised:  # events may ask ranks for evidence (capture directives, routes_evidence.py)
            self.state.directives.on_events(raised, lambda run: [x.key for x in live.for_run(run)], now)
            self._suspected += [(e["run"], e["host"], e["rank"], SuspectedOom.of(e, e["ts"])) for e in raised
                                if e["type"] == "suspected_oom"]
        if self._suspected:
            self._keep_suspected(busy_timeout_s)
        return result

    def _keep_suspected(self, busy_timeout_s: float | None) -> None:
        """Keep the OOMs the engines suspected in the store (as the run-life fold keeps them), so a
        run listed or restored without a replay counts them. The samples are committed already: a
        database locked elsewhere now leaves them for the next commit, never fails the request."""
        try:
            self.state.store.keep_suspected(self._suspected, busy_timeout_s=busy_timeout_s)
            self._suspected = []
        except StoreError as exc:
            del self._suspected[:-SUSPECTED_PENDING_MAX]
            self._suspected_log.warning("ingest: %d suspected OOMs wait for the database: %s",
                                        len(self._suspected), exc)

    def _commit_waiting(self, samples: list[Any], now: float) -> InsertResult:
        with self.commit_lock:
            return self._commit(samples, now, None)  # the store's full busy timeout (10 s)

    async def commit(self, samples: list[Any], now: float, *, inline: bool) -> InsertResult:
        """Store and judge a batch; on the event loop when ``inline`` and the writer is free (it
        waits for no lock there: a database locked elsewhere sends the commit to a thread)."""
        if inline and self.commit_lock.acquire(blocking=False):
            try:
                return self._commit(samples, now, 0.0)
            except StoreBusyError:
                pass  # locked elsewhere: wait for it off the loop
            finally:
                self.commit_lock.release()
        return await asyncio.to_thread(self._commit_waiting, samples, now)

    def client_left(self, scope: Scope) -> None:
        """A client left before sending its whole body: nothing was stored or answered."""
        self.clients_left += 1
        client = scope.get("client") or ("?", 0)
        self._left_log.warning("ingest: a client (%s) left before sending its whole body; nothing stored",
                               client[0])

    def flush_hint(self) -> float:
        """Seconds between flushes the hooks are asked for: more ranks, longer batches."""
        return round(min(HINT_MAX_S, max(HINT_MIN_S, len(self.state.live) / HINT_TARGET_RPS)), 1)


Headers = dict[bytes, bytes]


def _headers(scope: Scope) -> Headers:
    """Request headers by (lower-case) name; of a repeated one the first, as Starlette's ``Headers.get``."""
    out: Headers = {}
    for key, value in scope["headers"]:
        if key not in out:
            out[key] = value
    return out


def _check_auth(scope: Scope, headers: Headers, settings: Settings) -> None:
    """Machines write: only ``Authorization: Bearer`` counts (a browser's cookie must not);
    the refusal and its log line are :func:`deps.refuse`'s."""
    token = settings.token
    if token and not token_matches(bearer_value(headers.get(b"authorization", b"").decode("latin-1")), token):
        raise refuse(Request(scope))


def _check_headers(headers: Headers, settings: Settings) -> bool:
    """Content type, encoding and declared length; returns whether the body is gzip."""
    media = headers.get(b"content-type", b"").decode("latin-1").split(";", 1)[0].strip().lower()
    if media not in JSON_MEDIA_TYPES and not media.endswith("+json"):
        raise IngestRefused(415, f"content-type: {media or 'none'!r} not accepted; send application/json "
                                 "or application/x-ndjson")
    encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
    if encoding not in ("identity", "", "gzip"):
        raise IngestRefused(415, f"content-encoding: {encoding!r} not supported (use gzip or none)")
    declared = headers.get(b"content-length", b"").decode("latin-1")
    if declared.isdigit() and int(declared) > settings.max_body_bytes:
        raise IngestRefused(413, f"body: larger than {settings.max_body_bytes} bytes")
    return encoding == "gzip"


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()  # as Starlette's Request.stream(): nothing is answered or counted
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise IngestRefused(413, f"body: larger than {limit} bytes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _decode(body: bytes, gzipped: bool, settings: Settings, now: float) -> tuple[DecodedBody, bool]:
    """The decoded body, and whether it was small enough to be decoded on the event loop
    (:data:`INLINE_BYTES`: then its commit may run there too)."""
    limit = settings.max_decompressed_bytes
    kwargs: dict[str, Any] = dict(gzipped=gzipped, max_samples=settings.max_batch_samples, now=now,
                                  max_future_s=settings.max_future_s, max_errors=MAX_ERRORS_LISTED)
    if len(body) <= INLINE_BYTES and (not gzipped or gzip_size(body) <= INLINE_BYTES):
        inline_limit = min(limit, INLINE_BYTES) if gzipped else limit
        try:
            return decode_body(body, max_decompressed=inline_limit, max_slow_items=INLINE_SLOW_ITEMS, **kwargs), True
        except InflatedTooLargeError:
            if inline_limit == limit:
                raise
            # the trailer understated the size (several gzip members, or a lie): inflate in a thread
        except SlowBody:
            pass  # more items to parse or validate one by one than the loop may: in a thread
    return await asyncio.to_thread(decode_body, body, max_decompressed=limit, **kwargs), False


async def _take_slot(ingestor: Ingestor) -> None:
    slots, settings = ingestor.slots, ingestor.settings
    if not slots.locked():
        await slots.acquire()  # free: returns at once (wait_for would start a task and a timer)
        return
    try:
        await asyncio.wait_for(slots.acquire(), settings.ingest_queue_s)
    except TimeoutError:
        raise IngestRefused(503, f"busy: {settings.max_concurrent_ingest} batches are being stored; retry",
                            {"Retry-After": "1"}) from None


def _rejected(decoded: DecodedBody) -> IngestAnswer:
    first = decoded.errors[0]
    more = decoded.rejected - 1
    return IngestAnswer(422, {
        "detail": f"sample {first.index}: {first.field}: {first.message}"
                  + (f" (and {more} more)" if more else "") + "; nothing stored",
        "accepted": 0, "rejected": decoded.rejected,
        "errors": [{"index": e.index, "field": e.field, "message": e.message} for e in decoded.errors],
    }, rejected=decoded.rejected)


async def _ingest(scope: Scope, receive: Receive, ingestor: Ingestor) -> IngestAnswer:
    settings = ingestor.settings
    headers = _headers(scope)
    _check_auth(scope, headers, settings)
    gzipped = _check_headers(headers, settings)
    await _take_slot(ingestor)
    try:
        body = await _read_body(receive, settings.max_body_bytes)
        now = time.time()
        decoded, inline = await _decode(body, gzipped, settings, now)
        del body
    finally:
        ingestor.slots.release()
    if decoded.rejected:
        return _rejected(decoded)
    ingestor.disk.check()
    samples = decoded.samples
    try:
        result = await ingestor.commit(samples, now, inline=inline)
    except (RunFullError, SeriesLimitError) as exc:
        return IngestAnswer(422, {"detail": f"{exc}; nothing stored", "accepted": 0, "rejected": len(samples),
                             "errors": []}, rejected=len(samples))
    reply: dict[str, Any] = {"accepted": result.accepted, "duplicates": result.duplicates, "rejected": 0,
                             "flush_interval_s": ingestor.flush_hint()}
    directives = reply_directives(ingestor.state, samples)
    if directives:
        reply["directives"] = directives
    return IngestAnswer(200, reply, accepted=result.accepted, duplicates=result.duplicates)


def _outcome_of(exc: Exception) -> IngestAnswer:
    if isinstance(exc, IngestRefused):
        return IngestAnswer(exc.status, {"detail": exc.detail}, headers=exc.headers)
    if isinstance(exc, HTTPException):  # the auth dependency's 401
        return IngestAnswer(exc.status_code, {"detail": exc.detail}, headers=dict(exc.headers or {}))
    if isinstance(exc, BodyTooLargeError | BodyError):
        return IngestAnswer(exc.status, {"detail": str(exc)})
    if isinstance(exc, StoreBusyError | StoreError):
        log.error("ingest failed: %s", exc)
        return IngestAnswer(503, {"detail": str(exc)}, headers={"Retry-After": "1"})
    raise exc


async def handle(scope: Scope, receive: Receive, state: Any) -> IngestAnswer:
    """One ingest request: its outcome, counted once. Raises ``ClientDisconnect`` when the client
    left before sending its whole body (nothing is answered, counted or stored)."""
    started = time.perf_counter()
    try:
        outcome = await _ingest(scope, receive, state.ingestor)
    except (IngestRefused, HTTPException, BodyError, StoreError) as exc:
        outcome = _outcome_of(exc)
    state.ingest_metrics.observe(
        accepted=outcome.accepted, duplicates=outcome.duplicates, rejected=outcome.rejected,
        seconds=time.perf_counter() - started, status=outcome.status)
    return outcome


async def send_outcome(send: Send, outcome: IngestAnswer) -> None:
    """The reply: status, the outcome's headers, its document as JSON."""
    body = orjson.dumps(outcome.doc)
    headers = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in outcome.headers.items()]
    headers += [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": outcome.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


PATH = "/api/v1/samples"


async def route(scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /api/v1/samples``, as plain ASGI: store a batch of samples (all or nothing); see the
    module docstring. A client that leaves mid-body gets one civil log line (rate-limited: a
    crowd leaving at once is one line with a count), never a traceback."""
    state = scope["app"].state
    try:
        outcome = await handle(scope, receive, state)
    except ClientDisconnect:
        state.ingestor.client_left(scope)
        return
    await send_outcome(send, outcome)


class Route(starlette.routing.Route):
    """:func:`route` in an app's router (raw ASGI: no Request/Response objects), for the app
    without its front door; the OpenAPI document describes it apart (it is no FastAPI route)."""

    def __init__(self) -> None:
        super().__init__(PATH, endpoint=_Endpoint(), methods=["POST"], include_in_schema=False)


class _Endpoint:
    """An object, not a function, so the router hands it the ASGI call unwrapped."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await route(scope, receive, send)
