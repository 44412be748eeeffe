"""Dependencies shared by the routers: the store, the live state, and the two auth checks.

Auth: machines write with ``Authorization: Bearer`` only; readers (with ``--auth-read``)
may also carry the dashboard's httpOnly cookie. ``?token=`` is honoured only by the first
page load (``GET /``), which turns it into the cookie: a token in a URL of the read API
would end up in proxy logs and browser history.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from vramwatch.collector.settings import Settings
from vramwatch.collector.state.live import LiveState
from vramwatch.collector.store import Store

log = logging.getLogger("vramwatch.collector")

TOKEN_COOKIE = "vramwatch_token"


class RateLimitedLog:
    """At most one log line per ``interval_s`` for one kind of event, whoever causes it (so
    rotating client addresses or X-Forwarded-For cannot flood the log); the next line says
    how many were not logged."""

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last = -1e18
        self._suppressed = 0
        self._lock = threading.Lock()

    def warning(self, message: str, *args: object) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval_s:
                self._suppressed += 1
                return False
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            message += f" ({suppressed} more like this in the last {self.interval_s:.0f} s not logged)"
        self.logger.warning(message, *args)
        return True


def _digest(text: str) -> bytes:
    # compare fixed-length digests: compare_digest on raw strings leaks their length
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def token_matches(supplied: str | None, token: str) -> bool:
    """Constant-time comparison of a supplied bearer token with the configured one."""
    return hmac.compare_digest(_digest(supplied or ""), _digest(token))


def bearer_value(header: str) -> str | None:
    """The token of an ``Authorization`` header value, if it is a bearer one."""
    return header[7:].strip() if header[:7].lower() == "bearer " else None


def bearer(request: Request) -> str | None:
    return bearer_value(request.headers.get("authorization", ""))


def supplied_token(request: Request) -> str | None:
    """The token a read request carries: ``Authorization: Bearer``, else the dashboard's cookie."""
    return bearer(request) or request.cookies.get(TOKEN_COOKIE)


def settings_of(request: Request) -> Settings:
    return request.app.state.settings


def store_of(request: Request) -> Store:
    return request.app.state.store


def live_of(request: Request) -> LiveState:
    return request.app.state.live


SettingsDep = Annotated[Settings, Depends(settings_of)]
StoreDep = Annotated[Store, Depends(store_of)]
LiveDep = Annotated[LiveState, Depends(live_of)]


def read_allowed(request: Request) -> bool:
    settings: Settings = request.app.state.settings
    if not settings.auth_read or not settings.token:
        return True
    return token_matches(supplied_token(request), settings.token)


def refuse(request: Request) -> HTTPException:
    """The 401, with one rate-limited log line saying who failed (never what they sent)."""
    client = request.client.host if request.client else "?"
    request.app.state.refusals.warning(
        "refused %s %s from %s: missing or wrong bearer token", request.method, request.url.path, client)
    return HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


def require_ingest_auth(request: Request) -> None:
    # machines write: only the Authorization header counts (a browser's cookie must not)
    token = request.app.state.settings.token
    if token and not token_matches(bearer(request), token):
        raise refuse(request)


def require_read_auth(request: Request) -> None:
    if not read_allowed(request):
        raise refuse(request)
