"""What the store raises: one base class, so callers catch ``StoreError`` for every refusal; the
store translates ``sqlite3`` errors into it (:func:`reads_translated`), so no caller sees them."""

from __future__ import annotations

import functools
import inspect
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from vramwatch.errors import VramwatchError

F = TypeVar("F", bound=Callable[..., Any])


class StoreError(VramwatchError, RuntimeError):
    """The database cannot be opened or written (locked, read-only, newer schema); the API answers
    503 (retry later), the CLI exits 2 naming the file."""

    status = 503


class StoreBusyError(StoreError):
    """Another connection or process holds the write lock past the busy timeout."""


class StoreLockedError(StoreError):
    """Another collector already serves this database file (``exclusive=True`` open)."""


class StoreCloseError(StoreError):
    """The final checkpoint at shutdown failed (disk full, I/O error): the samples are safe
    in the ``-wal`` file and are recovered on the next open, but the close was not clean."""


class RunFullError(StoreError):
    """A run reached its cap of stored samples (``max_samples_per_run``); nothing was stored."""

    status = 422

    def __init__(self, run: str, stored: int, cap: int) -> None:
        super().__init__(f"run: {run!r} holds {stored} samples, its cap is {cap} (max_samples_per_run)")
        self.run = run
        self.stored = stored
        self.cap = cap


class StoreReadError(StoreError):
    """A read met a page it cannot use: a damaged file opens fine and fails where a read first
    reaches the bad page, deep inside a command or a request. The message names the file and how
    to check it."""

    status = 500


#: SQLite's primary result codes for "another connection holds a lock" (SQLITE_BUSY, SQLITE_LOCKED)
_BUSY_CODES = (5, 6)


def translated(path: str, exc: sqlite3.DatabaseError) -> StoreError:
    """The store's error for an ``sqlite3`` error raised while reading ``path``."""
    if isinstance(exc, sqlite3.OperationalError) and (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in _BUSY_CODES:
        return StoreBusyError(f"{path}: {exc}")
    return StoreReadError(f"cannot read {path}: {exc} (check it with: sqlite3 FILE 'PRAGMA integrity_check')")


def write_error(path: str, verb: str, exc: BaseException) -> BaseException:
    """What a failed write transaction raises: :class:`StoreBusyError` when another connection
    held the lock past the busy timeout, :class:`StoreError` for any other ``sqlite3`` error
    (``cannot {verb} {path}: ...``), anything else as it is."""
    if isinstance(exc, sqlite3.OperationalError) and (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in _BUSY_CODES:
        return StoreBusyError(f"cannot {verb} {path}: {exc}")
    if isinstance(exc, sqlite3.Error):
        return StoreError(f"cannot {verb} {path}: {exc}")
    return exc


def reads_translated(method: F) -> F:
    """``method`` (a store read, a generator too) raising :class:`StoreError` instead of
    ``sqlite3`` errors. Cost: one frame per call (a generator: per call, not per item)."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def generator(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            try:
                yield from method(self, *args, **kwargs)
            except sqlite3.DatabaseError as exc:
                raise translated(self.path, exc) from exc

        return generator  # type: ignore[return-value]

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except sqlite3.DatabaseError as exc:
            raise translated(self.path, exc) from exc

    return call  # type: ignore[return-value]
