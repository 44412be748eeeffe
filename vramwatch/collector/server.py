"""Running the collector: in the foreground (``vramwatch serve``) or in a background
thread (``vramwatch demo``, tests, benchmarks) — the same uvicorn server either way."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import uvicorn

from vramwatch.collector.serving.app import Settings, close_state, create_app, open_state
from vramwatch.collector.serving.guard import (
    MAX_HEAD_BYTES,
    ConnectionGuard,
    HttpChoice,
    guarded_protocol,
    http_protocol,
    raise_open_files_limit,
)
from vramwatch.collector.store import Store
from vramwatch.errors import EXIT_FAILURE, VramwatchError

log = logging.getLogger("vramwatch.collector")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio only sets TCP_NODELAY on accepted sockets whose proto is
    # IPPROTO_TCP, and without it Nagle holds each response body for the client's delayed
    # ACK (~40 ms per keep-alive POST under load)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


#: At start a database locked by another process fails after this long, not the 10 s
#: a running collector's writes wait.
START_LOCK_TIMEOUT_S = 3.0


def check_database(db_path: str) -> None:
    """Open (and migrate) the database once so a locked or read-only file fails before the
    server starts, with a clear message (StoreError) instead of a crash loop."""
    Store(db_path, busy_timeout_s=START_LOCK_TIMEOUT_S, exclusive=True).close()


class ShutdownError(VramwatchError, RuntimeError):
    """The server stopped but could not close the database cleanly (e.g. disk full)."""

    exit_code = EXIT_FAILURE
    status = 500


def guarded_config(app: Any, guard: ConnectionGuard, http: HttpChoice = "auto", **options: Any) -> uvicorn.Config:
    """uvicorn's config for ``app`` behind ``guard`` on protocol ``http``; ``options`` pass through."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(guard, http),
        # the collector serves no WebSocket: an Upgrade header is ignored, the request answered
        # as plain HTTP (the guard follows requests, not hand-overs to another protocol)
        ws="none",
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        **options,
    )


def _config(settings: Settings, log_level: str, http: HttpChoice = "auto") -> uvicorn.Config:
    guard = ConnectionGuard(settings)
    app = create_app(settings)
    app.state.guard = guard
    return guarded_config(
        app, guard, http,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout_s)),
        # the collector serves many ranks on few connections; keep them open
        timeout_keep_alive=30,
    )


def _fit_connection_cap(settings: Settings) -> None:
    """Raise the open-files limit for the connection cap, or lower the cap to what fits."""
    spare = 128  # database, WAL, logs, the listening socket, worker threads
    limit = raise_open_files_limit(settings.max_connections + settings.health_reserve + spare)
    fits = limit - settings.health_reserve - spare
    if fits < settings.max_connections:
        log.warning("open-files limit %d: lowering --max-connections from %d to %d", limit,
                    settings.max_connections, max(16, fits))
        settings.max_connections = max(16, fits)


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGTERM/SIGINT end in a normal return (exit 0) after
    the graceful shutdown, instead of uvicorn re-raising the signal to die by it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8765, log_level: str = "info",
          http: HttpChoice = "auto") -> None:
    """Run in the foreground until SIGINT/SIGTERM; shutdown flushes and closes the DB.
    ``http``: uvicorn's HTTP protocol (:func:`~vramwatch.collector.serving.guard.http_protocol`).

    Raises :class:`ShutdownError` when the database could not be closed cleanly (the
    caller exits non-zero), StoreError when it cannot be opened."""
    protocol = http_protocol(http)  # ValueError before anything starts
    check_database(settings.db_path)
    settings.bind_host = host
    _fit_connection_cap(settings)
    config = _config(settings, log_level, protocol)
    open_state(config.app, settings)  # StoreError (one line) when the restore cannot read the file
    print(f"vramwatch collector: http://{host}:{port}/  db={settings.db_path}", file=sys.stderr)
    try:
        sock = bind_socket(host, port)
    except BaseException:
        close_state(config.app, settings)
        raise
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    # the actual port (also when --port 0 asked for a free one)
    log.info("listening on http://%s:%d (HTTP: %s)", shown, bound_port, protocol)
    if http == "auto" and protocol == "h11":
        log.warning("httptools is not installed: serving HTTP with h11 (about twice the CPU in the HTTP "
                    "layer of each request; pip install 'vramwatch[server]')")
    server = _Server(config)
    server.run(sockets=[sock])
    error = getattr(config.app.state, "shutdown_error", None)
    if error:
        raise ShutdownError(error)
    log.info("collector stopped cleanly")


class BackgroundServer:
    """A real collector (uvicorn + SQLite) on a loopback port, in a daemon thread.

    >>> with BackgroundServer("/tmp/vw.db") as srv:
    ...     print(srv.url)
    """

    def __init__(
        self,
        db_path: str,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        log_level: str = "warning",
        http: HttpChoice = "auto",
        **settings: object,
    ) -> None:
        self.settings = Settings(db_path=str(db_path), token=token, bind_host=host, **settings)  # type: ignore[arg-type]
        self.host = host
        self._requested_port = port
        self._log_level = log_level
        self.http = http_protocol(http)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def app(self):
        assert self._server is not None
        return self._server.config.app

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        check_database(self.settings.db_path)
        sock = bind_socket(self.host, self._requested_port)
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(_config(self.settings, self._log_level, self.http))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="vramwatch-collector", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("collector failed to start (see log)")
            if time.monotonic() > deadline:
                raise TimeoutError("collector did not start in time")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout)
        self._server = None
        self._thread = None

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
