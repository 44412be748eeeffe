"""The front door: the pure-ASGI layer every request passes first.

* **Host check** (DNS rebinding: a page on an attacker's name that resolves to 127.0.0.1
  must not reach a loopback collector): a ``Host`` *name* not in the allowed set gets 421. An IP
  literal (``10.1.2.3:8765``, ``[fd00::5]``) always passes: a browser sends one only for a page
  whose origin is that address, which no DNS answer can rebind, and it is what the Docker
  HEALTHCHECK (127.0.0.1), the Kubernetes probes and a ServiceMonitor's scrape (the pod's IP)
  send, so ``--allowed-host`` never breaks them;
* **small bodies**: a POST to any route but the two that stream their bodies under bounds of
  their own (ingest, snapshot upload) must declare a Content-Length of at most
  :data:`MAX_SMALL_BODY` (413, or 411 without one), checked before the app reads it: a
  framework route would buffer a body of any size;
* **quiet cancel**: a request still running when shutdown cancels it ends with 503 (if
  nothing was sent yet) and one log line for all of them, instead of a CancelledError
  traceback each;
* **hot routes**: ``POST /api/v1/samples`` (:func:`vramwatch.collector.ingest.routes.route`, the
  ingest route itself) and ``GET /healthz`` are answered here, without FastAPI's routing,
  middleware stack and dependency resolution (the app's router holds the same callables, so
  the behaviour is the same either way). A hook's POST is small and frequent: the
  per-request overhead is what limits a collector serving thousands of ranks
  (docs/benchmarks.md).

Anything else goes to the FastAPI app, whose attributes (``state``, ``routes``, ...) this
object also exposes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vramwatch.collector.ingest import routes as ingest
from vramwatch.collector.reads import api
from vramwatch.collector.serving.deps import RateLimitedLog
from vramwatch.collector.serving.responses import JSONBytes

log = logging.getLogger("vramwatch.collector")

#: the largest body of a route that reads it whole (a capture request is a few fields)
MAX_SMALL_BODY = 64 * 1024


def small_body_refusal(scope: Scope) -> tuple[int, str] | None:
    """(status, detail) when the request's body may be larger than :data:`MAX_SMALL_BODY`."""
    length = chunked = None
    for key, value in scope["headers"]:
        if key == b"content-length":
            length = value
        elif key == b"transfer-encoding":
            chunked = value
    if length is not None:
        if not length.isdigit():
            return 400, "content-length: not a number"
        if int(length) > MAX_SMALL_BODY:
            return 413, f"body: larger than {MAX_SMALL_BODY} bytes"
        return None
    if chunked is not None:
        return 411, f"body: send a Content-Length (at most {MAX_SMALL_BODY} bytes)"
    return None


async def send_json(send: Send, status: int, doc: dict[str, Any]) -> None:
    body = orjson.dumps(doc)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _host_name(value: str) -> str:
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class HostCheck:
    """The Host check and the quiet cancel of the module docstring, around any ASGI ``app``
    (the federating front serves behind it too). ``allowed_hosts``: names a ``Host`` header
    may carry besides IP literals (None: any)."""

    #: paths whose POST bodies are streamed under bounds of their own (not held to MAX_SMALL_BODY)
    STREAMED: frozenset[str] = frozenset()

    def __init__(self, app: Any, allowed_hosts: frozenset[str] | None) -> None:
        self.app: ASGIApp = app
        self.allowed_hosts = allowed_hosts
        self._host_refusals = RateLimitedLog(log)
        self._cancelled = RateLimitedLog(log, interval_s=10.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.allowed_hosts is not None and not self._host_allowed(scope):
            await self._refuse_host(scope, send)
            return
        if scope["method"] in ("POST", "PUT", "PATCH") and scope["path"] not in self.STREAMED:
            refusal = small_body_refusal(scope)
            if refusal is not None:
                await send_json(send, refusal[0], {"detail": refusal[1]})
                return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._route(scope, receive, tracking_send)
        except asyncio.CancelledError:
            self._cancelled.warning("shutdown: cancelled a request still running (%s %s)",
                                    scope.get("method"), scope.get("path"))
            if not started:
                try:
                    await send_json(send, 503, {"detail": "shutting down; retry"})
                except Exception:
                    pass

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    def _host_allowed(self, scope: Scope) -> bool:
        assert self.allowed_hosts is not None
        for key, value in scope["headers"]:
            if key == b"host":
                name = _host_name(value.decode("latin-1"))
                return name in self.allowed_hosts or _is_ip_literal(name)
        return False

    async def _refuse_host(self, scope: Scope, send: Send) -> None:
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
        self._host_refusals.warning("refused a request for Host %r (allowed: %s; see --allowed-host)",
                                    host[:100], ", ".join(sorted(self.allowed_hosts or ())))
        await send_json(send, 421, {"detail": f"host: {host[:100]!r} is not a name this server serves "
                                              "(--allowed-host)"})


class FrontDoor(HostCheck):
    """:class:`HostCheck` plus the collector's hot routes (see the module docstring)."""

    STREAMED = frozenset({"/api/v1/samples", "/api/v1/snapshots"})

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path == ingest.PATH and method == "POST":
            scope["app"] = self.app  # what the route and Request.app read (state, the 401's log line)
            await ingest.route(scope, receive, send)
        elif path == "/healthz" and method == "GET":
            await JSONBytes(api.healthz(self.app.state.live))(scope, receive, send)
        else:
            await self.app(scope, receive, send)
