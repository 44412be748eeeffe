"""Diffs of stored snapshots and a run's leak suspects, for the API and the post-mortem.

Stored snapshots are read only through the data-only unpickler
(:mod:`vramwatch.evidence.safe_pickle`): a rank can upload anything, and nothing it uploads
runs here. Snapshots never change once stored, so each diff is computed once and kept
(:class:`DiffCache`, a few entries); one diff is computed at a time, which bounds memory to
two loaded snapshots (up to a few times their pickles' size). Cost: a few hundred ms for two
20,000-block snapshots (``docs/benchmarks.md``), run in the request's worker thread.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from vramwatch.collector.snapshots.directives import SnapshotError, SnapshotInfo, SnapshotStore
from vramwatch.collector.state.live import EVENTS_KEPT, LiveState
from vramwatch.evidence import safe_pickle
from vramwatch.evidence.snapshot_diff import SnapshotDiff, SnapshotFormatError, diff
from vramwatch.evidence.suspects import LeakSuspects, SnapshotRef, from_diff, pick_pairs

log = logging.getLogger("vramwatch.collector")

#: ``skip`` patterns a request may add, and their length
MAX_SKIP_PATTERNS = 16
MAX_SKIP_CHARS = 200


class DiffCache:
    """Per-site diffs of stored snapshots, computed once each (LRU of ``entries``)."""

    def __init__(self, snapshots: SnapshotStore, *, entries: int = 32,
                 max_bytes: int = safe_pickle.MAX_PICKLE_BYTES) -> None:
        self.snapshots = snapshots
        self.entries = entries
        self.max_bytes = max_bytes
        self._done: OrderedDict[tuple[str, str, tuple[str, ...]], SnapshotDiff] = OrderedDict()
        self._lock = threading.Lock()  # one computation at a time: two snapshots in memory at most
        self.computed = 0

    def open(self, field_name: str, snapshot_id: str) -> tuple[SnapshotInfo, Any]:
        """The stored snapshot's record and file; SnapshotError (404) naming ``field_name``."""
        try:
            return self.snapshots.open(snapshot_id)
        except SnapshotError as exc:
            raise SnapshotError(field_name, f"no snapshot {snapshot_id!r}", exc.status) from None

    def load(self, field_name: str, snapshot_id: str) -> tuple[SnapshotInfo, dict[str, Any]]:
        """A stored snapshot, safely; SnapshotError 404 when unknown, 422 when it is refused."""
        info, path = self.open(field_name, snapshot_id)
        try:
            return info, safe_pickle.read_snapshot(path, max_bytes=self.max_bytes)
        except safe_pickle.UnsafePickle as exc:
            raise SnapshotError(field_name, f"snapshot {snapshot_id} refused: {exc}", 422) from None
        except FileNotFoundError:
            raise SnapshotError(field_name, f"no snapshot {snapshot_id}", 404) from None

    def diff(self, old: str, new: str, skip: Sequence[str] = ()) -> SnapshotDiff:
        key = (old, new, tuple(skip))
        with self._lock:
            hit = self._done.get(key)
            if hit is not None:
                self._done.move_to_end(key)
                return hit
            with safe_pickle.paused_gc():  # both snapshots are dropped before collection resumes
                result = self._compute(old, new, skip)
            self.computed += 1
            self._done[key] = result
            while len(self._done) > self.entries:
                self._done.popitem(last=False)
            return result

    def _compute(self, old: str, new: str, skip: Sequence[str]) -> SnapshotDiff:
        _, before = self.load("old", old)
        _, after = self.load("new", new)
        try:
            return diff(before, after, skip=skip)
        except SnapshotFormatError as exc:
            raise SnapshotError("snapshot", str(exc), 422) from None
        except ValueError as exc:  # a skip pattern that is no regular expression
            raise SnapshotError("skip", str(exc).removeprefix("skip: "), 422) from None


def check_skip(skip: Sequence[str]) -> list[str]:
    if len(skip) > MAX_SKIP_PATTERNS:
        raise SnapshotError("skip", f"at most {MAX_SKIP_PATTERNS} patterns, got {len(skip)}", 422)
    for pattern in skip:
        if not pattern or len(pattern) > MAX_SKIP_CHARS:
            raise SnapshotError("skip", f"a pattern is 1..{MAX_SKIP_CHARS} characters", 422)
    return list(skip)


def leaking_ranks(live: LiveState, run: str) -> set[tuple[str, int]]:
    """(host, rank) of the run's ranks whose engine says leak now or raised a leak event (the run
    frozen once, :meth:`LiveState.freeze`)."""
    frozen = live.freeze(run, events=EVENTS_KEPT)
    if frozen is None:
        return set()
    return {(r.host, r.rank) for r in frozen.ranks
            if r.summary.get("state") == "leak" or any(e.get("type") == "leak" for e in r.events)}


def run_suspects(cache: DiffCache, live: Any, run: str, infos: Sequence[SnapshotInfo]) -> list[LeakSuspects]:
    """Each leaking rank's growing sites between its pair of snapshots; a rank whose snapshot
    cannot be read is logged and left out (the others still answer)."""
    refs = [SnapshotRef(i.id, i.host, i.rank, i.step, i.ts, i.trigger) for i in infos]
    out = []
    for old, new in pick_pairs(refs, leaking_ranks(live, run) if live is not None else set()):
        try:
            out.append(from_diff(old, new, cache.diff(old.id, new.id)))
        except SnapshotError as exc:
            log.warning("leak suspects of %s rank %d: %s", run, new.rank, exc)
    return out


def enrich_postmortem(pm: Any, *, snapshots: SnapshotStore, diffs: DiffCache, processes: Any, live: Any = None
                      ) -> Any:
    """Add what the stored evidence says to a post-mortem: the run's snapshots, its leak
    suspects, and per rank the other processes its hook last saw on its GPU (ranks of the run
    left out, by the PIDs in their last samples). Cost: the listing, the diffs not yet cached."""
    from vramwatch.collector.ingest.processes import foreign_only

    infos = snapshots.list(pm.run)
    pm.snapshots = [i.to_dict() for i in infos]
    pm.suspects = run_suspects(diffs, live, pm.run, infos)
    pm.refresh_next()
    pids: dict[str, set[int]] = {}
    for r in pm.ranks:
        if r.last_sample.get("pid") is not None:
            pids.setdefault(r.host, set()).add(r.last_sample["pid"])
    reports = {(rep.host, rep.rank): foreign_only(rep, pids) for rep in processes.run(pm.run)}
    for r in pm.ranks:
        report = reports.get((r.host, r.rank))
        if report is not None:
            r.foreign_processes, r.foreign_device = report.processes, report.device()
    return pm
