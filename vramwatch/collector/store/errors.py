"""What the store raises: one base class, so callers catch ``StoreError`` for every refusal."""

from __future__ import annotations


class StoreError(RuntimeError):
    """The database cannot be opened or written (locked, read-only, newer schema)."""


class StoreBusyError(StoreError):
    """Another connection or process holds the write lock past the busy timeout."""


class StoreLockedError(StoreError):
    """Another collector already serves this database file (``exclusive=True`` open)."""


class StoreCloseError(StoreError):
    """The final checkpoint at shutdown failed (disk full, I/O error): the samples are safe
    in the ``-wal`` file and are recovered on the next open, but the close was not clean."""


class RunFullError(StoreError):
    """A run reached its cap of stored samples (``max_samples_per_run``); nothing was stored."""

    def __init__(self, run: str, stored: int, cap: int) -> None:
        super().__init__(f"run: {run!r} holds {stored} samples, its cap is {cap} (max_samples_per_run)")
        self.run = run
        self.stored = stored
        self.cap = cap
