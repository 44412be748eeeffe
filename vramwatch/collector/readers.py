"""Per-thread read-only connections that can all be closed at once (the view caches hold
one per worker thread; the app's lifespan closes them with the store)."""

from __future__ import annotations

import sqlite3
import threading

from vramwatch.collector.store import thread_reader


class ThreadReaders:
    """This thread's read-only connection to ``path``; :meth:`close` closes every thread's."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._local = threading.local()
        self._opened: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    def get(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = thread_reader(self._local, self.path)
            with self._lock:
                self._opened.append(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, []
            self._local = threading.local()
        for conn in opened:
            try:
                conn.close()
            except sqlite3.Error:
                pass
