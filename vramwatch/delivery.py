"""Delivery of samples from the training process, in the spirit of OpenTelemetry's
BatchProcessor: the training thread only appends to a bounded deque; a daemon worker
batches (by size or every ``interval_s``), validates and ships them.

Guarantees
----------
* ``submit()`` is O(1), takes no lock in the common case, never blocks, never raises.
* HTTP: gzipped NDJSON ``POST {url}/api/v1/samples`` with stdlib ``http.client``
  (keep-alive), ``Authorization: Bearer $VRAMWATCH_TOKEN`` when a token is set.
* Transient failures (connection refused/reset, timeouts, 5xx, 408, 429, 401/403) → the
  batch goes to a local **spool** file (JSON Lines) and sending pauses with capped
  exponential backoff and full jitter. While the spool holds anything, new samples are
  appended behind it, so replay is strictly oldest-first; when the collector answers
  again the spool drains in order and is truncated. The collector's ingest is idempotent
  (run, rank, incarnation, step, phase), so at-least-once here is exactly-once in the
  store, also across a collector restart.
* Queue overflow (the worker cannot keep up) → the worker moves the backlog to the spool;
  only past ``4 * max_queue`` (worker stuck) are the oldest samples dropped, and counted.
* 422 (invalid samples) → those samples are dropped and counted, the rest resent once;
  other 4xx → the batch is dropped and counted: never retried forever. 413 → split.
* ``flush(timeout)`` / ``close(timeout)`` are bounded. At ``close`` whatever could not be
  sent goes to the spool, where the next process of the same run and rank (or
  ``vramwatch import``) picks it up: leftover spool files of earlier incarnations are
  adopted and replayed first.
* Fork-safe: after ``fork()`` the child's copy is inert (no thread, no sending, inherited
  file descriptors pointed at /dev/null so a stray flush cannot corrupt the parent's
  files); the parent is unaffected. DataLoader workers fork.
* Every failure is counted in :meth:`BatchSender.stats`; none is raised.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import gzip
import http.client
import os
import random
import socket
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from vramwatch import wire

INGEST_PATH = "/api/v1/samples"
_RETRY_STATUSES = frozenset({401, 403, 408, 425, 429, 500, 502, 503, 504})


class SendError(Exception):
    """A transport failure worth retrying later (network, timeout, 5xx ...)."""


class Rejected(Exception):
    """The collector refused samples for good (4xx other than retryable ones)."""

    def __init__(self, status: int, detail: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.errors = errors or []


# ------------------------------------------------------------------ transports


class HttpTransport:
    """POST gzipped NDJSON to the collector with the standard library only."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 5.0,
                 compresslevel: int = 5) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise ValueError(f"url: must be http(s)://host[:port][/prefix], got {url!r}")
        self.url = url
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = port
        base = parts.path.rstrip("/")
        self.path = base if base.endswith(INGEST_PATH) else base + INGEST_PATH
        self.timeout_s = timeout_s
        self.compresslevel = compresslevel
        self.headers = {
            "Content-Type": "application/x-ndjson",
            "Content-Encoding": "gzip",
            "User-Agent": "vramwatch-hook",
        }
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        conn = self._conn
        if conn is None:
            cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            conn = self._conn = cls(self.host, self.port, timeout=timeout)
        else:
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
        if conn.sock is None:
            conn.connect()
            # http.client sends headers and body in two writes: without TCP_NODELAY, Nagle
            # holds the body until the server's delayed ACK (~40 ms on every keep-alive POST)
            with contextlib.suppress(OSError, AttributeError):
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def send(self, body: bytes, count: int, timeout: float | None = None) -> dict[str, Any]:
        """Send one NDJSON body; returns the collector's JSON answer.

        Raises :class:`SendError` (retry later) or :class:`Rejected` (drop).
        """
        payload = gzip.compress(body, compresslevel=self.compresslevel, mtime=0)
        timeout = self.timeout_s if timeout is None else max(0.05, min(timeout, self.timeout_s))
        try:
            conn = self._connection(timeout)
            conn.request("POST", self.path, body=payload, headers=self.headers)
            response = conn.getresponse()
            data = response.read()
            status = response.status
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise SendError(f"{type(exc).__name__}: {exc}") from None
        if response.getheader("connection", "").lower() == "close":
            self.close()
        try:
            answer = orjson.loads(data) if data else {}
        except orjson.JSONDecodeError:
            answer = {"detail": data[:200].decode("utf-8", "replace")}
        if not isinstance(answer, dict):
            answer = {"detail": str(answer)[:200]}
        if 200 <= status < 300:
            return answer
        detail = str(answer.get("detail", ""))[:300]
        if status in _RETRY_STATUSES or status >= 500:
            raise SendError(f"HTTP {status}: {detail}")
        raise Rejected(status, detail, answer.get("errors") if isinstance(answer.get("errors"), list) else None)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    def describe(self) -> str:
        return f"{self.scheme}://{self.host}{':' + str(self.port) if self.port else ''}{self.path}"


class FileTransport:
    """No collector: append the samples to a local JSON Lines trace file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._writer: wire.TraceWriter | None = None

    def send(self, body: bytes, count: int, timeout: float | None = None) -> dict[str, Any]:
        try:
            if self._writer is None:
                self._writer = wire.TraceWriter(self.path)
            self._writer.write([orjson.loads(line) for line in body.splitlines() if line])
            self._writer.flush()  # nothing left buffered for a forked child to duplicate
        except OSError as exc:
            raise SendError(f"{type(exc).__name__}: {exc}") from None
        return {"accepted": count, "duplicates": 0}

    def fileno(self) -> int | None:
        fh = getattr(self._writer, "_fh", None)  # TraceWriter's file: pointed at /dev/null in a forked child
        try:
            return fh.fileno() if fh is not None else None
        except (OSError, ValueError, AttributeError):
            return None

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError:
                pass

    def describe(self) -> str:
        return str(self.path)


# ------------------------------------------------------------------ spool


class Spool:
    """An append-only JSON Lines file of samples not yet delivered, replayed oldest-first.

    Only the worker thread (or ``close`` after the worker stopped or timed out, under
    ``lock``) touches it. Writes are unbuffered (no data sits in a Python buffer that a
    forked child could flush a second time).
    """

    def __init__(self, path: Path, *, max_bytes: int, adopt: Sequence[Path] = ()) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self._fh: Any = None
        self._offset = 0  # bytes of our own file already delivered
        self._size = 0
        self._adopted: list[tuple[Path, Any, int]] = []  # (path, locked fd file, offset)
        self.write_error: str | None = None  # set when the disk refused a write
        for other in adopt:
            self._adopt(other)

    def _adopt(self, path: Path) -> None:
        try:
            fh = open(path, "r+b", buffering=0)  # noqa: SIM115 - kept open to hold the lock
        except OSError:
            return
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # its owner may still be alive
        except OSError:
            fh.close()
            return
        self._adopted.append((path, fh, 0))

    def _open(self) -> Any:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a+b", buffering=0)  # noqa: SIM115
            try:
                fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                pass
            self._size = os.fstat(self._fh.fileno()).st_size
        return self._fh

    def pending_bytes(self) -> int:
        adopted = 0
        for path, _fh, offset in self._adopted:
            try:
                adopted += path.stat().st_size - offset
            except OSError:
                pass
        return self._size - self._offset + adopted

    def pending(self) -> bool:
        return self._size > self._offset or bool(self._adopted)

    def append(self, lines: Sequence[bytes]) -> int:
        """Append whole lines; returns how many did not fit under ``max_bytes`` (dropped)."""
        if not lines:
            return 0
        try:
            fh = self._open()
        except OSError:  # cannot even create the spool file (disk full, read-only): all dropped
            return len(lines)
        room = self.max_bytes - (self._size - self._offset)
        body = b"".join(lines)
        dropped = 0
        if len(body) > room:
            kept, size = [], 0
            for line in lines:
                if size + len(line) > room:
                    break
                kept.append(line)
                size += len(line)
            dropped = len(lines) - len(kept)
            body = b"".join(kept)
        if body:
            written = 0
            try:
                while written < len(body):
                    written += fh.write(body[written:])
            except OSError:
                # the disk is full (ENOSPC, EFBIG): keep the whole lines that made it, cut the
                # torn one so replay never sends half a sample, count the rest as dropped
                whole = body.rfind(b"\n", 0, written) + 1
                try:
                    fh.truncate(self._size + whole)
                except OSError:
                    pass
                self._size += whole
                self.write_error = "no space left for the spool"
                return len(lines) - body[:whole].count(b"\n")
            self._size += len(body)
            self.write_error = None
        return dropped

    def read_batch(self, max_lines: int) -> tuple[list[bytes], Callable[[], None]]:
        """The oldest up to ``max_lines`` lines and a ``commit`` that marks them delivered."""
        while self._adopted:
            path, fh, offset = self._adopted[0]
            lines, end = self._read_lines(fh, offset, max_lines)
            if lines:
                def commit_adopted(end: int = end, path: Path = path, fh: Any = fh) -> None:
                    self._adopted[0] = (path, fh, end)
                return lines, commit_adopted
            self._adopted.pop(0)  # fully replayed
            try:
                path.unlink()
            except OSError:
                pass
            fh.close()
        if self._fh is None or self._size <= self._offset:
            return [], lambda: None
        lines, end = self._read_lines(self._fh, self._offset, max_lines)

        def commit_own(end: int = end) -> None:
            self._offset = end
            if self._offset >= self._size:  # all delivered: start the file afresh
                self._fh.truncate(0)
                self._offset = self._size = 0

        if not lines:  # only an unterminated tail (cannot happen for our own writes): skip it
            self._fh.truncate(0)
            self._offset = self._size = 0
        return lines, commit_own

    @staticmethod
    def _read_lines(fh: Any, offset: int, max_lines: int) -> tuple[list[bytes], int]:
        fh.seek(offset)
        lines: list[bytes] = []
        end = offset
        chunk = b""
        while len(lines) < max_lines:
            block = fh.read(1 << 16)
            if not block:
                break
            chunk += block
            parts = chunk.split(b"\n")
            chunk = parts.pop()  # unterminated remainder
            for part in parts:
                end += len(part) + 1
                if part.strip():
                    lines.append(part + b"\n")
                if len(lines) >= max_lines:
                    return lines, end
        return lines, end

    def fileno(self) -> int | None:
        return self._fh.fileno() if self._fh is not None else None

    def adopted_filenos(self) -> list[int]:
        return [fh.fileno() for _p, fh, _o in self._adopted]

    def close(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            try:
                empty = self._size <= self._offset
                fh.close()
                if empty:
                    self.path.unlink()
            except OSError:
                pass
        for _path, other, _offset in self._adopted:
            other.close()
        self._adopted = []


def default_spool_dir() -> Path:
    configured = os.environ.get("VRAMWATCH_SPOOL_DIR")
    if configured:
        return Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "vramwatch" / "spool"


def spool_prefix(run: str, rank: int) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run)[:96]
    return f"{safe}.rank{rank}."


# ------------------------------------------------------------------ sender


_live_senders: weakref.WeakSet[BatchSender] = weakref.WeakSet()


class BatchSender:
    """Bounded queue + daemon worker shipping samples through a transport (HTTP or file)."""

    def __init__(
        self,
        transport: HttpTransport | FileTransport,
        *,
        batch_size: int = 512,
        interval_s: float = 1.0,
        max_queue: int = 8192,
        spool_path: str | os.PathLike[str] | None = None,
        adopt_spools: Sequence[str | os.PathLike[str]] = (),
        max_spool_bytes: int = 512 * 1024 * 1024,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        validate: bool = True,
    ) -> None:
        self.transport = transport
        self.batch_size = max(1, int(batch_size))
        self.interval_s = max(0.01, float(interval_s))
        self.max_queue = max(self.batch_size, int(max_queue))
        self._hard_cap = 4 * self.max_queue
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = max(backoff_initial_s, backoff_max_s)
        self._validate = validate
        self._queue: deque[dict[str, Any]] = deque()
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self._flush_requested = 0
        self._flush_done = 0
        self._stopping = False
        self._closed = False
        self._inflight: list[bytes] = []
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._child = False
        self._pid = os.getpid()
        self.spool: Spool | None = None
        if spool_path is not None:
            self.spool = Spool(Path(spool_path), max_bytes=max_spool_bytes,
                               adopt=[Path(p) for p in adopt_spools if Path(p) != Path(spool_path)])
        self.counters: dict[str, int] = dict.fromkeys(
            ("submitted", "batches_sent", "delivered", "accepted", "duplicates", "rejected", "invalid",
             "dropped_overflow", "dropped_spool_full", "dropped_unsendable", "dropped_in_child", "spooled",
             "replayed",
             "send_failures", "auth_failures", "worker_errors"), 0)
        self.last_error: str | None = None
        self._warned_drop = False
        _live_senders.add(self)
        self._thread = threading.Thread(target=self._run, name="vramwatch-sender", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------- training thread

    def submit(self, sample: dict[str, Any]) -> None:
        """Queue one sample. O(1), never blocks, never raises."""
        if self._child or self._closed:
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

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait (at most ``timeout`` s) until everything queued so far was handled.

        Returns True when all of it reached the transport (nothing left in the spool).
        """
        if self._child or self._closed or not self._thread.is_alive():
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
            # the collector failed this round: try again after the backoff, within the deadline
            pause = min(self._retry_at - time.monotonic(), deadline - time.monotonic())
            if deadline - time.monotonic() <= 0:
                return False
            time.sleep(max(0.005, pause))

    def close(self, timeout: float = 5.0) -> bool:
        """Send what can be sent within ``timeout`` s, spool the rest, stop the worker."""
        if self._closed:
            return self._idle()
        self._closed = True
        if self._child:
            return True
        deadline = time.monotonic() + max(0.0, timeout)
        self._close_deadline = deadline
        with self._cond:
            self._stopping = True
            self._flush_requested += 1
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            # stuck in a request: put its batch and the queue into the spool (a later
            # duplicate is harmless: ingest is idempotent)
            self._emergency_spool()
        else:
            self.transport.close()
            if self.spool is not None:
                self.spool.close()
        _live_senders.discard(self)
        return self._idle()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out["queued"] = len(self._queue)
        out["spool_pending_bytes"] = self.spool.pending_bytes() if self.spool is not None else 0
        out["spool_path"] = str(self.spool.path) if self.spool is not None else None
        out["backoff_s"] = round(self._backoff_s, 3)
        out["last_error"] = self.last_error
        out["destination"] = self.transport.describe()
        return out

    def _idle(self) -> bool:
        return not self._queue and not self._inflight and (self.spool is None or not self.spool.pending())

    # ---------------------------------------------------------- worker thread

    def _run(self) -> None:
        # ranks started together would POST in lockstep every interval: spread the first tick
        # (a flush() or a full batch still wakes the worker at once)
        timeout = random.uniform(0.0, self.interval_s)
        while True:
            self._wake.wait(timeout)
            timeout = self.interval_s
            self._wake.clear()
            with self._cond:
                target = self._flush_requested
                stopping = self._stopping
            if self._child:
                return
            try:
                self._cycle(force=target > self._flush_done, final=stopping)
            except Exception as exc:  # a bug here must not kill delivery for the rest of the run
                self.counters["worker_errors"] += 1
                self.last_error = f"worker: {type(exc).__name__}: {exc}"
            with self._cond:
                self._flush_done = max(self._flush_done, target)
                self._cond.notify_all()
            if stopping:
                return

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

    def _deadline(self) -> float | None:
        return getattr(self, "_close_deadline", None) if self._stopping else None

    def _to_spool(self, lines: Sequence[bytes]) -> None:
        if not lines:
            return
        if self.spool is None:
            # file transport (or no spool configured): nowhere safer to keep them
            self.counters["dropped_unsendable"] += len(lines)
            return
        with self.spool.lock:
            dropped = self.spool.append(lines)
        self.counters["spooled"] += len(lines) - dropped
        if dropped:
            self.counters["dropped_spool_full"] += dropped
            reason = self.spool.write_error or f"spool full ({self.spool.max_bytes} bytes)"
            self.last_error = f"{reason}: {dropped} samples dropped"
            if not self._warned_drop:  # say so once; the count keeps going in stats()
                self._warned_drop = True
                try:
                    warnings.warn(f"vramwatch: {reason} at {self.spool.path}: samples are being dropped; "
                                  "training goes on (counted in stats()['dropped_spool_full'])",
                                  RuntimeWarning, stacklevel=2)
                except Exception:
                    pass  # warnings configured as errors must not stop delivery

    def _cycle(self, *, force: bool, final: bool) -> None:
        lines = self._take()
        spool = self.spool
        if spool is not None:
            waiting = time.monotonic() < self._retry_at and not force
            if spool.pending() or waiting:
                # keep order: everything new goes behind what is already waiting
                self._to_spool(lines)
                if waiting or not self._drain_spool():
                    return
                lines = self._take()
        self._send_lines(lines)

    def _send_lines(self, lines: list[bytes]) -> None:
        for start in range(0, len(lines), self.batch_size):
            batch = lines[start : start + self.batch_size]
            self._inflight = lines[start:]
            if not self._post(batch):
                self._to_spool(lines[start:])
                self._inflight = []
                return
            if self.spool is not None and len(self._queue) > self.max_queue:
                # the collector is slower than training: park the backlog on disk, in order
                self._to_spool(lines[start + self.batch_size :])
                self._to_spool(self._take())
                self._inflight = []
                return
        self._inflight = []

    def _drain_spool(self) -> bool:
        """Replay the spool oldest-first; True when it is empty."""
        spool = self.spool
        assert spool is not None
        while spool.pending():
            deadline = self._deadline()  # close() may arrive mid-drain
            if deadline is not None and time.monotonic() > deadline:
                return False
            with spool.lock:
                batch, commit = spool.read_batch(self.batch_size)
            if not batch:
                continue
            if not self._post(batch, replay=True):
                return False
            with spool.lock:
                commit()
        return True

    def _post(self, batch: list[bytes], *, replay: bool = False) -> bool:
        """Deliver one batch. True: handled (delivered, or dropped for good); False: retry later."""
        deadline = self._deadline()
        timeout = None if deadline is None else max(0.05, deadline - time.monotonic())
        try:
            answer = self.transport.send(b"".join(batch), len(batch), timeout)
        except SendError as exc:
            self._failed(str(exc))
            return False
        except Rejected as exc:
            return self._rejected(batch, exc, replay)
        except Exception as exc:  # unexpected transport bug: treat as transient
            self._failed(f"{type(exc).__name__}: {exc}")
            return False
        self._delivered(batch, answer, replay)
        return True

    def _delivered(self, batch: list[bytes], answer: dict[str, Any], replay: bool) -> None:
        c = self.counters
        c["batches_sent"] += 1
        c["delivered"] += len(batch)
        c["accepted"] += int(answer.get("accepted", 0) or 0)
        c["duplicates"] += int(answer.get("duplicates", 0) or 0)
        if replay:
            c["replayed"] += len(batch)
        self._backoff_s = 0.0
        self._retry_at = 0.0

    def _failed(self, error: str) -> None:
        self.counters["send_failures"] += 1
        if error.startswith(("HTTP 401", "HTTP 403")):
            self.counters["auth_failures"] += 1
        self.last_error = error
        self._backoff_s = min(self.backoff_max_s, max(self.backoff_initial_s, self._backoff_s * 2))
        # full jitter: ranks that lost the collector together do not come back in lockstep
        self._retry_at = time.monotonic() + random.uniform(0.5, 1.0) * self._backoff_s

    def _rejected(self, batch: list[bytes], exc: Rejected, replay: bool) -> bool:
        self.last_error = str(exc)
        if exc.status == 413 and len(batch) > 1:
            half = len(batch) // 2
            return self._post(batch[:half], replay=replay) and self._post(batch[half:], replay=replay)
        bad = {e.get("index") for e in exc.errors if isinstance(e, dict)}
        if exc.status == 422 and bad and len(exc.errors) < len(batch):
            kept = [line for i, line in enumerate(batch) if i not in bad]
            self.counters["rejected"] += len(batch) - len(kept)
            if not kept:
                return True
            try:  # once: a second 422 drops the whole rest
                answer = self.transport.send(b"".join(kept), len(kept))
            except SendError as again:
                self._failed(str(again))
                return False
            except Rejected as again:
                self.counters["rejected"] += len(kept)
                self.last_error = str(again)
                return True
            self._delivered(kept, answer, replay)
            return True
        self.counters["rejected"] += len(batch)
        return True

    def _emergency_spool(self) -> None:
        if self.spool is None or not self.spool.lock.acquire(timeout=0.5):
            self.counters["dropped_overflow"] += len(self._queue) + len(self._inflight)
            return
        try:
            pending = list(self._inflight)
            while self._queue:
                sample = self._queue.popleft()
                pending.append(orjson.dumps(sample) + b"\n")
            dropped = self.spool.append(pending)
            self.counters["spooled"] += len(pending) - dropped
            self.counters["dropped_spool_full"] += dropped
        except Exception as exc:
            self.last_error = f"emergency spool: {exc}"
        finally:
            self.spool.lock.release()

    # ---------------------------------------------------------- fork

    def _after_fork_in_child(self) -> None:
        self._child = True
        self._closed = True
        self._queue = deque()
        self._inflight = []
        self._wake = threading.Event()
        self._cond = threading.Condition()
        fds: list[int | None] = [getattr(self.transport, "fileno", lambda: None)()]
        if self.spool is not None:
            self.spool.lock = threading.Lock()
            fds.append(self.spool.fileno())
            fds.extend(self.spool.adopted_filenos())
        _neutralize(fds)
        # the parent's HTTP connection socket: drop our reference without a shutdown
        if isinstance(self.transport, HttpTransport):
            self.transport._conn = None


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
            try:
                os.dup2(devnull, fd)
            except OSError:
                pass
    finally:
        os.close(devnull)


def _after_fork_in_child() -> None:
    for sender in list(_live_senders):
        try:
            sender._after_fork_in_child()
        except Exception:
            pass
    _live_senders.clear()


def _close_all_at_exit() -> None:
    timeout = float(os.environ.get("VRAMWATCH_EXIT_TIMEOUT", "5") or 5)
    deadline = time.monotonic() + timeout
    for sender in list(_live_senders):
        if sender._pid == os.getpid() and not sender._child:
            sender.close(max(0.1, deadline - time.monotonic()))


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all_at_exit)


__all__ = ["BatchSender", "FileTransport", "HttpTransport", "Rejected", "SendError", "Spool",
           "default_spool_dir", "spool_prefix"]
