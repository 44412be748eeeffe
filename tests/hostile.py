"""Servers that misbehave on purpose (the attack benchmark and the tests), on real loopback
sockets: a peer, a Prometheus or a collector as an attacker (or a broken proxy) would run it.
Each records what it was asked (path and headers) and how many body bytes it managed to send
before the client hung up.

    with Hostile(drip(b'{"x": 1}', every_s=0.2)) as srv:   # one byte every 0.2 s
        ... srv.url ..., srv.requests, srv.sent
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Behaviour = Callable[["Hostile", socket.socket, "Request"], None]


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class Hostile:
    behave: Behaviour
    host: str = "127.0.0.1"
    requests: list[Request] = field(default_factory=list)
    sent: int = 0
    _sock: socket.socket | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _conns: list[socket.socket] = field(default_factory=list)

    @property
    def port(self) -> int:
        assert self._sock is not None
        return self._sock.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> Hostile:
        self._sock = socket.create_server((self.host, 0), backlog=4096)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._sock is not None
        self._sock.close()
        for conn in list(self._conns):
            try:
                conn.close()
            except OSError:
                pass

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                while not self._stop.is_set():
                    request = _read_head(conn)
                    if request is None:
                        return
                    self.requests.append(request)
                    self.behave(self, conn, request)
        except OSError:
            return

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def stopped(self) -> bool:
        return self._stop.is_set()


def _read_head(conn: socket.socket) -> Request | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0") or 0)
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        rest += chunk
    return Request(method, path, headers)


def _head(status: int = 200, length: int | None = None, ctype: str = "application/json",
          extra: dict[str, str] | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} X", f"content-type: {ctype}"]
    lines.append(f"content-length: {length}" if length is not None else "connection: close")
    lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer(body: bytes | Callable[[Request], bytes], status: int = 200, ctype: str = "application/json",
           extra: dict[str, str] | None = None) -> Behaviour:
    """A well-formed answer (``body`` may depend on the request)."""

    def behave(srv: Hostile, conn: socket.socket, request: Request) -> None:
        data = body(request) if callable(body) else body
        srv.send(conn, _head(status, len(data), ctype, extra) + data)

    return behave


def drip(body: bytes, every_s: float = 0.2) -> Behaviour:
    """Headers at once (with the full length), then the body one byte every ``every_s``."""

    def behave(srv: Hostile, conn: socket.socket, request: Request) -> None:
        srv.send(conn, _head(200, len(body)))
        for i in range(len(body)):
            if srv.stopped():
                return
            time.sleep(every_s)
            srv.send(conn, body[i:i + 1])

    return behave


def flood(prefix: bytes = b'{"data": "', chunk: int = 1 << 20, limit: int = 8 << 30, gzip_bomb: bool = False
          ) -> Behaviour:
    """Headers, then an endless body (up to ``limit`` bytes) as fast as the client reads it. With
    ``gzip_bomb`` the body is gzip of zeros, declared ``content-encoding: gzip``."""

    def behave(srv: Hostile, conn: socket.socket, request: Request) -> None:
        if gzip_bomb:
            import zlib

            deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
            srv.send(conn, _head(200, None, extra={"content-encoding": "gzip"}))
            block = deflate.compress(b"\0" * chunk * 64)
            while srv.sent < limit and not srv.stopped():
                srv.send(conn, block)
                block = deflate.compress(b"\0" * chunk * 64) or deflate.flush(zlib.Z_SYNC_FLUSH)
            return
        srv.send(conn, _head(200, None) + prefix)
        block = b"x" * chunk
        while srv.sent < limit and not srv.stopped():
            srv.send(conn, block)

    return behave


def silent() -> Behaviour:
    """Reads the request and never answers (until the client gives up)."""

    def behave(srv: Hostile, conn: socket.socket, request: Request) -> None:
        while not srv.stopped():
            try:
                conn.settimeout(0.5)
                if conn.recv(1) == b"":
                    return
            except TimeoutError:
                continue

    return behave


def json_answer(doc: Any, status: int = 200) -> Behaviour:
    import orjson

    return answer(orjson.dumps(doc), status)
