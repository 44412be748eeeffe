"""Real processes and a faulty network path, shared by the tests and the benchmarks (which
import this module from ``tests/``): :class:`CollectorProcess` (``vramwatch serve`` as a child
process: kill -9 is a real kill), :class:`FaultRelay` (a TCP relay that delays, black-holes or
refuses on command), and the counts and percentiles they report with."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class CollectorProcess:
    """``vramwatch serve`` as a child process: start, SIGKILL, SIGTERM, restart on the same port.

    Used by the fault and ingest tests and by the benchmarks (a real process, so kill -9 is real).
    """

    def __init__(self, db: str | os.PathLike[str], *, port: int = 0, token: str | None = None,
                 args: tuple[str, ...] = (), log_path: str | os.PathLike[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.db = str(db)
        self.port = port
        self.token = token
        self.args = tuple(args)
        self.log_path = Path(log_path) if log_path else Path(self.db).with_suffix(".collector.log")
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> CollectorProcess:
        env = dict(os.environ if self.env is None else self.env)
        env.pop("VRAMWATCH_TOKEN", None)
        if self.token:
            env["VRAMWATCH_TOKEN"] = self.token
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it
        cmd = [sys.executable, "-m", "vramwatch", "serve", "--db", self.db, "--port", str(self.port),
               "--log-level", "info", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, cwd=str(REPO))
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log())
            if match and "Application startup complete" in self.log():
                self.port = int(match.group(1))
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"collector exited with {self.proc.returncode}:\n{self.log()[-2000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"collector did not start:\n{self.log()[-2000:]}")
            time.sleep(0.05)
        return self

    def log(self) -> str:
        """What this incarnation wrote to stdout/stderr so far."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(self._log_offset)
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs (power-cut for the process)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait: the clean shutdown path. Returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def rss_bytes(self) -> int:
        return proc_rss(self.pid)

    def cpu_seconds(self) -> float:
        return proc_cpu(self.pid)

    def __enter__(self) -> CollectorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate(15)
            except subprocess.TimeoutExpired:
                pass


def proc_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class FaultRelay:
    """A TCP relay between the hooks and the collector that can misbehave on command:

    ``forward`` (pass through), ``delay`` (hold each response for ``delay_s``), ``blackhole``
    (accept, read, never answer: packets dropped by a partition) and ``refuse`` (close
    every connection at once: the collector's port is closed).
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.mode = "forward"
        self.delay_s = 0.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, mode: str, delay_s: float = 0.0) -> None:
        self.mode, self.delay_s = mode, delay_s
        if mode == "refuse":  # open keep-alive connections are cut too (blackhole: pumps swallow)
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            self._sockets.clear()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.mode == "refuse":
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                client.close()  # RST: as if nothing listened
                continue
            self._sockets.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30)
        except OSError:
            client.close()
            return
        self._sockets.append(upstream)

        def pump(src: socket.socket, dst: socket.socket, responses: bool) -> None:
            try:
                while True:
                    data = src.recv(65536)
                    if not data:
                        break
                    if self.mode == "blackhole":
                        continue  # swallowed: no answer ever comes
                    if responses and self.mode == "delay":
                        time.sleep(self.delay_s)
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.close()

        threading.Thread(target=pump, args=(upstream, client, True), daemon=True).start()
        pump(client, upstream, False)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.close()


def stored_samples(db: str, run: str | None = None) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
        if run is None:
            return conn.execute("SELECT count(*) FROM samples").fetchone()[0]
        return conn.execute(
            "SELECT count(*) FROM samples WHERE series IN (SELECT id FROM series WHERE run = ?)", (run,)
        ).fetchone()[0]


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, /proc/stat)."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]
