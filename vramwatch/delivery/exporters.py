"""Exporters: where a batch of NDJSON lines goes (OpenTelemetry's exporter seam).

* :class:`HttpExporter`: gzipped NDJSON ``POST {url}/api/v1/samples`` with stdlib
  ``http.client`` (keep-alive, ``TCP_NODELAY``), ``Authorization: Bearer`` when a token is
  set. 413 splits the batch (at most ``log2(n)`` extra requests; 413 for a single sample is
  a misconfigured collector: retried later, never split further); 422 drops the invalid
  samples the reply names and resends the rest once; 3xx is never followed (a POST body
  must not go to another host) and never dropped: retried later with a warning. Replies are
  read bounded (:data:`MAX_REPLY_BYTES`): a huge reply is not read, the connection is closed.
* :class:`FileExporter`: JSON Lines trace files (no collector).
* :class:`InMemoryExporter`: keeps what it got, for tests.

An exporter never raises: it returns an :class:`~vramwatch.delivery.results.ExportResult`.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import math
import os
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import orjson

from vramwatch.config import collector_url
from vramwatch.delivery.results import Directive, ExportFailure, ExportOutcome, ExportResult

INGEST_PATH = "/api/v1/samples"
#: The most of a reply the hook reads: the ingest answer is a few hundred bytes; 422 error
#: lists are capped by the collector well below this.
MAX_REPLY_BYTES = 64 * 1024
_RETRY_STATUSES = frozenset({408, 425, 429})
_MIN_HINT_S, _MAX_HINT_S = 0.05, 60.0
# what a keep-alive connection the server already closed looks like when reused
_STALE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, http.client.RemoteDisconnected)


class Exporter(Protocol):
    def export(self, lines: Sequence[bytes], timeout: float | None = None) -> ExportResult:
        """Deliver ``lines`` (NDJSON, one sample each). Never raises."""
        ...

    def shutdown(self) -> None: ...

    def describe(self) -> str: ...

    def after_fork_in_child(self) -> list[int]:
        """Forget inherited connections; returns file descriptors to point at /dev/null."""
        ...


def parse_reply(data: bytes) -> dict[str, Any]:
    try:
        answer = orjson.loads(data) if data else {}
    except orjson.JSONDecodeError:
        return {"detail": data[:200].decode("utf-8", "replace")}
    return answer if isinstance(answer, dict) else {"detail": str(answer)[:200]}


def reply_hints(answer: dict[str, Any]) -> tuple[float | None, tuple[Directive, ...]]:
    """The collector's ``flush_interval_s`` hint (clamped) and ``directives`` (malformed ones skipped)."""
    hint = answer.get("flush_interval_s")
    interval = None
    if isinstance(hint, int | float) and not isinstance(hint, bool) and math.isfinite(hint) and hint > 0:
        interval = min(_MAX_HINT_S, max(_MIN_HINT_S, float(hint)))
    directives = []
    raw = answer.get("directives")
    if isinstance(raw, list):
        for item in raw[:16]:
            if isinstance(item, dict) and isinstance(item.get("type"), str) and len(item["type"]) <= 64:
                directives.append(Directive(item["type"], {k: v for k, v in item.items() if k != "type"}))
    return interval, tuple(directives)


class HttpExporter:
    """POST gzipped NDJSON to the collector with the standard library only."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 5.0,
                 compresslevel: int = 5) -> None:
        parts = collector_url(url)
        self.url = url
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port
        base = parts.path.rstrip("/")
        self.path = base if base.endswith(INGEST_PATH) else base + INGEST_PATH
        self.timeout_s = timeout_s
        self.compresslevel = compresslevel
        self.headers = {"Content-Type": "application/x-ndjson", "Content-Encoding": "gzip",
                        "User-Agent": "vramwatch-hook"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None

    # ------------------------------------------------------------ one request

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        conn = self._conn
        if conn is None:
            cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            conn = self._conn = cls(self.host, self.port, timeout=timeout)
        else:
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
        if conn.sock is None:
            conn.connect()
            # http.client sends headers and body in two writes: without TCP_NODELAY, Nagle
            # holds the body until the server's delayed ACK (~40 ms on every keep-alive POST)
            with contextlib.suppress(OSError, AttributeError):
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _post(self, body: bytes, timeout: float | None) -> ExportResult | tuple[int, dict[str, Any], str | None]:
        """(status, parsed reply, Location) or a RETRY result for a transport failure."""
        payload = gzip.compress(body, compresslevel=self.compresslevel, mtime=0)
        timeout = self.timeout_s if timeout is None else max(0.05, min(timeout, self.timeout_s))
        for attempt in (0, 1):
            reused = self._conn is not None and self._conn.sock is not None
            try:
                conn = self._connection(timeout)
                conn.request("POST", self.path, body=payload, headers=self.headers)
                response = conn.getresponse()
                break
            except _STALE as exc:
                self.shutdown()
                if reused and attempt == 0:
                    # the server closed an idle keep-alive connection as we reused it: a fresh
                    # connection at once, not a backoff (ingest is idempotent if it did arrive)
                    continue
                return self._network_failure(exc)
            except (OSError, http.client.HTTPException) as exc:
                self.shutdown()
                return self._network_failure(exc)
        try:
            status = response.status
            length = response.getheader("content-length")
            too_long = length is not None and length.isdigit() and int(length) > MAX_REPLY_BYTES
            data = b"" if too_long else response.read(MAX_REPLY_BYTES + 1)
            location = response.getheader("location")
            keep = response.getheader("connection", "").lower() != "close"
        except (OSError, http.client.HTTPException) as exc:
            self.shutdown()
            return self._network_failure(exc)
        if too_long or len(data) > MAX_REPLY_BYTES or not response.isclosed():
            # never read (or drain) more than the protocol needs: drop the connection instead
            keep = False
            if 200 <= status < 300:
                return status, {"_reply_too_large": True}, location
        if not keep:
            self.shutdown()
        return status, parse_reply(data), location

    @staticmethod
    def _network_failure(exc: BaseException) -> ExportResult:
        return ExportResult(ExportOutcome.RETRY, posts=1, failures=1, failure=ExportFailure.NETWORK,
                            detail=f"{type(exc).__name__}: {exc}"[:300])

    # ------------------------------------------------------------ the exporter

    def export(self, lines: Sequence[bytes], timeout: float | None = None) -> ExportResult:
        lines = list(lines)
        if not lines:
            return ExportResult(ExportOutcome.SUCCESS)
        try:
            return self._export(lines, timeout, resend_invalid=True)
        except Exception as exc:  # a bug here must not reach the worker as an exception
            self.shutdown()
            return ExportResult(ExportOutcome.RETRY, failures=1, failure=ExportFailure.NETWORK, retry=lines,
                                detail=f"{type(exc).__name__}: {exc}"[:300])

    def _export(self, lines: list[bytes], timeout: float | None, *, resend_invalid: bool) -> ExportResult:
        posted = self._post(b"".join(lines), timeout)
        if isinstance(posted, ExportResult):
            posted.retry = lines
            return posted
        status, answer, location = posted
        if 200 <= status < 300:
            return self._success(lines, answer)
        detail = str(answer.get("detail", ""))[:300]
        fail = ExportResult(ExportOutcome.RETRY, posts=1, failures=1, status=status, detail=detail, retry=lines)
        if 300 <= status < 400:
            fail.failure, fail.location = ExportFailure.REDIRECT, location
            fail.detail = f"redirected to {location!r}; set the collector URL to the final address"
            return fail
        if status in (401, 403):
            fail.failure = ExportFailure.AUTH
            return fail
        if status >= 500 or status in _RETRY_STATUSES:
            fail.failure = ExportFailure.SERVER
            return fail
        if status == 413:
            return self._split(lines, timeout, fail)
        errors = answer.get("errors")
        bad = {e.get("index") for e in errors if isinstance(e, dict)} if isinstance(errors, list) else set()
        kept = [line for i, line in enumerate(lines) if i not in bad]
        if status == 422 and bad and kept and resend_invalid:
            result = ExportResult(ExportOutcome.SUCCESS, rejected=len(lines) - len(kept), posts=1, failures=1,
                                  failure=ExportFailure.INVALID, status=status, detail=detail)
            again = self._export(kept, timeout, resend_invalid=False)  # once: a second 422 drops the rest
            result.merge(again)
            result.outcome, result.retry = again.outcome, again.retry
            if again.outcome is ExportOutcome.DROPPED:
                result.outcome = ExportOutcome.SUCCESS
            return result
        return ExportResult(ExportOutcome.DROPPED, rejected=len(lines), posts=1, failures=1, status=status,
                            detail=detail, failure=ExportFailure.INVALID if status == 422 else ExportFailure.REFUSED)

    def _success(self, lines: list[bytes], answer: dict[str, Any]) -> ExportResult:
        if answer.get("_reply_too_large"):
            return ExportResult(ExportOutcome.SUCCESS, delivered=len(lines), posts=1,
                                failure=ExportFailure.REPLY_TOO_LARGE,
                                detail=f"reply over {MAX_REPLY_BYTES} bytes not read")
        interval, directives = reply_hints(answer)

        def count(key: str) -> int:
            value = answer.get(key, 0)
            return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0

        return ExportResult(ExportOutcome.SUCCESS, delivered=len(lines), accepted=count("accepted"),
                            duplicates=count("duplicates"), posts=1, flush_interval_s=interval, directives=directives)

    def _split(self, lines: list[bytes], timeout: float | None, fail: ExportResult) -> ExportResult:
        if len(lines) == 1:  # one sample is too large: the collector's limit is wrong, not the batch
            fail.failure = ExportFailure.TOO_LARGE
            fail.detail = "413 for a single sample: the collector's request limit is too small"
            return fail
        half = len(lines) // 2
        result = ExportResult(ExportOutcome.SUCCESS, posts=1, failures=1)
        for part in (lines[:half], lines[half:]):
            sub = self._export(part, timeout, resend_invalid=True)
            result.merge(sub)
            if sub.outcome is ExportOutcome.RETRY:
                result.outcome = ExportOutcome.RETRY
                result.retry = sub.retry + (lines[half:] if part is not lines[half:] else [])
                return result
        return result

    def shutdown(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    close = shutdown

    def describe(self) -> str:
        return f"{self.scheme}://{self.host}{':' + str(self.port) if self.port else ''}{self.path}"

    def after_fork_in_child(self) -> list[int]:
        # the parent's socket: drop our reference without a shutdown (the parent keeps using it)
        self._conn = None
        return []

    def send(self, body: bytes, count: int, timeout: float | None = None) -> dict[str, Any]:
        """One POST of an NDJSON body; the collector's answer."""
        result = self.export(body.splitlines(keepends=True), timeout)
        return {"accepted": result.accepted, "duplicates": result.duplicates, "outcome": result.outcome.value}


class FileExporter:
    """No collector: append the (already validated, serialised) lines to a JSON Lines trace file.

    Unbuffered appends of whole lines: nothing sits in a Python buffer that a forked child
    could flush a second time; ``vramwatch analyze``/``import`` read the file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fh: Any = None

    def export(self, lines: Sequence[bytes], timeout: float | None = None) -> ExportResult:
        body = b"".join(lines)
        try:
            if self._fh is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.path, "ab", buffering=0)  # noqa: SIM115 - kept open across batches
            written = 0
            while written < len(body):
                written += self._fh.write(body[written:])
        except OSError as exc:
            return ExportResult(ExportOutcome.RETRY, failures=1, failure=ExportFailure.WRITE, retry=list(lines),
                                detail=f"{type(exc).__name__}: {exc}")
        return ExportResult(ExportOutcome.SUCCESS, delivered=len(lines), accepted=len(lines), posts=1)

    def fileno(self) -> int | None:
        try:
            return self._fh.fileno() if self._fh is not None else None
        except (OSError, ValueError):
            return None

    def shutdown(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            with contextlib.suppress(OSError):
                fh.close()

    close = shutdown

    def describe(self) -> str:
        return str(self.path)

    def after_fork_in_child(self) -> list[int]:
        fd = self.fileno()
        return [fd] if fd is not None else []


class InMemoryExporter:
    """Keeps every exported sample (decoded) in ``samples``; ``script`` can fail the next exports."""

    def __init__(self) -> None:
        self.samples: list[dict[str, Any]] = []
        self.script: list[ExportResult] = []  # returned (and popped) before anything is kept
        self.lock = threading.Lock()
        self.shut = False

    def export(self, lines: Sequence[bytes], timeout: float | None = None) -> ExportResult:
        with self.lock:
            if self.script:
                result = self.script.pop(0)
                if result.outcome is ExportOutcome.RETRY:
                    result.retry = list(lines)
                return result
            self.samples.extend(orjson.loads(line) for line in lines if line.strip())
        return ExportResult(ExportOutcome.SUCCESS, delivered=len(lines), accepted=len(lines), posts=1)

    def shutdown(self) -> None:
        self.shut = True

    def describe(self) -> str:
        return "memory"

    def after_fork_in_child(self) -> list[int]:
        return []


__all__ = ["INGEST_PATH", "MAX_REPLY_BYTES", "Exporter", "FileExporter", "HttpExporter", "InMemoryExporter",
           "parse_reply", "reply_hints"]
