"""A bound on CPU-heavy reads: snapshot diffs, leak suspects, the post-mortem, the advice, a run's
figures, compare, the heatmap.

Each of these reads files or a run's samples and computes for up to seconds (64 ranks x 2,000
steps: figures and compare ~8 s, the post-mortem ~5 s, a heatmap ~1 s, the advice ~0.2 s,
growing with the ranks: docs/benchmarks.md). The routes are ``async``: a request waits for a
slot on the event loop (holding no thread), then its work runs in this object's own
:data:`SLOTS` worker threads, never on the event loop and never in the threads ingest and the
other reads share. A request that finds every slot taken waits up to :data:`QUEUE_S` seconds,
then gets 503 with ``Retry-After``. A slot is given back when the work ends, not when the
request does: a client that leaves cannot start a third computation beside two still running.
So a burst of heavy reads costs at most ``SLOTS`` threads' CPU, and ``/healthz``, ingest and
the light reads keep answering (their handlers take the GIL between the heavy work's
bytecodes; no heavy read holds it in one long C call: reader patterns are globs, never a
backtracking regular expression).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import HTTPException

T = TypeVar("T")

#: heavy reads computed at once
SLOTS = 2
#: seconds a heavy read waits for a slot before a 503
QUEUE_S = 10.0


class HeavyReads:
    """At most ``slots`` heavy reads at once in threads of their own; :meth:`run` waits
    ``queue_s`` at most for a slot, then 503."""

    def __init__(self, slots: int = SLOTS, queue_s: float = QUEUE_S) -> None:
        self.slots = slots
        self.queue_s = queue_s
        self._free = asyncio.Semaphore(slots)  # bound to the serving loop at its first wait
        self._pool = ThreadPoolExecutor(slots, thread_name_prefix="vramwatch-heavy")
        self.refused = 0

    async def run(self, what: str, work: Callable[[], T]) -> T:
        """``work()`` in a heavy-read thread once a slot is free; 503 naming ``what`` when none
        frees within ``queue_s``."""
        if self._free.locked():
            try:
                await asyncio.wait_for(self._free.acquire(), self.queue_s)
            except TimeoutError:
                self.refused += 1
                raise HTTPException(503, f"{what}: {self.slots} heavy reads already running; retry later",
                                    headers={"Retry-After": "5"}) from None
        else:
            await self._free.acquire()
        loop = asyncio.get_running_loop()
        try:
            future = self._pool.submit(contextvars.copy_context().run, work)
        except BaseException:
            self._free.release()
            raise
        future.add_done_callback(lambda _: _call_soon(loop, self._free.release))
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """No new work; what runs finishes in its thread."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, release: Callable[[], None]) -> None:
    try:
        loop.call_soon_threadsafe(release)
    except RuntimeError:  # the loop closed while the work ran (shutdown): nothing waits for the slot
        pass


def heavy(state: object) -> HeavyReads:
    """The app's :class:`HeavyReads` (made on first use when the app did not make one)."""
    found = getattr(state, "heavy", None)
    if found is None:
        found = HeavyReads()
        state.heavy = found  # type: ignore[attr-defined]
    return found


__all__ = ["QUEUE_S", "SLOTS", "HeavyReads", "heavy"]
