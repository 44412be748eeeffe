"""Hook side of snapshots: act on the collector's capture directives and on an OOM.

Threads and costs
-----------------
* The delivery worker hands directives in with :meth:`CaptureAgent.offer` (a deque append).
* The training thread calls :meth:`CaptureAgent.on_step` every step. Idle, that is two
  attribute reads. With a directive waiting it starts allocator history (one torch call);
  ``steps`` steps later it takes ``torch.cuda.memory._snapshot()`` (~0.2 ms without traces,
  more with history: bounded by ``max_entries``) and stops recording.
* Pickling, gzip and the upload run on the agent's own daemon thread; the upload queue holds
  at most :data:`MAX_QUEUED` snapshots (later ones are dropped and counted).
* On an OOM, torch calls :meth:`on_oom` on the training thread just before it raises: the
  agent takes a snapshot and queues it; :meth:`flush` (run at exit by the monitor) gives
  the upload a bounded time to finish before the process goes.

Nothing here raises into training: every failure is counted in :meth:`stats` and warned once.
"""

from __future__ import annotations

import gzip
import http.client
import pickle
import threading
import time
import urllib.parse
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any

from vramwatch.evidence.allocator_history import AllocatorHistory

MAX_QUEUED = 2
#: the reply to an upload is a small JSON record; never read more
MAX_REPLY_BYTES = 64 * 1024
MAX_STEPS = 1000
#: seconds the agent keeps between two snapshots taken for directives (a later directive waits
#: in the inbox, which holds 8: a collector that hands out one with every reply gets one
#: snapshot per interval), and between two OOM snapshots (one too soon is not taken: an OOM
#: caught and retried in a loop): a snapshot stalls the training thread and costs an upload
MIN_INTERVAL_S = 5.0


@dataclass(frozen=True)
class CaptureJob:
    step: int
    trigger: str
    directive: str | None
    snapshot: dict[str, Any]


@dataclass
class _Active:
    directive: str | None
    trigger: str
    until_step: int  # the step at which the snapshot is taken


class SnapshotUploader:
    """POSTs gzip-compressed snapshot pickles to ``{url}/api/v1/snapshots``."""

    def __init__(self, url: str, *, run: str, host: str, rank: int, token: str | None = None,
                 timeout_s: float = 30.0, max_bytes: int = 64 * 2**20) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"url: not an http(s) URL: {url!r}")
        self._parsed = parsed
        self.identity = {"run": run, "host": host, "rank": str(rank)}
        self.token = token
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes

    def encode(self, snapshot: dict[str, Any]) -> bytes:
        """gzip(pickle); past ``max_bytes`` the history is dropped (segments alone are small)."""
        gz = gzip.compress(pickle.dumps(snapshot, protocol=4), compresslevel=1)
        if len(gz) > self.max_bytes and snapshot.get("device_traces"):
            gz = gzip.compress(pickle.dumps({**snapshot, "device_traces": []}, protocol=4), compresslevel=1)
        if len(gz) > self.max_bytes:
            raise ValueError(f"snapshot: {len(gz)} bytes compressed, over the {self.max_bytes} cap")
        return gz

    def upload(self, job: CaptureJob) -> None:
        body = self.encode(job.snapshot)
        query = {**self.identity, "step": str(job.step), "trigger": job.trigger}
        if job.directive:
            query["directive"] = job.directive
        cls = http.client.HTTPSConnection if self._parsed.scheme == "https" else http.client.HTTPConnection
        conn = cls(self._parsed.hostname, self._parsed.port, timeout=self.timeout_s)
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(body))}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        path = self._parsed.path.rstrip("/") + "/api/v1/snapshots?" + urllib.parse.urlencode(query)
        try:
            conn.request("POST", path, body=body, headers=headers)
            reply = conn.getresponse()
            detail = reply.read(MAX_REPLY_BYTES)
            if reply.status != 201:
                raise OSError(f"HTTP {reply.status}: {detail[:200]!r}")
        finally:
            conn.close()


class CaptureAgent:
    """Runs captures the collector asks for, and the OOM snapshot. See the module docstring."""

    def __init__(self, history: AllocatorHistory, uploader: SnapshotUploader | None, *,
                 min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.history = history
        self.uploader = uploader
        self.min_interval_s = min_interval_s
        #: monotonic time of the latest snapshot taken for a directive, and on an OOM (apart: an
        #: OOM right after a requested capture is still the process's last word)
        self._last = {"directive": -float("inf"), "oom": -float("inf")}
        self._inbox: deque[dict[str, Any]] = deque(maxlen=8)
        self._active: _Active | None = None
        self._jobs: deque[CaptureJob] = deque()
        self._wake = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()
        self.closed = False
        self.counts = {"directives": 0, "captured": 0, "uploaded": 0, "dropped": 0, "failed": 0, "too_soon": 0}

    # ---- delivery worker thread
    def offer(self, directives: list[Any]) -> None:
        """Directives from an ingest reply (dicts, or the delivery's parsed ``Directive(type, args)``);
        other types and malformed entries are ignored."""
        if self.closed:
            return
        for d in directives:
            if not isinstance(d, dict):
                d = {"type": getattr(d, "type", None), **(getattr(d, "args", None) or {})}
            if d.get("type") == "capture":
                self.counts["directives"] += 1
                self._inbox.append(d)

    # ---- training thread
    def on_step(self, step: int) -> None:
        if not self._inbox and self._active is None:
            return
        try:
            self._advance(step)
        except Exception as exc:  # never into training
            self._fail("capture", exc)
            self._active = None

    def _advance(self, step: int) -> None:
        active = self._active
        if active is None:
            if not self._due("directive"):
                return  # waits in the (bounded) inbox until the interval has passed
            d = self._inbox.popleft()
            steps = d.get("steps")
            steps = steps if isinstance(steps, int) and 1 <= steps <= MAX_STEPS else 5
            self.history.start()
            self._active = _Active(d.get("id") if isinstance(d.get("id"), str) else None,
                                   str(d.get("trigger") or "manual")[:64], step + steps)
            return
        if step >= active.until_step:
            self._last["directive"] = time.monotonic()
            snapshot = self.history.snapshot()
            self.history.stop()
            self._active = None
            self._queue(CaptureJob(step, active.trigger, active.directive, snapshot))

    def on_oom(self, device: int, alloc: int, device_allocated: int, device_free: int, step: int = -1) -> None:
        """OOM observer body: snapshot now (the history so far included), upload later."""
        if self.closed or not self._due("oom"):
            return
        try:
            self._last["oom"] = time.monotonic()
            snapshot = self.history.snapshot()
            snapshot.setdefault("vramwatch_oom", {"device": device, "alloc": alloc,
                                                  "device_allocated": device_allocated, "device_free": device_free})
            self._queue(CaptureJob(max(step, 0), "oom", None, snapshot))
        except Exception as exc:
            self._fail("oom snapshot", exc)

    def _due(self, kind: str) -> bool:
        """Whether :attr:`min_interval_s` has passed since the latest snapshot of ``kind`` (an OOM
        snapshot too soon is counted and not taken; a directive waits)."""
        if time.monotonic() - self._last[kind] >= self.min_interval_s:
            return True
        if kind == "oom":
            self.counts["too_soon"] += 1
        return False

    # ---- upload thread
    def _queue(self, job: CaptureJob) -> None:
        self.counts["captured"] += 1
        if self.uploader is None:
            return
        with self._wake:
            if len(self._jobs) >= MAX_QUEUED:
                self.counts["dropped"] += 1
                return
            self._jobs.append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="vramwatch-snapshot", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._jobs:
                    self._busy = False
                    self._wake.notify_all()
                    if not self._wake.wait(timeout=60.0):
                        self._thread = None
                        return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self.uploader.upload(job)  # type: ignore[union-attr]
                self.counts["uploaded"] += 1
            except Exception as exc:
                self._fail("upload", exc)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (bounded) until queued snapshots are uploaded; True when none is left."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._wake.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> bool:
        """Stop reacting (torch keeps OOM observers forever) and give uploads ``timeout`` s."""
        self.closed = True
        self._inbox.clear()
        if self._active is not None:
            try:
                self.history.stop()
            except Exception as exc:
                self._fail("stop", exc)
            self._active = None
        return self.flush(timeout)

    def _fail(self, what: str, exc: BaseException) -> None:
        self.counts["failed"] += 1
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(f"vramwatch: snapshot {what} failed ({type(exc).__name__}: {exc}); training goes on",
                          RuntimeWarning, stacklevel=2)

    def stats(self) -> dict[str, int]:
        return dict(self.counts)


def attach_capture(monitor: Any) -> CaptureAgent | None:
    """Wire a capture agent into a started :class:`~vramwatch.hook.Monitor`, or return None.

    Only with CUDA present (this torch has the history API), a collector URL to upload to,
    and ``Config.snapshots`` on. The agent listens to the sender's directives (worker thread),
    runs on the monitor's step hook (training thread), gets a bounded time at ``close()``, and
    torch's OOM observer takes the snapshot and sends the OOM-marked sample. Never raises.
    """
    config = monitor.config
    try:
        if not (config.snapshots and config.url and AllocatorHistory.supported()):
            return None
        ident = monitor.identity
        agent = CaptureAgent(
            AllocatorHistory(config.device, max_entries=config.snapshot_max_entries),
            SnapshotUploader(config.url, run=ident["run"], host=ident["host"], rank=ident["rank"], token=config.token),
        )
        monitor.sender.add_directive_listener(agent.offer)
        monitor.add_step_hook(agent.on_step)
        monitor.add_close_hook(agent.close)

        def on_oom(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
            # torch calls this on the training thread just before it raises: snapshot first
            # (the allocator state of the failure), then the sample that says so
            if agent.closed:
                return
            agent.on_oom(device, alloc, device_allocated, device_free, step=monitor._last_step)
            monitor.mark_oom()

        AllocatorHistory.attach_oom_observer(on_oom)
        return agent
    except Exception as exc:  # a capture that cannot start never stops training
        warnings.warn(f"vramwatch: snapshot capture is off ({type(exc).__name__}: {exc})", RuntimeWarning,
                      stacklevel=2)
        return None
