"""The writer's transactions: how long it waits for a lock held elsewhere, and one transaction
under the write lock that commits or rolls back and raises the store's error. Mixed into ``Store``
(its connection, lock and busy timeout); ``Store.insert`` keeps its own transaction (it undoes its
caches on a rollback) with the same two pieces.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator

from vramwatch.collector.store.errors import write_error


class Transactions:
    """``_wait_for_lock`` and ``_writing``; ``Store`` provides the attributes below."""

    path: str
    _conn: sqlite3.Connection
    _lock: threading.Lock
    _busy_timeout_s: float
    _busy_ms: int

    def _wait_for_lock(self, busy_timeout_s: float | None) -> None:
        """Set how long the writer waits for a lock held elsewhere (``None``: the store's), when it
        changed (a PRAGMA per change, not per write). Under ``_lock``."""
        busy_ms = int(1000 * (self._busy_timeout_s if busy_timeout_s is None else busy_timeout_s))
        if busy_ms != self._busy_ms:
            self._conn.execute(f"PRAGMA busy_timeout={busy_ms}")
            self._busy_ms = busy_ms

    @contextlib.contextmanager
    def _writing(self, busy_timeout_s: float | None, verb: str) -> Iterator[sqlite3.Connection]:
        """The writer's connection in one transaction under the write lock: committed, or rolled
        back and :func:`~vramwatch.collector.store.errors.write_error`'s error (``cannot {verb} ...``)."""
        with self._lock:
            conn = self._conn
            try:
                self._wait_for_lock(busy_timeout_s)
                conn.execute("BEGIN IMMEDIATE")
                yield conn
                conn.execute("COMMIT")
            except BaseException as exc:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                error = write_error(self.path, verb, exc)
                if error is exc:
                    raise
                raise error from None
