"""Running the front: in the foreground (``vramwatch serve --peers``) or in a background
thread (tests, benchmarks); the same uvicorn server either way."""

from __future__ import annotations

import threading
import time
from types import TracebackType

import uvicorn

from vramwatch.collector.server import bind_socket, guarded_config
from vramwatch.collector.serving.app import allowed_hosts_for
from vramwatch.collector.serving.door import HostCheck
from vramwatch.collector.serving.guard import ConnectionGuard
from vramwatch.front.app import FrontSettings, create_front_app


def _config(settings: FrontSettings, log_level: str) -> uvicorn.Config:
    """The front behind the collector's protections: its Host check (DNS rebinding) and its
    connection guard (read deadlines, head bound, connection cap), on httptools when installed."""
    app = HostCheck(create_front_app(settings), allowed_hosts_for(settings.bind_host, settings.allowed_hosts))
    return guarded_config(app, ConnectionGuard(settings), log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=5, timeout_keep_alive=30)


def serve_front(settings: FrontSettings, host: str = "127.0.0.1", port: int = 8765, log_level: str = "info") -> None:
    sock = bind_socket(host, port)
    uvicorn.Server(_config(settings, log_level)).run(sockets=[sock])


class BackgroundFront:
    """A real front on a loopback port in a daemon thread."""

    def __init__(self, settings: FrontSettings, host: str = "127.0.0.1", port: int = 0) -> None:
        self.settings = settings
        self.host = host
        self.port = port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundFront:
        sock = bind_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(_config(self.settings, "warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="vramwatch-front", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("front did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(10)
        self._server = self._thread = None

    def __enter__(self) -> BackgroundFront:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
