"""Reading a collector's or a front's API from the command line (``--url``).

One bounded request (:func:`vramwatch.bounded.fetch_sync`): the reply is read up to
``max_bytes`` (inflated) within one total ``timeout`` (not per read: a server dripping its
answer ends at it), no redirect followed, and decoded as JSON. Errors are typed:
:class:`RemoteError` carries the HTTP status (None when the server was unreachable, too slow
or too large) and the server's ``detail`` message, so a CLI can exit 2 on a 4xx and 1 on an
outage.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any, TypeVar

from vramwatch.bounded import FetchError, HttpLimits, fetch_sync
from vramwatch.errors import EXIT_FAILURE, EXIT_USAGE, VramwatchError

T = TypeVar("T")

MAX_REPLY_BYTES = 256 * 2**20


#: what reading a document of the wrong shape raises (a list where an object was due, a missing
#: key, a string where a number was): the server's fault, reported as such, never a traceback
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError)


def detail_text(detail: Any) -> str:
    """An error answer's ``detail`` as one line for a person: a validation list
    (``[{"loc": ["query", "rank"], "msg": ...}]``) as ``rank: msg; ...``, so the field is named."""
    if isinstance(detail, list) and all(isinstance(e, dict) and "msg" in e for e in detail):
        # loc is ["query"|"body"|"path", field, ...]: the field, or "body" for the body itself
        return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:] or e.get('loc', ()))}: {e['msg']}"
                         for e in detail)
    return detail if isinstance(detail, str) else str(detail)


class RemoteError(VramwatchError):
    """A collector or front that refused (its 4xx: exit 2) or did not answer (exit 1)."""

    def __init__(self, status: int | None, detail: str) -> None:
        super().__init__(detail)
        self.status = status  # type: ignore[assignment]  # None: no answer at all
        self.detail = detail
        self.exit_code = EXIT_USAGE if status is not None and 400 <= status < 500 else EXIT_FAILURE


def base_url(url: str | None) -> str:
    """The URL given, else ``$VRAMWATCH_URL``, else the local default; checked to be http(s)."""
    from vramwatch.config import client_env

    value = (url or client_env()[0] or "http://127.0.0.1:8765").rstrip("/")
    try:
        parts = urllib.parse.urlsplit(value)  # raises for "http://[::1"
        _ = parts.port  # raises for a port that is not a number in 0..65535
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{'--url' if url else 'VRAMWATCH_URL'}: not an http(s) URL: {value!r}")
    return value


def check_token() -> str | None:
    """``$VRAMWATCH_TOKEN``, checked: it travels in an HTTP header, where a newline or a character
    outside Latin-1 cannot go (http.client raised, deep in the request)."""
    from vramwatch.config import client_env

    token = client_env()[1]
    if token is not None and not (token.isprintable() and all(ord(c) < 256 for c in token)):
        raise ValueError("VRAMWATCH_TOKEN: must be printable text (it is sent in an HTTP header)")
    return token


def run_path(run: str, what: str) -> str:
    return "/api/v1/runs/" + urllib.parse.quote(run, safe="") + "/" + what


def post_json(url: str, path: str, body: Any, *, timeout: float = 30.0) -> Any:
    """POST a JSON body; the same bounded read and typed errors as :func:`get_json`."""
    return _call(url, path, "", timeout, 64 * 1024, data=json.dumps(body).encode())


def get_json(url: str, path: str, params: dict[str, Any] | None = None, *, timeout: float = 30.0,
             max_bytes: int = MAX_REPLY_BYTES) -> Any:
    kept = {k: v for k, v in (params or {}).items() if v is not None}
    query = ("?" + urllib.parse.urlencode(kept, doseq=True)) if kept else ""  # lists: repeated keys
    return _call(url, path, query, timeout, max_bytes)


def get_bytes(url: str, path: str, *, timeout: float = 120.0, max_bytes: int = MAX_REPLY_BYTES) -> bytes:
    """GET a binary document (a snapshot download) with the same bound and typed errors."""
    return _call(url, path, "", timeout, max_bytes, parse=False)


def _call(url: str, path: str, query: str, timeout: float, max_bytes: int, data: bytes | None = None,
          parse: bool = True) -> Any:
    token = check_token()
    accept = "application/json" if parse else "*/*"
    headers = {"Accept": accept, **({"Authorization": f"Bearer {token}"} if token else {})}
    if data is not None:
        headers["Content-Type"] = "application/json"
    limits = HttpLimits(timeout, max_bytes, "timeout", "reply size limit")
    try:
        reply = fetch_sync(url + path + query, limits, method="POST" if data is not None else "GET", body=data,
                           headers=headers)
    except FetchError as exc:
        raise RemoteError(None, str(exc) if exc.limit else f"{exc}".replace(url + path + query, url)) from None
    if reply.status >= 300:
        text = reply.body[:64 * 1024].decode("utf-8", "replace")
        try:
            text = detail_text(json.loads(text).get("detail", text))
        except (ValueError, AttributeError):
            pass
        raise RemoteError(reply.status, f"{url} answered {reply.status}: {text}")
    return json.loads(reply.body) if parse else reply.body
