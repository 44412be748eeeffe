"""Bounded readers: every byte vramwatch takes from outside itself passes through one of these.

One rule for every input surface (files, outbound HTTP answers, request bodies): memory and
time are bounded by a limit the caller names, whatever the content, and a refusal is a
:class:`LimitExceeded` that names the input (``file:line``, the URL) and the setting that
bounds it, so the CLI prints one line and exits 2, a route answers a 4xx, a fetcher counts
a failed peer. docs/reliability.md (``## Input surfaces``) lists each use with its default.

* **files**: :func:`open_input` (gzip sniffed, corrupt deflate data an ``OSError``),
  :class:`Lines` (lines split in C from 1 MiB blocks; a line longer than the cap is never
  held whole: it is counted as :data:`LONG_LINE` and skipped to its end), :class:`CsvRows`
  (the same lines through :mod:`csv`, a row's bytes counted across continuation lines);
* **compressed data**: :class:`Inflater` inflates gzip in bounded steps and counts the
  inflated bytes, so a bomb stops at its cap after inflating no more than the cap;
* **outbound HTTP**: :func:`fetch` (async, httpx) and :func:`fetch_sync` (the CLI's,
  http.client) stream the answer up to a size cap under one *total* deadline per request
  (not per read: a peer sending a byte a second still ends at the deadline); neither holds
  a lock nor follows a redirect, and a gzip answer is inflated through :class:`Inflater`.

Importable without the server extras (httpx is imported by :func:`fetch`'s caller's client
only); nothing here imports the rest of vramwatch.
"""

from __future__ import annotations

import asyncio
import csv
import gzip
import http.client
import os
import socket
import threading
import urllib.parse
import urllib.request
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from vramwatch.errors import EXIT_FAILURE, VramwatchError

if TYPE_CHECKING:
    import httpx

GZIP_MAGIC = b"\x1f\x8b"
#: bytes read from a file per block
BLOCK_BYTES = 1 << 20


class LimitExceeded(VramwatchError, ValueError):
    """An input past one of its bounds: ``where`` names the input, ``limit`` the setting (a CLI
    flag or a ``Settings`` field) a user raises to accept it."""

    status = 413

    def __init__(self, where: str, limit: str, message: str) -> None:
        super().__init__(f"{where}: {message} ({limit})")
        self.where, self.limit, self.message = where, limit, message


def size_text(value: int) -> str:
    """A byte count as a person reads it in a refusal: ``1 MiB``, ``64 KiB``, ``1,000 bytes``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale and value % scale == 0:
            return f"{value // scale:,} {unit}"
    return f"{value:,} bytes"


# ---------------------------------------------------------------- compressed data

class Inflater:
    """gzip (concatenated members too) inflated in steps of at most ``step`` bytes, the total
    capped at ``max_bytes``: :meth:`feed` raises :class:`LimitExceeded` as soon as the output
    would pass it, having inflated at most ``max_bytes + step``. Corrupt data: ``OSError``
    (``gzip.BadGzipFile``); zero padding after the last member (tape-style) is ignored, anything
    else after it that does not start a member is corrupt data, never silently dropped.
    The one inflater of the package: request bodies, uploads, answers, files.
    Cost: zlib's, O(output); memory: one step of output plus zlib's window."""

    def __init__(self, max_bytes: int, where: str, limit: str, step: int = 1 << 20) -> None:
        self.max_bytes, self.where, self.limit, self.step = max_bytes, where, limit, step
        self.inflated = 0
        self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._in_member = False  # data went into the current member and it has not ended
        self._ended = False  # a member ended: what follows must be another member or zero padding
        self._padding = False  # only zero bytes followed the last member so far

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The inflated output of ``data``, in pieces of at most ``step`` bytes."""
        while data:
            if self._ended and not self._in_member:
                if not data.strip(b"\x00"):
                    self._padding = True
                    return
                if self._padding or not GZIP_MAGIC.startswith(data[:2]):
                    raise gzip.BadGzipFile(f"{self.where}: {len(data)} bytes of trailing data after the gzip stream")
            self._in_member = True
            try:
                out = self._z.decompress(data, self.step)
            except zlib.error as exc:
                raise gzip.BadGzipFile(f"{self.where}: corrupt gzip data: {exc}") from None
            self.inflated += len(out)
            if self.inflated > self.max_bytes:
                raise LimitExceeded(self.where, self.limit, f"more than {size_text(self.max_bytes)} inflated")
            if out:
                yield out
            if self._z.eof:  # the next member, if any
                data = self._z.unused_data
                self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
                self._in_member, self._ended = False, True
                continue
            data = self._z.unconsumed_tail

    def finish(self) -> None:
        """Raise ``OSError`` when the data ended inside a member (truncated)."""
        if self._in_member:
            raise gzip.BadGzipFile(f"{self.where}: truncated gzip data")


# ---------------------------------------------------------------- files

class _Gunzip(gzip.GzipFile):
    """A GzipFile whose corrupt deflate data raises ``BadGzipFile`` (an OSError, which every
    reader of files reports as an unreadable file) instead of ``zlib.error``."""

    def read(self, size: int = -1) -> bytes:
        try:
            return super().read(size)
        except zlib.error as exc:
            raise gzip.BadGzipFile(f"corrupt gzip data: {exc}") from None

    def readline(self, size: int | None = -1) -> bytes:
        try:
            return super().readline(size)
        except zlib.error as exc:
            raise gzip.BadGzipFile(f"corrupt gzip data: {exc}") from None


def open_input(path: str | os.PathLike[str]) -> IO[bytes]:
    """A file opened for reading, inflated when it is gzip (sniffed, so a misnamed one reads).
    Read it through :class:`Lines` or bounded ``read(n)`` calls: gzip's ``read()`` of
    everything is the unbounded call this module exists to avoid."""
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller's with-block
    if raw.peek(2)[:2] == GZIP_MAGIC:
        return _Gunzip(fileobj=raw, mode="rb")  # type: ignore[return-value]
    return raw


class _LongLine:
    """The stand-in for a line longer than the cap (never held): a caller counts and names it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "LONG_LINE"


LONG_LINE: Any = _LongLine()


class Lines:
    """The lines of a binary stream (without their ``\\n``), each at most ``max_bytes``.

    Read in blocks of :data:`BLOCK_BYTES` and split in C (as fast as ``readlines``); a line
    longer than ``max_bytes`` is replaced by :data:`LONG_LINE` and the rest of it is read and
    dropped, so it counts as one line and the numbering stays right. Memory: one block plus
    one partial line (≤ ``max_bytes``), whatever the stream holds. ``read_bytes`` counts what
    was read (inflated bytes for a gzip file).
    """

    def __init__(self, fh: IO[bytes], max_bytes: int, block: int = BLOCK_BYTES) -> None:
        self.fh, self.max_bytes, self.block = fh, max_bytes, block
        self.read_bytes = 0

    def blocks(self) -> Iterator[list[Any]]:
        """Lists of consecutive lines (``bytes`` or :data:`LONG_LINE`), one list per block read."""
        tail = b""
        skipping = False
        while chunk := self.fh.read(self.block):
            self.read_bytes += len(chunk)
            if skipping:  # inside a long line: drop up to its end
                end = chunk.find(b"\n")
                if end < 0:
                    continue
                chunk, skipping = chunk[end + 1:], False
            joined = len(tail) + len(chunk)
            lines = (tail + chunk).split(b"\n") if tail else chunk.split(b"\n")
            tail = lines.pop()
            if len(tail) > self.max_bytes:
                lines.append(LONG_LINE)
                tail, skipping = b"", True
            if joined > self.max_bytes:  # only then may a complete line be too long
                lines = [LONG_LINE if line is not LONG_LINE and len(line) > self.max_bytes else line
                         for line in lines]
            if lines:
                yield lines
        if tail:
            yield [tail]

    def __iter__(self) -> Iterator[Any]:
        for lines in self.blocks():
            yield from lines


class CsvRows:
    """``(line number, cells)`` of a CSV file read through :class:`Lines` (UTF-8, strict).

    A line longer than ``max_bytes`` is never held: it reads as ``(line, LimitExceeded)`` and
    the next row follows, as does a row :mod:`csv` refuses (its field limit, raised to
    ``max_bytes`` and never lowered: it is process-wide), so a caller may count and skip
    them. A row spanning lines (a quoted field holding newlines) is bounded by ``max_bytes``
    in all; past it :class:`LimitExceeded` is raised (the reader cannot resynchronise).
    Memory: one block, one row."""

    def __init__(self, fh: IO[bytes], where: str, max_bytes: int, limit: str, **fmt: Any) -> None:
        self.where, self.max_bytes, self.limit = where, max_bytes, limit
        self._lines = Lines(fh, max_bytes, block=64 * 1024)  # rows are parsed one by one: small blocks
        self._number = 0
        self._pending = 0
        self._long: int | None = None
        if csv.field_size_limit() < max_bytes:
            csv.field_size_limit(max_bytes)
        self._reader = csv.reader(self._text(), **fmt)

    def _refuse(self, number: int, what: str) -> LimitExceeded:
        return LimitExceeded(f"{self.where}:{number}", self.limit, f"{what} longer than {size_text(self.max_bytes)}")

    def _text(self) -> Iterator[str]:
        for line in self._lines:
            self._number += 1
            if line is LONG_LINE:
                self._long = self._number
                yield "\n"  # an empty row in its place: the numbering stays right
                continue
            self._pending += len(line) + 1
            if self._pending > self.max_bytes:
                raise self._refuse(self._number, "row")
            try:
                yield line.decode("utf-8") + "\n"
            except UnicodeDecodeError as exc:
                raise UnicodeDecodeError(exc.encoding, exc.object, exc.start, exc.end,
                                         f"line {self._number}: {exc.reason}") from None

    def __iter__(self) -> Iterator[tuple[int, list[str] | LimitExceeded]]:
        while True:
            try:
                cells: list[str] | LimitExceeded = next(self._reader)
            except StopIteration:
                return
            except csv.Error as exc:
                cells = LimitExceeded(f"{self.where}:{self._number}", self.limit, f"csv: {exc}")
            self._pending = 0
            if self._long is not None:
                cells, self._long = self._refuse(self._long, "line"), None
            yield self._reader.line_num, cells


def read_capped(fh: IO[bytes], max_bytes: int, where: str, limit: str) -> bytes:
    """All of ``fh`` when it holds at most ``max_bytes`` (read at most ``max_bytes + 1``)."""
    data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise LimitExceeded(where, limit, f"larger than {size_text(max_bytes)}")
    return data


# ---------------------------------------------------------------- outbound HTTP

class FetchError(VramwatchError):
    """No usable answer: unreachable, the deadline passed, or the answer is too large (then
    ``limit`` names the setting). The message is one line for a person."""

    exit_code = EXIT_FAILURE
    status = 502

    def __init__(self, message: str, limit: str | None = None) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes
    content_type: str = field(default="")


@dataclass(frozen=True)
class HttpLimits:
    """What one outbound request may cost: ``deadline_s`` of wall time from its start to the
    last byte, ``max_bytes`` of answer (inflated). ``*_flag``: the settings a refusal names."""

    deadline_s: float
    max_bytes: int
    deadline_flag: str = "deadline"
    size_flag: str = "size limit"
    #: the deadline as the user set it, for messages (``deadline_s`` may be what is left of it)
    stated_s: float | None = None

    def too_slow(self, url: str) -> FetchError:
        said = self.deadline_s if self.stated_s is None else self.stated_s
        return FetchError(f"{url}: no complete answer within {said:g} s ({self.deadline_flag})", self.deadline_flag)


class _Body:
    """Collects an answer's body up to its limit, inflating a gzip one through :class:`Inflater`."""

    def __init__(self, limits: HttpLimits, where: str, encoding: str) -> None:
        self.limits, self.where = limits, where
        encoding = encoding.strip().lower()
        if encoding not in ("", "identity", "gzip"):
            raise FetchError(f"{where}: answered with content-encoding {encoding!r} (asked for gzip or none)")
        self.inflater = Inflater(limits.max_bytes, where, limits.size_flag) if encoding == "gzip" else None
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> None:
        pieces = self.inflater.feed(data) if self.inflater is not None else (data,)
        for piece in pieces:
            self.size += len(piece)
            if self.size > self.limits.max_bytes:
                raise LimitExceeded(self.where, self.limits.size_flag,
                                    f"answer larger than {size_text(self.limits.max_bytes)}")
            self.parts.append(piece)

    def done(self) -> bytes:
        if self.inflater is not None:
            self.inflater.finish()
        return b"".join(self.parts)


async def fetch(client: httpx.AsyncClient, method: str, url: str, limits: HttpLimits, *,
                headers: Mapping[str, str] | None = None, params: Mapping[str, Any] | None = None,
                content: bytes | None = None) -> Reply:
    """One request on ``client``, bounded as the module docstring says. Raises :class:`FetchError`
    (transport failure, deadline, too large, corrupt gzip); an HTTP error status is a Reply.
    The client must not follow redirects (httpx's default) and must not carry credentials of
    its own: ``headers`` are this request's, so a token goes only where the caller sends it."""
    import httpx

    sent = {"accept-encoding": "gzip", **(headers or {})}
    try:
        async with asyncio.timeout(limits.deadline_s):
            request = client.build_request(method, url, headers=sent, params=params, content=content)
            response = await client.send(request, stream=True)
            try:
                body = _Body(limits, url, response.headers.get("content-encoding", ""))
                async for chunk in response.aiter_raw():
                    body.add(chunk)
                data = body.done()
            finally:
                await response.aclose()
    except TimeoutError:
        raise limits.too_slow(url) from None
    except LimitExceeded as exc:
        raise FetchError(str(exc), exc.limit) from None
    except (httpx.HTTPError, OSError) as exc:
        raise FetchError(f"{url}: {type(exc).__name__}: {exc}") from None
    return Reply(response.status_code, response.headers, data, response.headers.get("content-type", ""))


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """A connection for ``url`` (through ``$http_proxy``/``$https_proxy`` unless ``$no_proxy``
    names the host, as urllib does) and the request target to send on it."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    https = parts.scheme == "https"
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        p = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
        if https:
            conn = http.client.HTTPSConnection(p.hostname or "", p.port, timeout=timeout)
            conn.set_tunnel(host, port)
            return conn, target
        return http.client.HTTPConnection(p.hostname or "", p.port, timeout=timeout), url
    cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
    return cls(host, port, timeout=timeout), target


def fetch_sync(url: str, limits: HttpLimits, *, method: str = "GET", body: bytes | None = None,
               headers: Mapping[str, str] | None = None) -> Reply:
    """:func:`fetch` for a thread without an event loop (the CLI): http.client, with a watchdog
    that shuts the socket at the deadline, so no read (headers included) outlives it."""
    conn, target = _connection(url, limits.deadline_s)
    expired = threading.Event()

    def abort() -> None:
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(limits.deadline_s, abort)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request(method, target, body=body, headers={"Accept-Encoding": "gzip", **(headers or {})})
        response = conn.getresponse()
        collected = _Body(limits, url, response.getheader("content-encoding") or "")
        while chunk := response.read1(1 << 16):
            collected.add(chunk)
        data = collected.done()
        if expired.is_set():
            raise TimeoutError
        return Reply(response.status, dict(response.getheaders()), data, response.getheader("content-type") or "")
    except LimitExceeded as exc:
        raise FetchError(str(exc), exc.limit) from None
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set() or isinstance(exc, TimeoutError):
            raise limits.too_slow(url) from None
        raise FetchError(f"cannot reach {url}: {getattr(exc, 'strerror', None) or exc}") from None
    finally:
        watchdog.cancel()
        conn.close()


__all__ = ["BLOCK_BYTES", "LONG_LINE", "CsvRows", "FetchError", "HttpLimits", "Inflater", "LimitExceeded", "Lines",
           "Reply", "fetch", "fetch_sync", "open_input", "read_capped", "size_text"]
