"""Reading a collector's or a front's API from the command line (``--url``).

One bounded GET: the reply is read up to ``max_bytes`` and decoded as JSON. Errors are
typed: :class:`RemoteError` carries the HTTP status (None when the server was unreachable)
and the server's ``detail`` message, so a CLI can exit 2 on a 4xx and 1 on an outage.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

MAX_REPLY_BYTES = 256 * 2**20


class RemoteError(Exception):
    def __init__(self, status: int | None, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def base_url(url: str | None) -> str:
    """The URL given, else ``$VRAMWATCH_URL``, else the local default; checked to be http(s)."""
    value = (url or os.environ.get("VRAMWATCH_URL") or "http://127.0.0.1:8765").rstrip("/")
    if urllib.parse.urlsplit(value).scheme not in ("http", "https"):
        raise ValueError(f"--url: not an http(s) URL: {value!r}")
    return value


def run_path(run: str, what: str) -> str:
    return "/api/v1/runs/" + urllib.parse.quote(run, safe="") + "/" + what


def get_json(url: str, path: str, params: dict[str, Any] | None = None, *, timeout: float = 30.0,
             max_bytes: int = MAX_REPLY_BYTES) -> Any:
    token = (os.environ.get("VRAMWATCH_TOKEN") or "").strip()
    query = ("?" + urllib.parse.urlencode({k: v for k, v in (params or {}).items() if v is not None})) if params else ""
    request = urllib.request.Request(url + path + query, headers={
        "Accept": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            body = reply.read(max_bytes + 1)
    except urllib.error.HTTPError as exc:
        text = exc.read(64 * 1024).decode("utf-8", "replace")
        try:
            text = json.loads(text).get("detail", text)
        except (ValueError, AttributeError):
            pass
        raise RemoteError(exc.code, f"{url} answered {exc.code}: {text}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise RemoteError(None, f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None
    if len(body) > max_bytes:
        raise RemoteError(None, f"{url}: reply larger than {max_bytes} bytes")
    return json.loads(body)
