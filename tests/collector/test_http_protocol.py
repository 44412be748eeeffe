"""The collector's HTTP layer on both of uvicorn's protocols: httptools (the default) and h11
(the fallback, ``serve --http h11``). Every test runs against both, so the fallback cannot rot
and a difference a client could see is one that a test names.

Real uvicorn on loopback ports and raw sockets: the real collector where the collector's own
routes answer, a guarded test app where a test needs an app that is slow, answers early or
records what it received. Deadlines are 1 s so each test takes a few seconds."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from helpers import make_sample, ndjson
from prometheus_helpers import need_module

from vramwatch.collector.server import BackgroundServer, bind_socket, guarded_config
from vramwatch.collector.serving import guard as guard_module
from vramwatch.collector.serving.guard import MAX_HEAD_BYTES, ConnectionGuard
from vramwatch.collector.settings import Settings

HOST = b"Host: 127.0.0.1\r\n"
DEADLINE_S = 1.0


@pytest.fixture(scope="module", params=["httptools", "h11"])
def http(request: pytest.FixtureRequest) -> str:
    if request.param == "httptools":
        need_module("httptools", "httptools")  # the server extra: under CI=true its absence fails
    return request.param


@pytest.fixture(scope="module")
def collector(http: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    db = tmp_path_factory.mktemp(f"http-{http}") / "vw.db"
    with BackgroundServer(str(db), http=http, header_timeout_s=DEADLINE_S, body_timeout_s=DEADLINE_S) as srv:
        assert srv.http == http
        yield srv


# ------------------------------------------------------------------ a guarded test app

RECEIVED: list[str] = []  # the last message each /read request got from receive()


async def _test_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """/slow answers after 1.5 s; /early answers 413 without reading the body; /read reads the
    body and records how the reading ended; /late-read reads it only after 2.5 s; /echo-headers
    answers the header names it was given; anything else: 200 with the path."""
    path = scope["path"]
    if path == "/slow":
        await asyncio.sleep(1.5)
    elif path == "/read":
        while (message := await receive())["type"] == "http.request" and message.get("more_body"):
            pass
        RECEIVED.append(message["type"])
    elif path == "/late-read":
        await asyncio.sleep(2.5)
        size = 0
        while (message := await receive())["type"] == "http.request":
            size += len(message["body"])
            if not message.get("more_body"):
                break
        path = f"/late-read {size}"
    elif path == "/echo-headers":
        path = ",".join(name.decode() for name, _ in scope["headers"])
    status = 413 if path == "/early" else 200
    body = path.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def app_port(http: str) -> Iterator[int]:
    """The test app behind the collector's guard and uvicorn options, on protocol ``http``."""
    guard = ConnectionGuard(Settings(db_path="unused", header_timeout_s=DEADLINE_S, body_timeout_s=DEADLINE_S))
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(guarded_config(_test_app, guard, http, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "test app did not start"
        time.sleep(0.02)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


# ------------------------------------------------------------------ raw HTTP


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _read_until_closed(sock: socket.socket, timeout: float = 6.0) -> tuple[bytes, float]:
    """Everything until the server closes; and when it closed (monotonic)."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data, time.monotonic()


def _read_response(sock: socket.socket, buffered: bytearray) -> tuple[int, bytes]:
    """One response with a content-length (status, body); ``buffered`` keeps what follows it."""
    sock.settimeout(6.0)
    while b"\r\n\r\n" not in buffered:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {bytes(buffered)[:200]!r}"
        buffered += chunk
    head, _, _ = bytes(buffered).partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    fields = dict(line.lower().split(b": ", 1) for line in lines[1:])
    length = int(fields.get(b"content-length", b"0"))
    end = len(head) + 4 + length
    while len(buffered) < end:
        chunk = sock.recv(65536)
        assert chunk, "closed inside a response body"
        buffered += chunk
    body = bytes(buffered[len(head) + 4:end])
    del buffered[:end]
    return status, body


def _get(path: str, version: bytes = b"1.1") -> bytes:
    return b"GET " + path.encode() + b" HTTP/" + version + b"\r\n" + HOST + b"\r\n"


def _samples_body(first_step: int) -> bytes:
    """10 samples (steps from ``first_step``: a step already stored would count as a duplicate)."""
    steps = range(first_step, first_step + 10)
    return gzip.compress(ndjson([make_sample(step, run="http-proto") for step in steps]), 1)


def _stored(srv: BackgroundServer) -> int:
    with sqlite3.connect(srv.settings.db_path) as conn:
        return conn.execute("SELECT count(*) FROM samples JOIN series ON series.id = samples.series "
                            "WHERE run = 'http-proto'").fetchone()[0]


# ------------------------------------------------------------------ deadlines


def test_keep_alive_idleness_is_not_the_header_deadline_and_a_request_s_first_byte_starts_it(collector) -> None:
    with _connect(collector.port) as sock:
        buffered = bytearray()
        sock.sendall(_get("/healthz"))
        assert _read_response(sock, buffered)[0] == 200
        time.sleep(DEADLINE_S * 1.6)  # idle between requests: uvicorn's keep-alive (30 s), not the deadline
        sock.sendall(_get("/healthz"))
        assert _read_response(sock, buffered)[0] == 200
        time.sleep(DEADLINE_S * 1.6)
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # the next request's first bytes, then nothing
        started = time.monotonic()
        reply, closed = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert DEADLINE_S * 0.8 < closed - started < DEADLINE_S * 3, closed - started


@contextlib.contextmanager
def _dripping(sock: socket.socket, data: bytes) -> Iterator[None]:
    """Send ``data`` on ``sock`` every 0.2 s in a thread until the block ends (or the socket closes)."""
    stop = threading.Event()

    def drip() -> None:
        while not stop.wait(0.2):
            try:
                sock.send(data)
            except OSError:
                return

    threading.Thread(target=drip, daemon=True).start()
    try:
        yield
    finally:
        stop.set()


def test_blank_lines_do_not_hold_a_connection_open(collector, http) -> None:
    """h11 answers a run of blank lines 400; llhttp skips them without beginning a request, so
    the guard counts them as a request's first bytes and closes at the header deadline (a
    deliberate difference in the answer, none in how long the connection is held)."""
    with _connect(collector.port) as sock:
        sock.sendall(_get("/healthz"))  # a request read in full: the connection's first deadline is over
        assert _read_response(sock, bytearray())[0] == 200
        with _dripping(sock, b"\r\n"):
            started = time.monotonic()
            reply, closed = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408" if http == "httptools" else b"HTTP/1.1 400"), reply[:200]
    assert closed - started < DEADLINE_S * 3


def test_a_stalled_body_gets_408_and_the_app_a_disconnect(app_port) -> None:
    RECEIVED.clear()
    with _connect(app_port) as sock:
        sock.sendall(b"POST /read HTTP/1.1\r\n" + HOST + b"Content-Length: 1000\r\n\r\n" + b"x" * 10)
        started = time.monotonic()
        reply, closed = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert closed - started < DEADLINE_S * 3
    deadline = time.monotonic() + 5
    while not RECEIVED and time.monotonic() < deadline:
        time.sleep(0.02)
    assert RECEIVED == ["http.disconnect"]


def test_an_answer_already_sent_is_not_followed_by_a_408(app_port) -> None:
    """The app answered before reading the body; the client trickles it: the connection is
    closed at the body deadline without a second, unsolicited response."""
    with _connect(app_port) as sock:
        sock.sendall(b"POST /early HTTP/1.1\r\n" + HOST + b"Content-Length: 100000\r\n\r\n")
        with _dripping(sock, b" "):
            started = time.monotonic()
            reply, closed = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413") and reply.count(b"HTTP/1.1 ") == 1, reply[:300]
    assert closed - started < DEADLINE_S * 4


def test_the_body_deadline_waits_while_the_server_stopped_reading(app_port) -> None:
    """The app reads the body only after 2.5 s (2.5 deadlines): uvicorn stops reading past
    64 KiB buffered (flow control), and that pause is the server's, not the client's."""
    body = b"y" * (512 * 1024)
    with _connect(app_port) as sock:
        sender = threading.Thread(target=sock.sendall, args=(
            b"POST /late-read HTTP/1.1\r\n" + HOST + b"Content-Length: %d\r\n\r\n" % len(body) + body,), daemon=True)
        sender.start()
        status, answer = _read_response(sock, bytearray())
        sender.join(5)
    assert (status, answer) == (200, b"/late-read %d" % len(body))


def test_pipelined_requests_are_answered_in_order_and_a_slow_answer_is_not_the_client_s_delay(app_port) -> None:
    """Requests sent back to back are answered in order. Then /slow takes 1.5 deadlines while
    the client has already sent half of the next request, and completes it after 1.8: the
    server owed an answer all that time, so the waiting half-request is not cut off."""
    with _connect(app_port) as sock:
        buffered = bytearray()
        sock.sendall(_get("/one") + _get("/two") + _get("/three"))
        assert [_read_response(sock, buffered) for _ in range(3)] == [(200, b"/one"), (200, b"/two"),
                                                                       (200, b"/three")]
        sock.sendall(_get("/slow") + b"GET /last HTTP/1.1\r\n")
        time.sleep(DEADLINE_S * 1.8)
        sock.sendall(HOST + b"\r\n")
        answers = [_read_response(sock, buffered) for _ in range(2)]
    assert answers == [(200, b"/slow"), (200, b"/last")]


# ------------------------------------------------------------------ what clients send


def test_a_head_past_the_bound_is_answered_400_and_one_below_it_is_served(collector) -> None:
    filler = b"X-Filler: " + b"f" * 200 + b"\r\n"
    below = b"GET /healthz HTTP/1.1\r\n" + HOST + filler * ((MAX_HEAD_BYTES - 1024) // len(filler)) + b"\r\n"
    with _connect(collector.port) as sock:
        sock.sendall(below)
        assert _read_response(sock, bytearray())[0] == 200
    with _connect(collector.port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n" + HOST + filler * (MAX_HEAD_BYTES // 2 // len(filler)))
        time.sleep(0.2)  # a second read: the head is still incomplete, past the bound
        sock.sendall(filler * (MAX_HEAD_BYTES // len(filler)))
        started = time.monotonic()
        reply, closed = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 400") and reply.endswith(b"Invalid HTTP request received."), reply[:300]
    assert closed - started < DEADLINE_S * 0.5  # the bound, not the header deadline


def test_a_chunked_request_body_is_ingested(collector) -> None:
    """The hook sends Content-Length; curl and others may stream with chunked encoding."""
    body = _samples_body(0)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 100]), body[i:i + 100]) for i in range(0, len(body), 100))
    before = _stored(collector)
    with _connect(collector.port) as sock:
        sock.sendall(b"POST /api/v1/samples HTTP/1.1\r\n" + HOST + b"Content-Type: application/x-ndjson\r\n"
                     b"Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
        status, answer = _read_response(sock, bytearray())
    assert status == 200, answer
    assert _stored(collector) == before + 10


def test_expect_100_continue_is_answered_before_the_body(collector) -> None:
    body = _samples_body(100)
    before = _stored(collector)
    with _connect(collector.port) as sock:
        sock.sendall(b"POST /api/v1/samples HTTP/1.1\r\n" + HOST + b"Content-Type: application/x-ndjson\r\n"
                     b"Content-Encoding: gzip\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        sock.settimeout(5)
        interim = sock.recv(65536)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n", interim
        sock.sendall(body)
        status, answer = _read_response(sock, bytearray())
    assert status == 200, answer
    assert _stored(collector) == before + 10


def test_http_1_0_is_answered_and_closed(collector) -> None:
    with _connect(collector.port) as sock:
        sock.sendall(_get("/healthz", b"1.0"))
        reply, _ = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200") and b"connection: close" in reply.lower(), reply[:300]


def test_an_invalid_request_is_answered_400_and_closed(collector) -> None:
    with _connect(collector.port) as sock:
        sock.sendall(b"NOT AN HTTP REQUEST\r\n\r\n")
        reply, _ = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 400") and reply.endswith(b"Invalid HTTP request received."), reply[:300]


#: unusual requests and the status each protocol answers (httptools, h11): llhttp is the
#: stricter parser (known upper-case methods, CRLF line ends, no line folding, no request with
#: both Content-Length and Transfer-Encoding: the request-smuggling shapes) and extracts the
#: path of an absolute-form target; h11 is lenient with line ends and folding. No client of the
#: collector (the hook's http.client, httpx, curl, browsers, Prometheus) sends any of these.
UNUSUAL = {
    "unknown method": (b"FOO /healthz HTTP/1.1\r\n" + HOST + b"\r\n", 400, 405),
    "lower-case method": (b"get /healthz HTTP/1.1\r\n" + HOST + b"\r\n", 400, 405),
    "absolute-form target": (b"GET http://127.0.0.1/healthz HTTP/1.1\r\n" + HOST + b"\r\n", 200, 404),
    "obsolete line folding": (b"GET /healthz HTTP/1.1\r\n" + HOST + b"X-A: a\r\n b\r\n\r\n", 400, 200),
    "bare LF line ends": (b"GET /healthz HTTP/1.1\nHost: 127.0.0.1\n\n", 400, 200),
    "Content-Length and Transfer-Encoding": (b"POST /api/v1/samples HTTP/1.1\r\n" + HOST
                                             + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                                             400, 415),
    "two Content-Lengths": (b"POST /api/v1/samples HTTP/1.1\r\n" + HOST
                            + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400, 400),
    "no Host on HTTP/1.1": (b"GET /healthz HTTP/1.1\r\n\r\n", 421, 400),  # 421: the collector's Host check
}


def test_unusual_requests_get_each_parser_s_answer(collector, http) -> None:
    answers = {}
    for name, (request, *_) in UNUSUAL.items():
        with _connect(collector.port) as sock:
            sock.sendall(request)
            reply = b""
            while b"\r\n" not in reply and (chunk := sock.recv(65536)):
                reply += chunk
        answers[name] = int(reply.split(b" ", 2)[1]) if reply else None
    column = 0 if http == "httptools" else 1
    assert answers == {name: codes[column] for name, (_, *codes) in UNUSUAL.items()}


def test_header_names_reach_the_app_in_lower_case(app_port) -> None:
    with _connect(app_port) as sock:
        sock.sendall(b"GET /echo-headers HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Mixed-Case: V\r\n\r\n")
        status, answer = _read_response(sock, bytearray())
    assert (status, answer) == (200, b"host,x-mixed-case")


# ------------------------------------------------------------------ the choice


def test_serve_uses_httptools_by_default_and_h11_on_request(tmp_path, monkeypatch) -> None:
    need_module("httptools", "httptools")
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from vramwatch.cli import main
    from vramwatch.collector import server

    with BackgroundServer(str(tmp_path / "a.db")) as srv:
        assert srv.http == "httptools" and issubclass(srv._server.config.http, HttpToolsProtocol)
    seen: dict[str, Any] = {}
    monkeypatch.setattr(server, "serve", lambda settings, **kw: seen.update(kw))
    assert main(["serve", "--db", str(tmp_path / "b.db")]) == 0 and seen["http"] == "auto"
    assert main(["serve", "--db", str(tmp_path / "b.db"), "--http", "h11"]) == 0 and seen["http"] == "h11"
    cls = guard_module.guarded_protocol(ConnectionGuard(Settings(db_path="x")), "h11")
    assert issubclass(cls, H11Protocol)
    # without httptools: auto falls back to h11, asking for it by name is an error
    monkeypatch.setattr(guard_module, "HttpToolsProtocol", None)
    assert guard_module.http_protocol("auto") == "h11"
    with pytest.raises(ValueError, match="httptools package is not installed"):
        guard_module.http_protocol("httptools")
    assert main(["serve", "--db", str(tmp_path / "b.db"), "--http", "httptools"]) == 2


def test_without_httptools_the_collector_serves_with_h11() -> None:
    """An install without the package (not the server extra): the guard module imports and
    the collector answers on h11."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['httptools'] = None\n"
            "import httpx, tempfile, os\n"
            "from vramwatch.collector.server import BackgroundServer\n"
            "with tempfile.TemporaryDirectory() as tmp, BackgroundServer(os.path.join(tmp, 'vw.db')) as srv:\n"
            "    print(srv.http, httpx.get(srv.url + '/healthz', timeout=10).status_code)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).resolve().parents[2]))
    assert out.stdout.split() == ["h11", "200"], out.stderr[-2000:]
