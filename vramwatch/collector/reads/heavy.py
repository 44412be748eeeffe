"""A bound on CPU-heavy reads: snapshot diffs, leak suspects, the post-mortem.

Each of these reads files or a run's samples and computes for up to seconds. They run in the
server's worker threads (never on the event loop), each under its own deadline (the snapshot
budget's, the diff's work budget), and at most :data:`SLOTS` of them at once: a request that
finds every slot taken waits up to :data:`QUEUE_S` seconds, then gets 503 with
``Retry-After``. So a burst of heavy reads costs at most ``SLOTS`` threads' CPU, and
``/healthz``, ingest and the light reads keep answering (their handlers take the GIL between
the heavy work's bytecodes; no heavy read holds it in one long C call: reader patterns are
globs, never a backtracking regular expression).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from fastapi import HTTPException

#: heavy reads computed at once
SLOTS = 2
#: seconds a heavy read waits for a slot before a 503
QUEUE_S = 10.0


class HeavyReads:
    """At most ``slots`` heavy reads at once; :meth:`slot` waits ``queue_s`` at most, then 503."""

    def __init__(self, slots: int = SLOTS, queue_s: float = QUEUE_S) -> None:
        self.slots = slots
        self.queue_s = queue_s
        self._free = threading.BoundedSemaphore(slots)
        self.refused = 0

    @contextlib.contextmanager
    def slot(self, what: str) -> Iterator[None]:
        if not self._free.acquire(timeout=self.queue_s):
            self.refused += 1
            raise HTTPException(503, f"{what}: {self.slots} heavy reads already running; retry later",
                                headers={"Retry-After": "5"})
        try:
            yield
        finally:
            self._free.release()


def heavy(state: object) -> HeavyReads:
    """The app's :class:`HeavyReads` (made on first use when the app did not make one)."""
    found = getattr(state, "heavy", None)
    if found is None:
        found = HeavyReads()
        state.heavy = found  # type: ignore[attr-defined]
    return found


__all__ = ["QUEUE_S", "SLOTS", "HeavyReads", "heavy"]
