"""The disk spool: samples not yet delivered, kept on local disk and replayed oldest-first.

:class:`SpoolingExporter` wraps another exporter: while the collector answers, batches go
straight through; when it does not (:attr:`ExportOutcome.RETRY`), the batch goes to the spool and
sending pauses with capped exponential backoff and full jitter (:class:`Backoff`). While the
spool holds anything, new batches are appended behind it, so replay is strictly in order.
The collector's ingest is idempotent, so at-least-once here is exactly-once in the store.

The spool is bounded per rank *across restarts*: files left by earlier incarnations of the
same run and rank are adopted (replayed first) and count against the same ``max_bytes``.
"""

from __future__ import annotations

import fcntl
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vramwatch.delivery.results import ExportFailure, ExportOutcome, ExportResult

#: a spooled line is one sample (under 1 KiB); a longer run of bytes without a newline is damage
MAX_SPOOL_LINE = 1 << 20


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
        self._adopted_bytes = 0  # not yet replayed, across every adopted file
        self.write_error: str | None = None  # set when the disk refused a write
        self.discarded_lines = 0  # lines of adopted files over the cap, deleted unsent
        self._adopt_within_cap(list(adopt))

    def _adopt_within_cap(self, paths: list[Path]) -> None:
        """Adopt earlier incarnations' files, newest first, while their total fits ``max_bytes``.

        The cap is per rank across restarts: a crash-looping job must not add another
        ``max_bytes`` each time. Older files that do not fit are deleted and their lines counted.
        """
        sized = []
        for path in paths:
            try:
                sized.append((path.stat().st_mtime, path.stat().st_size, path))
            except OSError:
                continue
        budget = self.max_bytes
        keep: list[Path] = []
        for _mtime, size, path in sorted(sized, key=lambda t: t[0], reverse=True):
            if size <= budget:
                keep.append(path)
                budget -= size
            elif self._lock_and_discard(path):
                continue
        for path in reversed(keep):  # replay oldest first
            self._adopt(path)

    def _lock_and_discard(self, path: Path) -> bool:
        try:
            fh = open(path, "r+b", buffering=0)  # noqa: SIM115
        except OSError:
            return False
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # its owner may still be alive
            while block := fh.read(1 << 16):  # counted block by block: a spool may be 512 MiB
                self.discarded_lines += block.count(b"\n")
            path.unlink()
            return True
        except OSError:
            return False
        finally:
            fh.close()

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
        try:
            self._adopted_bytes += os.fstat(fh.fileno()).st_size
        except OSError:
            pass

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
        """Bytes not yet delivered, in this incarnation's file and every adopted one (what the cap bounds)."""
        return self._size - self._offset + self._adopted_bytes

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
        room = self.max_bytes - self.pending_bytes()
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
                def commit_adopted(end: int = end, path: Path = path, fh: Any = fh, start: int = offset) -> None:
                    self._adopted[0] = (path, fh, end)
                    self._adopted_bytes = max(0, self._adopted_bytes - (end - start))
                return lines, commit_adopted
            self._adopted.pop(0)  # fully replayed
            try:
                self._adopted_bytes = max(0, self._adopted_bytes - (os.fstat(fh.fileno()).st_size - offset))
            except OSError:
                pass
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
        damaged = False
        while len(lines) < max_lines:
            block = fh.read(1 << 16)
            if not block:
                break
            chunk += block
            parts = chunk.split(b"\n")
            chunk = parts.pop()  # unterminated remainder
            if damaged and parts:  # the end of a damaged line: dropped with the rest of it
                end += len(parts.pop(0)) + 1
                damaged = False
            if len(chunk) > MAX_SPOOL_LINE and not parts:  # a damaged line: dropped, never held whole
                end += len(chunk)
                chunk, damaged = b"", True
                continue
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
        self._adopted_bytes = 0


def spool_prefix(run: str, rank: int) -> str:
    """File-name prefix of every spool file of one (run, rank), whatever the incarnation."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run)[:96]
    return f"{safe}.rank{rank}."


def leftover_spools(root: Path, run: str, rank: int) -> list[Path]:
    """Spool files earlier incarnations of this run and rank left behind, oldest first."""
    try:
        found = list(root.glob(spool_prefix(run, rank) + "*.jsonl"))
        return sorted(found, key=lambda p: p.stat().st_mtime)
    except OSError:
        return []


class Backoff:
    """Capped exponential backoff with full jitter (ranks that lost the collector together
    must not come back in lockstep)."""

    def __init__(self, initial_s: float = 0.5, max_s: float = 30.0) -> None:
        self.initial_s = initial_s
        self.max_s = max(initial_s, max_s)
        self.delay_s = 0.0
        self.retry_at = 0.0
        self.hard = False  # the last failure was a configuration error: even flush() waits it out

    def failed(self, *, at_least_s: float = 0.0, hard: bool = False) -> None:
        self.delay_s = min(self.max_s, max(self.initial_s, self.delay_s * 2, at_least_s))
        self.retry_at = time.monotonic() + random.uniform(0.5, 1.0) * self.delay_s
        self.hard = hard

    def succeeded(self) -> None:
        self.delay_s = 0.0
        self.retry_at = 0.0
        self.hard = False

    def waiting(self) -> bool:
        return time.monotonic() < self.retry_at


class SpoolingExporter:
    """An exporter that keeps what ``inner`` could not deliver in a :class:`Spool` and replays it."""

    def __init__(self, inner: Any, spool: Spool, backoff: Backoff | None = None) -> None:
        self.inner = inner
        self.spool = spool
        self.backoff = backoff or Backoff()

    def export(self, lines: Sequence[bytes], timeout: float | None = None, *, force: bool = False,
               deadline: float | None = None) -> ExportResult:
        """Send ``lines`` behind whatever waits in the spool. ``force``: ignore the backoff (flush)."""
        result = ExportResult(ExportOutcome.SUCCESS)
        waiting = self.backoff.waiting() and (not force or self.backoff.hard)
        if self.spool.pending() or waiting:
            self._append(list(lines), result)  # keep order: everything new goes behind what waits
            if not waiting:
                self._drain(result, deadline)
            return result
        sent = self.inner.export(lines, self._timeout(timeout, deadline))
        result.merge(sent)
        result.outcome = sent.outcome
        if sent.outcome is ExportOutcome.RETRY:
            self._append(sent.retry, result)
            self._failed(sent)
        else:
            self.backoff.succeeded()
        return result

    def park(self, lines: Sequence[bytes]) -> ExportResult:
        """Put lines in the spool without sending (the queue outgrew memory)."""
        result = ExportResult(ExportOutcome.SUCCESS)
        self._append(list(lines), result)
        return result

    def pending(self) -> bool:
        return self.spool.pending()

    def _failed(self, sent: ExportResult) -> None:
        # a misconfigured collector (redirect, always-413, bad token) will not heal in milliseconds
        slow = sent.failure in (ExportFailure.REDIRECT, ExportFailure.TOO_LARGE, ExportFailure.AUTH)
        self.backoff.failed(at_least_s=min(self.backoff.max_s, 5.0) if slow else 0.0, hard=slow)

    @staticmethod
    def _timeout(timeout: float | None, deadline: float | None) -> float | None:
        if deadline is None:
            return timeout
        return max(0.05, deadline - time.monotonic())

    def _append(self, lines: list[bytes], result: ExportResult) -> None:
        if not lines:
            return
        with self.spool.lock:
            dropped = self.spool.append(lines)
        result.spooled += len(lines) - dropped
        result.spool_dropped += dropped

    def _drain(self, result: ExportResult, deadline: float | None) -> None:
        """Replay the spool oldest-first until it is empty, a send fails, or ``deadline`` passes."""
        spool = self.spool
        while spool.pending():
            if deadline is not None and time.monotonic() > deadline:
                result.outcome = ExportOutcome.RETRY
                return
            with spool.lock:
                batch, commit = spool.read_batch(self.batch_lines)
            if not batch:
                continue
            sent = self.inner.export(batch, self._timeout(None, deadline))
            result.merge(sent)
            if sent.outcome is ExportOutcome.RETRY:
                result.outcome = ExportOutcome.RETRY
                self._failed(sent)
                return  # the batch stays in the spool: nothing to re-append
            result.replayed += sent.delivered
            with spool.lock:
                commit()
        self.backoff.succeeded()

    batch_lines = 512

    def shutdown(self) -> None:
        self.inner.shutdown()
        self.spool.close()

    def describe(self) -> str:
        return self.inner.describe()

    def after_fork_in_child(self) -> list[int]:
        self.spool.lock = threading.Lock()
        fds = list(self.inner.after_fork_in_child())
        fds.append(self.spool.fileno())
        fds.extend(self.spool.adopted_filenos())
        return [fd for fd in fds if fd is not None]


__all__ = ["Backoff", "Spool", "SpoolingExporter", "leftover_spools", "spool_prefix"]
