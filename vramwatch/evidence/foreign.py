"""Hook side of "who holds the memory": the other processes on this rank's GPU, by name.

A sample is flat (one number per field, :data:`vramwatch.wire.FIELD_TABLE`); a list of
processes is not, so it travels on a side channel: a small JSON report, ``POST
/api/v1/processes``, sent when the list changes (a process came or went, or one's memory
moved by more than :data:`MOVED_BYTES` / :data:`MOVED_FRACTION`) and every ``refresh_s``
while any is listed, so the collector knows it is current. The sample's own
``foreign_used_bytes`` stays the number the alert fires on; the report names it.

Threads and costs: the NVML poller names the processes (:mod:`vramwatch.probe.processes`,
cached ``/proc`` reads); :class:`ForeignReporter` runs on its own daemon thread, wakes every
``interval_s`` (default 5 s), compares, and POSTs at most one report (≤ 16 processes, ~10 KB).
The training thread never sees it. Every failure is counted and warned about once.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vramwatch.probe.processes import ForeignProcess
from vramwatch.units import gib

MOVED_BYTES = 64 * 2**20
MOVED_FRACTION = 0.05
MAX_REPLY_BYTES = 16 * 1024


@dataclass(frozen=True)
class ProcessReport:
    """What a rank says about the other processes on its GPU (the side channel's body)."""

    run: str
    host: str
    rank: int
    ts: float
    #: the GPU as the host numbers it (NVML's index, what nvidia-smi shows), None for a MIG slice
    gpu: int | None
    uuid: str | None
    processes: tuple[ForeignProcess, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "host": self.host, "rank": self.rank, "ts": self.ts, "gpu": self.gpu,
                "uuid": self.uuid, "processes": [{k: v for k, v in p.to_dict().items() if k != "description"}
                                                 for p in self.processes]}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ProcessReport:
        return cls(str(doc["run"]), str(doc["host"]), int(doc["rank"]), float(doc["ts"]),
                   None if doc.get("gpu") is None else int(doc["gpu"]), doc.get("uuid"),
                   tuple(ForeignProcess.from_dict(p) for p in doc.get("processes", ())))

    def device(self) -> str:
        """``GPU 3`` (the host's numbering), else the device's UUID."""
        return f"GPU {self.gpu}" if self.gpu is not None else (self.uuid or "this GPU")


def holds(process: ForeignProcess, device: str) -> str:
    """The one sentence: ``a Jupyter kernel (pid 4242, ipykernel_launcher) holds 38.0 GiB on GPU 3``."""
    amount = gib(process.used_bytes, 1, none="memory")
    return f"{process.describe()} holds {amount} on {device}"


def _moved(a: int | None, b: int | None) -> bool:
    if a is None or b is None:
        return a != b
    return abs(a - b) > max(MOVED_BYTES, MOVED_FRACTION * max(a, b))


def changed(before: tuple[ForeignProcess, ...], now: tuple[ForeignProcess, ...]) -> bool:
    """A process came or went (or its PID was reused), or one's memory moved noticeably."""
    old = {p.pid: p for p in before}
    if old.keys() != {p.pid for p in now}:
        return True
    return any(old[p.pid].cmdline != p.cmdline or _moved(old[p.pid].used_bytes, p.used_bytes) for p in now)


class ForeignReporter:
    """Reports the NVML poller's named foreign processes to the collector (see module docstring)."""

    def __init__(self, url: str, latest: Callable[[], Any], *, run: str, host: str, rank: int, gpu: int | None,
                 uuid: str | None, token: str | None = None, interval_s: float = 5.0, refresh_s: float = 60.0,
                 timeout_s: float = 10.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"url: not an http(s) URL: {url!r}")
        self._parsed, self.token, self.timeout_s = parsed, token, timeout_s
        self._latest = latest
        self.identity = (run, host, rank, gpu, uuid)
        self.interval_s, self.refresh_s = interval_s, refresh_s
        self._sent: tuple[ForeignProcess, ...] | None = None
        self._sent_at = float("-inf")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()
        self.counts = {"reports": 0, "failed": 0}

    def start(self) -> ForeignReporter:
        self._thread = threading.Thread(target=self._run, name="vramwatch-foreign", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll_once()

    def poll_once(self, now: float | None = None) -> bool:
        """Send a report if one is due; True when one was sent. Never raises."""
        now = time.time() if now is None else now
        try:
            reading = self._latest()
            if reading is None:
                return False  # NVML unavailable or stale: nothing known, nothing said
            procs = tuple(reading.foreign)
            due = (self._sent is None and procs) or (self._sent is not None and changed(self._sent, procs)) \
                or (procs and now - self._sent_at >= self.refresh_s)
            if not due:
                return False
            run, host, rank, gpu, uuid = self.identity
            self._post(ProcessReport(run, host, rank, now, gpu, uuid, procs))
            self._sent, self._sent_at = procs, now
            self.counts["reports"] += 1
            return True
        except Exception as exc:
            self.counts["failed"] += 1
            if type(exc).__name__ not in self._warned:
                self._warned.add(type(exc).__name__)
                warnings.warn(f"vramwatch: reporting the other processes on this GPU failed "
                              f"({type(exc).__name__}: {exc}); training goes on", RuntimeWarning, stacklevel=2)
            return False

    def _post(self, report: ProcessReport) -> None:
        body = json.dumps(report.to_dict()).encode()
        cls = http.client.HTTPSConnection if self._parsed.scheme == "https" else http.client.HTTPConnection
        conn = cls(self._parsed.hostname, self._parsed.port, timeout=self.timeout_s)
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            conn.request("POST", self._parsed.path.rstrip("/") + "/api/v1/processes", body=body, headers=headers)
            reply = conn.getresponse()
            detail = reply.read(MAX_REPLY_BYTES)
            if reply.status != 200:
                raise OSError(f"HTTP {reply.status}: {detail[:200]!r}")
        finally:
            conn.close()

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(min(timeout, 1.0))

    def stats(self) -> dict[str, int]:
        return dict(self.counts)


def attach_foreign(monitor: Any) -> ForeignReporter | None:
    """Start a reporter for a started Monitor whose probe polls NVML and that sends to a
    collector; None otherwise. Never raises."""
    try:
        probe, config = monitor.probe, monitor.config
        poller, device = getattr(probe, "poller", None), getattr(probe, "nvml_device", None)
        if not config.url or poller is None or device is None:
            return None
        ident = monitor.identity
        reporter = ForeignReporter(config.url, lambda: poller.latest, run=ident["run"], host=ident["host"],
                                   rank=ident["rank"], gpu=getattr(device, "index", None),
                                   uuid=getattr(device, "uuid", None), token=config.token)
        monitor.add_close_hook(reporter.close)
        return reporter.start()
    except Exception as exc:
        warnings.warn(f"vramwatch: naming the other processes on this GPU is off ({type(exc).__name__}: {exc})",
                      RuntimeWarning, stacklevel=2)
        return None


__all__ = ["ForeignReporter", "ProcessReport", "attach_foreign", "changed", "holds"]
