"""Helpers around the real collector for end-to-end tests: a `vramwatch serve` subprocess
that can be SIGKILLed and restarted on the same port and DB, and direct SQLite queries."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CollectorProcess:
    """`python -m vramwatch.cli serve` as a child process (so it can be killed -9)."""

    def __init__(self, db: Path, port: int | None = None) -> None:
        self.db = Path(db)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> CollectorProcess:
        env = dict(os.environ, VRAMWATCH_TOKEN="")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vramwatch.cli", "serve", "--port", str(self.port), "--db", str(self.db),
             "--log-level", "warning"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"collector exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("collector did not come up")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()


def stored(db: Path | str, run: str) -> list[tuple[int, int, str, str]]:
    """(rank, step, phase, incarnation) of every stored sample of ``run`` recorded by ``step()`` or
    ``phase()``, sorted (without the copy a clean ``close()`` sends marked ``exit``)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        rows = con.execute(
            "SELECT se.rank, s.step, p.name, se.incarnation FROM samples s "
            "JOIN series se ON s.series = se.id JOIN phases p ON s.phase = p.id WHERE se.run = ? "
            "AND NOT (s.seq > 0 AND s.exited) ORDER BY se.rank, s.step, p.name", (run,)).fetchall()
    finally:
        con.close()
    return [tuple(r) for r in rows]
