"""The dashboard router: the page, plotly, and the static files, behind the read check.

``GET /?token=...`` is the only place a token in the URL counts: it becomes an httpOnly,
SameSite=Strict cookie that the page's own requests carry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from vramwatch.collector.serving.deps import TOKEN_COOKIE, read_allowed, refuse, token_matches
from vramwatch.collector.serving.responses import json_error


def dashboard_dir() -> Path:
    """The static front-end: inside the wheel, or top-level ``dashboard/`` in a checkout."""
    packaged = Path(__file__).resolve().parents[2] / "_dashboard"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[3] / "dashboard"


def dashboard_plotly_js_path() -> Path:
    """plotly.js as the dashboard loads it: the partial (cartesian) bundle vendored in the
    dashboard (1.5 MB, every trace the dashboard draws; dashboard/vendor/README.md). Shipped in
    the wheel, so the collector needs no plotly Python package (64 MB installed)."""
    return dashboard_dir() / "vendor" / "plotly-cartesian.min.js"


def _first_visit_auth(request: Request) -> None:
    """The page itself: the read check, where ``?token=`` also counts (first visit)."""
    settings = request.app.state.settings
    if read_allowed(request):
        return
    if settings.token and token_matches(request.query_params.get("token"), settings.token):
        return
    raise refuse(request)


def _read_auth(request: Request) -> None:
    if not read_allowed(request):
        raise refuse(request)


router = APIRouter(include_in_schema=False)


@router.get("/vendor/plotly.min.js", dependencies=[Depends(_read_auth)])
def plotly_js() -> Response:
    return FileResponse(dashboard_plotly_js_path(), media_type="application/javascript")


@router.get("/", dependencies=[Depends(_first_visit_auth)])
def index(request: Request) -> Response:
    page = dashboard_dir() / "index.html"
    if not page.exists():
        return json_error(404, "dashboard files are missing from this installation")
    response = FileResponse(page, media_type="text/html")
    settings = request.app.state.settings
    if settings.auth_read and settings.token and token_matches(request.query_params.get("token"), settings.token):
        # a browser opened /?token=...: keep it in a cookie the page's own requests carry,
        # never readable by scripts, never sent to other sites, and never over plain HTTP when
        # the page came over TLS (the scheme is https behind a proxy uvicorn trusts: its
        # X-Forwarded-Proto from --forwarded-allow-ips / $FORWARDED_ALLOW_IPS, loopback by default)
        response.set_cookie(TOKEN_COOKIE, settings.token, httponly=True, samesite="strict", path="/",
                            secure=request.url.scheme == "https")
    return response


class ProtectedStaticFiles(StaticFiles):
    """Static dashboard files behind the same read check as the API (``--auth-read``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            if not read_allowed(request):
                response = json_error(401, "missing or wrong bearer token")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def mount_static(app: Any) -> None:
    static = dashboard_dir()
    if static.is_dir():
        app.mount("/static", ProtectedStaticFiles(directory=static), name="static")
