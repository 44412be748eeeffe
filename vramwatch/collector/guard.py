"""Connection guard: read timeouts and a connection cap at the protocol level.

uvicorn's own options stop at keep-alive idleness and a concurrency count that answers
503 to *every* path, ``/healthz`` included; a client that trickles headers or a body one
byte at a time is held forever. :func:`guarded_protocol` subclasses uvicorn's h11
protocol with:

* a **header deadline**: a request's headers must be complete ``header_timeout_s`` after
  the connection opened or after the request's first byte (keep-alive idleness between
  requests stays uvicorn's ``timeout_keep_alive``);
* a **body deadline**: the body must be complete ``body_timeout_s`` after the headers,
  unless the server itself stopped reading (flow control), which re-arms it;
* past either deadline: ``408`` if nothing was answered yet, the app sees a disconnect,
  the connection closes;
* a **connection cap**: past ``max_connections`` open connections a new one may only ask
  ``/healthz`` (the next ``health_reserve`` connections; others get 503 with Retry-After),
  and past that it is answered 503 at once and closed;
* one rate-limited log line per kind (refused, timed out, accept() failures) instead of a
  line or a traceback per connection.

Costs: one ``call_later`` timer per connection while a request is being read.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

import h11
import orjson
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from vramwatch.collector.deps import RateLimitedLog
from vramwatch.collector.settings import Settings

log = logging.getLogger("vramwatch.collector")

HEALTH_PATHS = frozenset({"/healthz"})


def _raw_response(status: int, reason: str, detail: str) -> bytes:
    body = orjson.dumps({"detail": detail})
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\nretry-after: 1\r\n\r\n").encode() + body


class ConnectionGuard:
    """The limits and counters shared by every connection of one server."""

    def __init__(self, settings: Settings) -> None:
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


def guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``guard``'s deadlines and cap (see the module docstring)."""

    class GuardedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _phase = ""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            open_now = len(self.connections)
            if open_now > guard.max_connections + guard.health_reserve:
                guard.refuse(open_now)
                transport.write(guard.full_response)
                transport.close()
                return
            if open_now > guard.max_connections:
                guard.refuse(open_now)
                self.app = guard.health_only(self.app)
            self._arm("headers", guard.header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._timer is None and self.conn.their_state is h11.IDLE:
                self._arm("headers", guard.header_timeout_s)  # first byte of a keep-alive request
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
                    self._arm("body", guard.body_timeout_s)
            elif state is h11.IDLE:
                if self._phase == "headers" and not self.conn.trailing_data[0] and self.cycle is not None \
                        and self.cycle.response_complete:
                    self._disarm()  # between keep-alive requests: uvicorn's keep-alive timer
            else:
                self._disarm()

        def _arm(self, phase: str, seconds: float) -> None:
            self._disarm()
            self._phase = phase
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
            if phase == "body" and self.flow.read_paused:
                self._arm("body", guard.body_timeout_s)  # we stopped reading, not the client
                return
            guard.timeout(phase, self.client)
            cycle = self.cycle
            current = cycle is not None and not cycle.response_complete
            if phase == "headers" or (current and not cycle.response_started):
                self.transport.write(guard.timeout_response)
            if current:
                cycle.disconnected = True
                cycle.message_event.set()
            self.transport.close()

    return GuardedH11Protocol


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
