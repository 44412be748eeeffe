"""The batch processor (OpenTelemetry's ``BatchProcessor`` seam): the training thread only
appends to a bounded deque; a daemon worker validates, serialises and hands batches to an
:class:`~vramwatch.delivery.exporters.Exporter`.

Guarantees
----------
* ``submit()`` is O(1), takes no lock, never blocks, never raises.
* A request carries at most ``batch_size`` samples and ``max_batch_bytes`` (1 MiB) of NDJSON.
* A batch leaves when ``batch_size`` samples wait, or when the oldest has waited the flush
  interval: ``interval_s``, or the collector's ``flush_interval_s`` hint from its last
  reply when that is longer, and never less than 10x the last POST's latency (an overloaded collector gets
  fewer, larger requests; capped at 10 s).
* Queue overflow (the exporter cannot keep up) -> with a spool, the backlog is parked on
  disk in order; only past ``4 * max_queue`` (worker stuck) are the oldest samples dropped,
  and counted.
* ``force_flush(timeout)`` / ``shutdown(timeout)`` are bounded. At shutdown whatever could
  not be sent goes to the spool (or, with the worker stuck in a request, is spooled from
  the calling thread).
* Fork-safe per instance: in a forked child the copy is inert (no thread, no sending,
  inherited descriptors pointed at /dev/null); the parent is unaffected.
* Every failure is counted in :meth:`stats`; each kind of failure warns once.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from vramwatch import wire
from vramwatch.delivery import lifecycle
from vramwatch.delivery.results import Directive, ExportFailure, ExportOutcome, ExportResult
from vramwatch.delivery.spool import Backoff, Spool, SpoolingExporter

_COUNTERS = ("submitted", "batches_sent", "delivered", "accepted", "duplicates", "rejected", "invalid",
             "dropped_overflow", "dropped_spool_full", "dropped_unsendable", "dropped_in_child", "spooled",
             "replayed", "send_failures", "auth_failures", "redirects", "worker_errors", "directives")
_LATENCY_FACTOR, _LATENCY_CAP_S = 10.0, 10.0
#: uncompressed bytes per request (~2,500 samples of the usual ~400 bytes; 512-sample batches stay
#: far below it unless samples carry many ``extra`` numbers)
MAX_BATCH_BYTES = 1 << 20
_WARNINGS = {
    ExportFailure.AUTH: "the collector refused the token (HTTP {status}); check VRAMWATCH_TOKEN. Samples are kept "
                  "in the spool and retried with backoff",
    ExportFailure.REDIRECT: "the collector URL redirects ({detail}). Samples are kept in the spool and retried "
                      "with backoff, never sent to the redirect target",
    ExportFailure.TOO_LARGE: "the collector answers 413 even for one sample; its request limit is misconfigured. "
                       "Samples are kept in the spool and retried with backoff",
    ExportFailure.REFUSED: "the collector refused samples for good (HTTP {status}: {detail}); they are dropped "
                     "and counted in stats()['rejected']",
    ExportFailure.REPLY_TOO_LARGE: "the collector's reply exceeded the hook's read limit and was not read",
}


class BatchProcessor:
    """Bounded queue + daemon worker shipping samples to one exporter."""

    def __init__(self, exporter: Any, *, batch_size: int = 512, interval_s: float = 1.0, max_queue: int = 8192,
                 validate: bool = True, worker: SharedWorker | None = None,
                 max_batch_bytes: int = MAX_BATCH_BYTES) -> None:
        self.exporter = exporter
        self.batch_size = max(1, int(batch_size))
        self.max_batch_bytes = max(1, int(max_batch_bytes))
        self.interval_s = max(0.01, float(interval_s))
        self.max_queue = max(self.batch_size, int(max_queue))
        self._hard_cap = 4 * self.max_queue
        self._validate = validate
        self._queue: deque[dict[str, Any]] = deque()
        self._worker = worker
        self._wake = worker.wake if worker is not None else threading.Event()
        self._cond = threading.Condition()
        self._flush_requested = self._flush_done = 0
        self._stopping = self._closed = self._child = False
        self._close_deadline: float | None = None
        self._inflight: list[bytes] = []
        self._hint_s: float | None = None
        self._latency_s = 0.0
        self._pid = os.getpid()
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self.last_error: str | None = None
        self.directives: deque[Directive] = deque(maxlen=32)  # received, for the features that act on them
        self._directive_listeners: tuple[Callable[[tuple[Directive, ...]], None], ...] = ()
        self._warned: set[str] = set()
        self._unreachable = False  # the latest export could not reach the collector (warned once per outage)
        self._due = time.monotonic() + random.uniform(0.0, self.interval_s)  # next timed cycle (shared worker)
        lifecycle.register(self)
        lifecycle.on_fork_in_child(self, "_after_fork_in_child")
        self._thread: threading.Thread | None = None
        if worker is not None:
            worker.add(self)
        else:
            self._thread = threading.Thread(target=self._run, name="vramwatch-sender", daemon=True)
            self._thread.start()

    @property
    def spool(self) -> Spool | None:
        return self.exporter.spool if isinstance(self.exporter, SpoolingExporter) else None

    # ---------------------------------------------------------- training thread

    def submit(self, sample: dict[str, Any]) -> None:
        """Queue one sample. O(1), never blocks, never raises."""
        if self._closed:
            if self._child:
                self.counters["dropped_in_child"] += 1
            return
        queue = self._queue
        queue.append(sample)
        n = len(queue)
        if n >= self.batch_size:
            if not self._wake.is_set():
                self._wake.set()
            if n > self._hard_cap:  # the worker is stuck; keep memory bounded
                try:
                    queue.popleft()
                    self.counters["dropped_overflow"] += 1
                except IndexError:
                    pass

    emit = submit  # OpenTelemetry's name


    def add_directive_listener(self, listener: Callable[[tuple[Directive, ...]], None]) -> None:
        """Call ``listener(directives)`` on the worker thread whenever a reply carries directives
        (e.g. the snapshot capture agent). It must be quick and must not raise (errors are counted)."""
        self._directive_listeners += (listener,)

    def force_flush(self, timeout: float = 5.0) -> bool:
        """Wait (at most ``timeout`` s) until everything queued so far was handled.

        True when all of it reached the exporter (nothing left in the spool).
        """
        if self._closed or not self._worker_alive():
            return self._idle()
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self._cond:
                self._flush_requested += 1
                target = self._flush_requested
            self._wake.set()
            with self._cond:
                while self._flush_done < target:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
            if self._idle():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # the collector failed this round: try again after the backoff, within the deadline
            backoff = self.exporter.backoff.retry_at - time.monotonic() if self.spool is not None else 0.0
            time.sleep(max(0.005, min(backoff, left)))

    flush = force_flush

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Send what can be sent within ``timeout`` s, spool the rest, stop the worker."""
        if self._closed:
            return self._child or self._idle()
        self._closed = True
        deadline = time.monotonic() + max(0.0, timeout)
        self._close_deadline = deadline
        with self._cond:
            self._stopping = True
            self._flush_requested += 1
            target = self._flush_requested
        self._wake.set()
        finished = self._wait_done(target, deadline)
        if not finished:
            self._emergency_spool()  # stuck in a request: a later duplicate is harmless (idempotent ingest)
        else:
            self.exporter.shutdown()
        if self._worker is not None:
            self._worker.remove(self)
        lifecycle.unregister(self)
        return self._idle()

    def _wait_done(self, target: int, deadline: float) -> bool:
        """Wait for the final cycle (our own thread's exit, or the shared worker's pass)."""
        if self._thread is not None:
            if self._thread is not threading.current_thread():
                self._thread.join(max(0.0, deadline - time.monotonic()))
            return not self._thread.is_alive()
        with self._cond:
            while self._flush_done < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._worker_alive():
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def _worker_alive(self) -> bool:
        if self._thread is not None:
            return self._thread.is_alive()
        return self._worker is not None and self._worker.alive()

    close = shutdown

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        spool = self.spool
        out["queued"] = len(self._queue)
        out["spool_pending_bytes"] = spool.pending_bytes() if spool is not None else 0
        out["spool_path"] = str(spool.path) if spool is not None else None
        out["backoff_s"] = round(self.exporter.backoff.delay_s, 3) if spool is not None else 0.0
        out["flush_interval_s"] = round(self._interval(), 3)
        out["last_error"] = self.last_error
        out["destination"] = self.exporter.describe()
        return out

    def _idle(self) -> bool:
        spool = self.spool
        return not self._queue and not self._inflight and (spool is None or not spool.pending())

    def _interval(self) -> float:
        # the hint only lengthens: a collector asks a fleet for fewer requests, it never makes a
        # rank configured for 5 s flush every second
        base = self.interval_s if self._hint_s is None else max(self.interval_s, self._hint_s)
        return max(base, min(_LATENCY_CAP_S, _LATENCY_FACTOR * self._latency_s))

    # ---------------------------------------------------------- worker thread

    def _run(self) -> None:
        # ranks started together would POST in lockstep every interval: spread the first tick
        # (a flush or a full batch still wakes the worker at once)
        timeout = random.uniform(0.0, self.interval_s)
        while True:
            self._wake.wait(timeout)
            self._wake.clear()
            if self._service():
                return
            timeout = self._interval()

    def _service(self) -> bool:
        """One worker pass: a cycle, then the flush handshake. True when this processor is done."""
        with self._cond:
            target = self._flush_requested
            stopping = self._stopping
        if self._child:
            return True
        try:
            self._cycle(force=target > self._flush_done)
        except Exception as exc:  # a bug here must not kill delivery for the rest of the run
            self.counters["worker_errors"] += 1
            self.last_error = f"worker: {type(exc).__name__}: {exc}"
        with self._cond:
            self._flush_done = max(self._flush_done, target)
            self._cond.notify_all()
        self._due = time.monotonic() + self._interval()
        return stopping

    def _wanted(self, now: float) -> bool:
        """For a shared worker: is a pass due (time, a full batch, a flush or a shutdown)?"""
        return (now >= self._due or len(self._queue) >= self.batch_size or self._stopping
                or self._flush_requested > self._flush_done)

    def _take(self) -> list[bytes]:
        queue = self._queue
        lines: list[bytes] = []
        dumps = orjson.dumps
        while True:
            try:
                sample = queue.popleft()
            except IndexError:
                break
            if self._validate:
                try:
                    sample = wire.validate(sample)
                except wire.WireError as exc:
                    self.counters["invalid"] += 1
                    self.last_error = f"invalid sample dropped: {exc}"
                    continue
            lines.append(dumps(sample) + b"\n")
        self.counters["submitted"] += len(lines)
        return lines

    def _cycle(self, *, force: bool) -> None:
        lines = self._take()
        if not lines and not (self.spool is not None and self.spool.pending()):
            return
        spooling = self.spool is not None
        for start, end in self._batches(lines):
            batch = lines[start:end]
            self._inflight = lines[start:]
            t0 = time.monotonic()
            if spooling:
                result = self.exporter.export(batch, force=force, deadline=self._close_deadline)
            else:
                result = self.exporter.export(batch, self._timeout())
            if result.posts:
                self._latency_s = (time.monotonic() - t0) / result.posts
            self._account(result)
            if result.outcome is ExportOutcome.RETRY:
                if spooling:  # the rest goes behind the failed batch, in order
                    self._account(self.exporter.park(lines[end:]))
                else:
                    self.counters["dropped_unsendable"] += len(lines) - start
                break
            if spooling and len(self._queue) > self.max_queue:
                # training outpaces the collector: park the backlog on disk, in order
                self._account(self.exporter.park(lines[end:] + self._take()))
                break
        self._inflight = []

    def _batches(self, lines: list[bytes]) -> list[tuple[int, int]]:
        """(start, end) of each request: at most ``batch_size`` samples and ``max_batch_bytes``
        (uncompressed; a sample larger than that goes alone), so no request meets the collector's
        size limit by accident. One empty batch when ``lines`` is empty (the spool may drain)."""
        if not lines:
            return [(0, 0)]
        out, start, size = [], 0, 0
        limit, count = self.max_batch_bytes, self.batch_size
        for i, line in enumerate(lines):
            if i > start and (i - start >= count or size + len(line) > limit):
                out.append((start, i))
                start, size = i, 0
            size += len(line)
        out.append((start, len(lines)))
        return out

    def _timeout(self) -> float | None:
        deadline = self._close_deadline
        return None if deadline is None else max(0.05, deadline - time.monotonic())

    def _account(self, result: ExportResult) -> None:
        c = self.counters
        c["batches_sent"] += result.posts - result.failures
        c["delivered"] += result.delivered
        c["accepted"] += result.accepted
        c["duplicates"] += result.duplicates
        c["rejected"] += result.rejected
        c["replayed"] += result.replayed
        c["spooled"] += result.spooled
        c["send_failures"] += result.failures if result.outcome is ExportOutcome.RETRY else 0
        if result.failure is ExportFailure.AUTH:
            c["auth_failures"] += result.failures
        if result.failure is ExportFailure.REDIRECT:
            c["redirects"] += result.failures
        if result.flush_interval_s is not None:
            self._hint_s = result.flush_interval_s
        if result.directives:
            c["directives"] += len(result.directives)
            self.directives.extend(result.directives)  # parsed; acted on by the features that know them
            for listener in self._directive_listeners:
                try:
                    listener(result.directives)
                except Exception as exc:
                    c["worker_errors"] += 1
                    self.last_error = f"directive listener: {type(exc).__name__}: {exc}"
        self._note_reachability(result)
        if result.failure is not None:
            self.last_error = result.describe()
            template = _WARNINGS.get(result.failure)
            if template is not None:
                self._warn(result.failure.value, template.format(status=result.status, detail=result.detail))
        if result.spool_dropped:
            c["dropped_spool_full"] += result.spool_dropped
            spool = self.spool
            reason = (spool.write_error if spool is not None else None) or "spool full"
            self.last_error = f"{reason}: {result.spool_dropped} samples dropped"
            self._warn("spool", f"{reason} at {spool.path if spool else '?'}: samples are being dropped; training "
                                "goes on (counted in stats()['dropped_spool_full'])")

    def _note_reachability(self, result: ExportResult) -> None:
        """One warning when the collector cannot be reached (refused, DNS, timeout), naming the URL
        and where the samples go; one line when it answers again. Never one per step or per retry:
        the state changes at most twice per outage."""
        if result.failure is ExportFailure.NETWORK:
            if not self._unreachable:
                self._unreachable = True
                self._say(f"cannot reach the collector at {self.exporter.describe()} ({result.detail}); "
                          f"{self._where_samples_go()}. Training goes on; this is said once until it answers")
        elif self._unreachable and result.outcome is not ExportOutcome.RETRY:
            self._unreachable = False
            self._say(f"the collector at {self.exporter.describe()} answers again; spooled samples are being sent")

    def _where_samples_go(self) -> str:
        spool = self.spool
        if spool is None:
            return f"samples wait in memory (at most {self.max_queue:,}; older ones are dropped past it)"
        return (f"samples go to the spool {spool.path} (at most {spool.max_bytes / 2**20:,.0f} MiB) and are "
                "retried with backoff")

    def _say(self, message: str) -> None:
        with contextlib.suppress(Exception):  # warnings configured as errors must not stop delivery
            warnings.warn(f"vramwatch: {message}", RuntimeWarning, stacklevel=2)

    def _warn(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        with contextlib.suppress(Exception):  # warnings configured as errors must not stop delivery
            warnings.warn(f"vramwatch: {message}", RuntimeWarning, stacklevel=2)

    def _emergency_spool(self) -> None:
        spool = self.spool
        pending = len(self._queue) + len(self._inflight)
        if spool is None or not spool.lock.acquire(timeout=0.5):
            self.counters["dropped_overflow"] += pending
            return
        try:
            lines = list(self._inflight)
            while self._queue:
                lines.append(orjson.dumps(self._queue.popleft()) + b"\n")
            dropped = spool.append(lines)
            self.counters["spooled"] += len(lines) - dropped
            self.counters["dropped_spool_full"] += dropped
        except Exception as exc:
            self.last_error = f"emergency spool: {exc}"
        finally:
            spool.lock.release()

    # ---------------------------------------------------------- fork

    def _after_fork_in_child(self) -> None:
        self._child = self._closed = True
        self._queue = deque()
        self._inflight = []
        self._wake = threading.Event()
        self._cond = threading.Condition()
        _neutralize(self.exporter.after_fork_in_child())


def _neutralize(fds: Sequence[int | None]) -> None:
    """Point inherited descriptors at /dev/null in this (child) process only."""
    targets = [fd for fd in fds if fd is not None]
    if not targets:
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        for fd in targets:
            with contextlib.suppress(OSError):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


class SharedWorker:
    """One thread that drives many processors (a load generator simulating hundreds of ranks
    in one process). Each processor keeps its own queue, exporter, spool and flush interval;
    only the thread is shared. A real rank (one process) needs none: each processor owns its
    thread by default."""

    def __init__(self, name: str = "vramwatch-sender-shared") -> None:
        self.wake = threading.Event()
        self._members: list[BatchProcessor] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, processor: BatchProcessor) -> None:
        with self._lock:
            self._members.append(processor)
        self.wake.set()

    def remove(self, processor: BatchProcessor) -> None:
        with self._lock:
            if processor in self._members:
                self._members.remove(processor)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._lock:
                members = list(self._members)
            now = time.monotonic()
            nearest = now + 1.0
            for processor in members:
                if processor._wanted(now):
                    if processor._service():
                        self.remove(processor)
                    now = time.monotonic()
                nearest = min(nearest, processor._due)
            self.wake.wait(max(0.0, nearest - time.monotonic()))
            self.wake.clear()


class BatchSender(BatchProcessor):
    """The processor with the hook's usual exporter stack: ``transport`` (HTTP or file), wrapped in
    a :class:`SpoolingExporter` when ``spool_path`` is given. (The name predates the processor.)"""

    def __init__(self, transport: Any, *, batch_size: int = 512, interval_s: float = 1.0, max_queue: int = 8192,
                 spool_path: str | os.PathLike[str] | None = None,
                 adopt_spools: Sequence[str | os.PathLike[str]] = (), max_spool_bytes: int = 512 * 1024 * 1024,
                 backoff_initial_s: float = 0.5, backoff_max_s: float = 30.0, validate: bool = True,
                 worker: SharedWorker | None = None) -> None:
        exporter = transport
        discarded = 0
        if spool_path is not None:
            spool = Spool(Path(spool_path), max_bytes=max_spool_bytes,
                          adopt=[Path(p) for p in adopt_spools if Path(p) != Path(spool_path)])
            discarded = spool.discarded_lines
            exporter = SpoolingExporter(transport, spool, Backoff(backoff_initial_s, backoff_max_s))
        super().__init__(exporter, batch_size=batch_size, interval_s=interval_s, max_queue=max_queue,
                         validate=validate, worker=worker)
        if discarded:
            self.counters["dropped_spool_full"] += discarded
            self.last_error = f"older spool files over the cap ({max_spool_bytes} bytes): {discarded} samples dropped"
        self.transport = transport


__all__ = ["BatchProcessor", "BatchSender", "SharedWorker"]
