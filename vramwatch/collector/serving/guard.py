"""Connection guard: read timeouts, a head-size bound and a connection cap at the protocol level.

uvicorn's own options stop at keep-alive idleness and a concurrency count that answers
503 to *every* path, ``/healthz`` included; a client that trickles headers or a body one
byte at a time is held forever. :func:`guarded_protocol` subclasses one of uvicorn's HTTP
protocols -- httptools (llhttp, C; the default) or h11 (pure Python; the fallback when
httptools is not installed, or ``serve --http h11``) -- with:

* a **header deadline**: a request's headers must be complete ``header_timeout_s`` after
  the connection opened or after the request's first byte (keep-alive idleness between
  requests stays uvicorn's ``timeout_keep_alive``);
* a **body deadline**: the body must be complete ``body_timeout_s`` after the headers,
  unless the server itself stopped reading (flow control, a pipelined request queued
  behind one being answered), which re-arms it;
* past either deadline: ``408`` if nothing was answered yet, the app sees a disconnect,
  the connection closes;
* a **head bound**: a request line + headers still incomplete past :data:`MAX_HEAD_BYTES`
  is answered 400 and closed (h11 enforces it itself; httptools buffers without limit, so
  the adapter counts);
* a **connection cap**: past ``max_connections`` open connections a new one may only ask
  ``/healthz`` (the next ``health_reserve`` connections; others get 503 with Retry-After),
  and past that it is answered 503 at once and closed;
* one rate-limited log line per kind (refused, timed out, accept() failures) instead of a
  line or a traceback per connection.

The deadlines, the expiry and the cap are written once (:class:`_Guarded`); two thin
adapters say where each protocol's request head and body begin and end.

Costs: at most one ``call_later`` timer per connection while a request is being read (none
for a request whose head and body arrive in one read on httptools), a few attribute writes
per request.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any, ClassVar, Literal, Protocol

import h11
import orjson
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from vramwatch.collector.serving.deps import RateLimitedLog

try:  # the server extra installs it; without it the collector serves with h11
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - exercised by installs without httptools
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

log = logging.getLogger("vramwatch.collector")

HEALTH_PATHS = frozenset({"/healthz"})

#: a request line + headers still incomplete past this many bytes: 400 and closed (h11's
#: default incomplete-event limit, given to h11 too so both protocols bound heads alike)
MAX_HEAD_BYTES = 16 * 1024


def _raw_response(status: int, reason: str, detail: str) -> bytes:
    body = orjson.dumps({"detail": detail})
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\nretry-after: 1\r\n\r\n").encode() + body


class GuardLimits(Protocol):
    """What a guard reads of a server's settings (the collector's ``Settings``, the
    front's ``FrontSettings``)."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    health_reserve: int


class ConnectionGuard:
    """The limits and counters shared by every connection of one server."""

    def __init__(self, settings: GuardLimits) -> None:
        self.header_timeout_s = settings.header_timeout_s
        self.body_timeout_s = settings.body_timeout_s
        self.max_connections = settings.max_connections
        self.health_reserve = settings.health_reserve
        self.refused = 0
        self.timed_out = 0
        self._refused_log = RateLimitedLog(log)
        self._timeout_log = RateLimitedLog(log)
        self._accept_log = RateLimitedLog(log)
        self.full_response = _raw_response(
            503, "Service Unavailable",
            f"connections: the collector holds its cap of {self.max_connections} open connections "
            "(--max-connections); retry")
        self.timeout_response = _raw_response(408, "Request Timeout", "request: not received in time; closed")

    def refuse(self, open_now: int) -> None:
        self.refused += 1
        self._refused_log.warning("connection cap reached: %d connections open (cap %d, --max-connections); "
                                  "refusing new ones with 503", open_now, self.max_connections)

    def timeout(self, phase: str, client: Any) -> None:
        self.timed_out += 1
        self._timeout_log.warning("closed a connection from %s: request %s not received within the deadline",
                                  client[0] if client else "?", phase)

    def loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio's handler, except that accept() failures (out of file descriptors) are one
        rate-limited line instead of a traceback per retry."""
        if "accept" in str(context.get("message", "")):
            exc = context.get("exception")
            self._accept_log.warning("cannot accept connections: %s (raise the open-files limit or lower "
                                     "--max-connections)", exc)
            return
        loop.default_exception_handler(context)

    def health_only(self, app: ASGIApp) -> ASGIApp:
        """The app for a connection past the cap: /healthz only."""
        detail = orjson.dumps({"detail": f"connections: at the cap of {self.max_connections} "
                                         "(--max-connections); only /healthz is served; retry"})

        async def reserved(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["path"] in HEALTH_PATHS:
                await app(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"retry-after", b"1"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": detail})

        return reserved


HttpChoice = Literal["auto", "httptools", "h11"]


def http_protocol(choice: HttpChoice = "auto") -> Literal["httptools", "h11"]:
    """The protocol ``choice`` names: ``auto`` is httptools when importable, else h11.

    Raises ValueError when httptools is asked for by name and is not installed."""
    if choice == "h11":
        return "h11"
    if HttpToolsProtocol is not None:
        return "httptools"
    if choice == "httptools":
        raise ValueError("--http httptools: the httptools package is not installed (pip install 'vramwatch[server]')")
    return "h11"


class _Guarded:
    """The deadlines, their expiry and the cap; mixed in before one of uvicorn's protocols.

    The adapter below it arms ``"headers"``/``"body"`` where its parser says a request's head
    or body is being read, disarms when the request is in, and lists :meth:`_unanswered`."""

    guard: ClassVar[ConnectionGuard]  # set by guarded_protocol
    _timer: asyncio.TimerHandle | None = None
    _phase = ""
    # uvicorn's protocol attributes used here (both protocols have them)
    connections: set[Any]
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    flow: Any
    client: tuple[str, int] | None
    app: Any
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        guard, open_now = self.guard, len(self.connections)
        if open_now > guard.max_connections + guard.health_reserve:
            guard.refuse(open_now)
            transport.write(guard.full_response)
            transport.close()
            return
        if open_now > guard.max_connections:
            guard.refuse(open_now)
            self.app = guard.health_only(self.app)
        self._arm("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _unanswered(self) -> list[Any]:
        """This connection's request/response cycles whose response is not complete."""
        raise NotImplementedError

    def _arm(self, phase: Literal["headers", "body"]) -> None:
        self._disarm()
        self._phase = phase
        seconds = self.guard.header_timeout_s if phase == "headers" else self.guard.body_timeout_s
        self._timer = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = ""

    def _expired(self) -> None:
        phase, self._timer = self._phase, None
        if self.transport.is_closing():
            return
        unanswered = self._unanswered()
        # the server stopped reading, or still owes an earlier (pipelined) request its answer:
        # the delay is ours, not the client's
        if self.flow.read_paused or (phase == "headers" and unanswered):
            self._arm(phase)  # type: ignore[arg-type]
            return
        self.guard.timeout(phase, self.client)
        # a 408 only where it cannot land inside a response already on the wire
        if not any(c.response_started for c in unanswered) and (phase == "headers" or not self.cycle.response_started):
            self.transport.write(self.guard.timeout_response)
        for cycle in unanswered:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


class _GuardedH11(_Guarded, H11Protocol):
    """h11: its connection state says which part of a request is being read."""

    def data_received(self, data: bytes) -> None:
        if self._timer is None and self.conn.their_state is h11.IDLE:
            self._arm("headers")  # first byte of a keep-alive request
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def _follow(self) -> None:
        """Move the deadline along with the request being read."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body")
        elif state is h11.IDLE:
            if self._phase == "headers" and not self.conn.trailing_data[0] and self.cycle is not None \
                    and self.cycle.response_complete:
                self._disarm()  # between keep-alive requests: uvicorn's keep-alive timer
        else:
            self._disarm()

    def _unanswered(self) -> list[Any]:
        cycle = self.cycle
        return [cycle] if cycle is not None and not cycle.response_complete else []


if HttpToolsProtocol is not None:

    class _GuardedHttpTools(_Guarded, HttpToolsProtocol):
        """httptools: llhttp's callbacks mark where a head and a body begin and end; after
        each read the deadline follows them (so a request that arrives in one read arms no
        timer). Pipelined requests are parsed ahead of their answers, so the cycles of the
        connection are kept until answered."""

        _in_head = False  # a request line + headers begun, not complete
        _in_body = False  # headers complete, body not
        _requests_read = 0
        _head_bytes = 0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._cycles: list[Any] = []

        def data_received(self, data: bytes) -> None:
            read = self._requests_read
            super().data_received(data)
            if self._in_head:
                # exact for clients that wait for each answer; a read that also ended an earlier
                # pipelined request is not counted (the bound is then one read larger)
                if self._requests_read == read:
                    self._head_bytes += len(data)
                    if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                        self._head_too_large()
                        return
                if self._phase != "headers":
                    self._arm("headers")  # a request began in this read (its first byte)
            elif self._in_body:
                if self._phase != "body":
                    self._arm("body")
            elif self._requests_read == read and self._timer is None:
                self._arm("headers")  # bytes that begin no request (blank lines) get no free ride

        def on_message_begin(self) -> None:
            self._in_head, self._head_bytes = True, 0
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_head, self._in_body = False, True
            earlier = self.cycle
            super().on_headers_complete()
            if self.cycle is not earlier:
                self._cycles = [c for c in self._cycles if not c.response_complete]
                self._cycles.append(self.cycle)

        def on_message_complete(self) -> None:
            self._in_body = False
            self._requests_read += 1
            self._disarm()  # the request is in; idleness until the next one is uvicorn's keep-alive
            super().on_message_complete()

        def _head_too_large(self) -> None:
            """What h11 answers to a head past its incomplete-event limit: 400, closed."""
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)

        def _unanswered(self) -> list[Any]:
            return [c for c in self._cycles if not c.response_complete]


def guarded_protocol(guard: ConnectionGuard, http: HttpChoice = "auto") -> type[asyncio.Protocol]:
    """uvicorn's protocol ``http`` (see :func:`http_protocol`) with ``guard``'s deadlines, head
    bound and cap (see the module docstring)."""
    base = _GuardedHttpTools if http_protocol(http) == "httptools" else _GuardedH11
    return type(base.__name__.lstrip("_"), (base,), {"guard": guard})


def raise_open_files_limit(wanted: int) -> int:
    """Raise the soft open-files limit toward ``wanted`` (up to the hard limit); returns it."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        return soft if soft != resource.RLIM_INFINITY else wanted
    except (ValueError, OSError):  # pragma: no cover - platform without the limit
        return wanted
