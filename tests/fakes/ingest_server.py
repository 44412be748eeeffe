"""A scripted stand-in for the collector's ingest endpoint (stdlib http.server).

Used where a test must choose the status code (503, 422, 413, 401) or the timing; the
end-to-end tests use the real collector. It decodes the body the way the collector does
(gzip NDJSON), keeps every request, and stores samples idempotently by the collector's
key (run, rank, incarnation, step, phase).
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ScriptedIngest:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.stored: dict[tuple, dict[str, Any]] = {}
        self.order: list[tuple] = []  # keys in arrival order (first arrival only)
        self.script: list[Any] = []  # per request: int status, or callable(samples) -> (status, body)
        self.delay_s = 0.0
        self.reply_extra: dict[str, Any] = {}  # merged into every 200 answer (hints, directives, padding)
        self.location: str | None = None  # sent as Location with 3xx answers
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                body = gzip.decompress(raw) if self.headers.get("Content-Encoding") == "gzip" else raw
                samples = [json.loads(line) for line in body.splitlines() if line.strip()]
                status, answer = owner._answer(samples, dict(self.headers), self.path)
                data = json.dumps(answer).encode()
                if owner.delay_s:
                    time.sleep(owner.delay_s)
                self.send_response(status)
                if owner.location is not None and 300 <= status < 400:
                    self.send_header("Location", owner.location)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _answer(self, samples: list[dict[str, Any]], headers: dict[str, str], path: str) -> tuple[int, Any]:
        with self.lock:
            self.requests.append({"samples": samples, "headers": headers, "path": path})
            action = self.script.pop(0) if self.script else 200
        if callable(action):
            status, answer = action(samples)
        elif action != 200:
            status, answer = action, {"detail": f"scripted {action}"}
        else:
            status, answer = 200, None
        if status != 200:
            return status, answer
        accepted = duplicates = 0
        with self.lock:
            for s in samples:
                key = (s["run"], s["rank"], s.get("incarnation", ""), s["step"], s["phase"])
                if key in self.stored:
                    duplicates += 1
                else:
                    self.stored[key] = s
                    self.order.append(key)
                    accepted += 1
        return 200, {"accepted": accepted, "duplicates": duplicates, "rejected": 0, **self.reply_extra}

    def steps(self, phase: str = "train") -> list[int]:
        with self.lock:
            return [k[3] for k in self.order if k[4] == phase]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> ScriptedIngest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def dead_url() -> str:
    """A loopback URL nothing listens on (connection refused at once)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
