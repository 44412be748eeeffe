"""Allocator snapshots driven by the collector: directives out, snapshots in.

The collector decides *when* a rank should capture (an engine verdict, an OOM elsewhere in
the run, a person's click or ``vramwatch capture``) and says so in its ingest replies
(``{"directives": [{"type": "capture", "id", "steps", "trigger"}]}``). The hook records
allocator history for ``steps`` steps, takes ``torch.cuda.memory._snapshot()`` at a step
boundary and uploads it gzip-compressed. Snapshots live as files beside the database
(``<db>.snapshots/``), each with a JSON sidecar; no SQL, no blob in SQLite.

Bounds: a snapshot is at most ``max_snapshot_bytes`` compressed, the folder at most
``max_total_bytes`` (oldest evicted first); automatic triggers are rate-limited per rank
(``auto_interval_s``, per rank and trigger); a directive is handed out at most once per rank and expires
(``directive_ttl_s``) if the rank never asks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import threading
import time
import uuid as _uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vramwatch.bounded import Inflater, LimitExceeded
from vramwatch.errors import VramwatchError
from vramwatch.evidence import pickle_grammar, safe_pickle
from vramwatch.evidence.suspects import FOLLOWUP_STEPS, FOLLOWUP_TRIGGER, LEAK_TRIGGER

SeriesKey = tuple[str, str, int]
_log = logging.getLogger("vramwatch.collector")

#: Engine events that ask for a snapshot on their own (configurable per collector).
DEFAULT_AUTO_TRIGGERS = frozenset({"leak", "outside_allocator_leak", "fragmentation", "plateau_break", "oom"})
#: plateau breaks with these causes are the allocator keeping a phase's buffers: explained.
_EXPLAINED_BREAK_CAUSES = frozenset({"checkpoint", "eval"})
_ID_RE = re.compile(r"[0-9a-f]{32}\Z")
DEFAULT_STEPS = 5
MAX_STEPS = 1000


class SnapshotError(VramwatchError, ValueError):
    """A snapshot upload or directive request that cannot be accepted; ``field`` names why."""

    def __init__(self, field_name: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.status = status


@dataclass(frozen=True)
class CaptureDirective:
    """One instruction to one rank, as it travels in an ingest reply."""

    id: str
    type: str  # "capture"
    steps: int
    trigger: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SnapshotInfo:
    id: str
    run: str
    host: str
    rank: int
    step: int
    trigger: str
    directive: str | None
    ts: float
    bytes: int  # compressed size on disk

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["url"] = f"/api/v1/snapshots/{self.id}"
        return out


@dataclass
class _Pending:
    directive: CaptureDirective
    created: float


@dataclass
class DirectiveBoard:
    """Pending capture directives per rank, and the triggers that create them. Thread-safe."""

    auto_triggers: frozenset[str] = DEFAULT_AUTO_TRIGGERS
    auto_interval_s: float = 1800.0
    #: a person's capture (dashboard button, ``vramwatch capture``) per rank at most this often
    manual_interval_s: float = 60.0
    directive_ttl_s: float = 3600.0
    steps: int = DEFAULT_STEPS
    #: steps the second capture of a leaking rank records (its blocks then carry their stacks)
    followup_steps: int = FOLLOWUP_STEPS
    _pending: dict[SeriesKey, list[_Pending]] = field(default_factory=dict)
    #: (series, trigger) -> when it last asked: one automatic capture per rank and trigger per interval
    #: (a leak usually starts as a plateau break; its own capture must not wait 30 minutes behind it)
    _last_auto: dict[tuple[SeriesKey, str], float] = field(default_factory=dict)
    _last_manual: dict[SeriesKey, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def request(self, keys: Iterable[SeriesKey], *, steps: int, trigger: str, now: float | None = None) -> list[str]:
        """Queue a capture for each series; returns the directive ids (one per series)."""
        if not 1 <= steps <= MAX_STEPS:
            raise SnapshotError("steps", f"must be 1..{MAX_STEPS}, got {steps}")
        now = time.time() if now is None else now
        ids = []
        with self._lock:
            for key in keys:
                queue = self._pending.setdefault(key, [])
                if any(p.directive.trigger == trigger for p in queue):
                    continue  # one pending capture per trigger is enough
                directive = CaptureDirective(_uuid.uuid4().hex, "capture", steps, trigger)
                queue.append(_Pending(directive, now))
                ids.append(directive.id)
        return ids

    def request_manual(self, keys: Iterable[SeriesKey], *, steps: int, now: float | None = None
                       ) -> tuple[list[str], float]:
        """A person's capture, rate-limited per rank as the automatic ones are: a rank asked less
        than ``manual_interval_s`` ago is skipped. Returns (directive ids, seconds until the
        first skipped rank may be asked again; 0 when none was skipped). Memory: one time per
        rank asked within the interval."""
        now = time.time() if now is None else now
        allowed, wait = [], 0.0
        with self._lock:
            if len(self._last_manual) > 4096:
                self._last_manual = {k: t for k, t in self._last_manual.items() if now - t < self.manual_interval_s}
            for key in keys:
                if any(p.directive.trigger == "manual" for p in self._pending.get(key, ())):
                    continue  # one is still pending: nothing new to ask (not a refusal)
                since = now - self._last_manual.get(key, float("-inf"))
                if since < self.manual_interval_s:
                    left = self.manual_interval_s - since
                    wait = left if not wait else min(wait, left)
                    continue
                allowed.append(key)
        ids = self.request(allowed, steps=steps, trigger="manual", now=now)
        with self._lock:
            for key in allowed:
                self._last_manual[key] = now
        return ids, wait

    def take(self, keys: Iterable[SeriesKey], now: float | None = None) -> list[CaptureDirective]:
        """Hand out (and forget) the directives waiting for these series."""
        now = time.time() if now is None else now
        out: list[CaptureDirective] = []
        with self._lock:
            for key in set(keys):
                queue = self._pending.pop(key, None)
                if queue:
                    out.extend(p.directive for p in queue if now - p.created <= self.directive_ttl_s)
        return out

    def pending(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._pending.values())

    def on_events(self, events: Iterable[dict[str, Any]], run_keys: Any, now: float | None = None) -> int:
        """Turn engine events into directives. ``run_keys(run)`` lists a run's series keys.

        An OOM on one rank asks every *other* rank of the run for a snapshot too, so the
        state of the whole job at the moment of death is kept. Returns directives queued.
        """
        now = time.time() if now is None else now
        queued = 0
        for event in events:
            kind = event.get("type")
            if kind not in self.auto_triggers:
                continue
            if kind == "plateau_break" and event.get("cause") in _EXPLAINED_BREAK_CAUSES:
                continue
            key: SeriesKey = (event["run"], event["host"], event["rank"])
            targets = [key]
            if kind == "oom":
                targets = [k for k in run_keys(key[0]) if k != key]
            for target in targets:
                if now - self._last_auto.get((target, kind), float("-inf")) < self.auto_interval_s and kind != "oom":
                    continue
                self._last_auto[(target, kind)] = now
                queued += len(self.request([target], steps=self.steps, trigger=f"auto:{kind}", now=now))
        return queued

    def on_snapshot(self, info: SnapshotInfo, now: float | None = None) -> int:
        """A snapshot the engine's leak verdict asked for asks that rank for a second one,
        recorded over ``followup_steps`` steps: the pair is what names the leaking lines
        (:mod:`vramwatch.evidence.suspects`). Returns directives queued (0 or 1)."""
        if info.trigger != LEAK_TRIGGER:
            return 0
        key = (info.run, info.host, info.rank)
        return len(self.request([key], steps=self.followup_steps, trigger=FOLLOWUP_TRIGGER, now=now))


class SnapshotUpload:
    """One snapshot being received: written to a temporary file beside the others as it arrives,
    its gzip inflated (and dropped) on the way to check it and count the inflated size. Call
    :meth:`write` per block and :meth:`commit` (or :meth:`abort`) once, from worker threads."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.id = _uuid.uuid4().hex
        self.path = store.folder / f".upload-{self.id}.tmp"
        self.size = 0
        self._inflater = Inflater(store.max_inflated_bytes, "body", "max_snapshot_inflated_bytes")
        # proven within the reader's budget while it arrives: its reads then skip the proof
        self._grammar = pickle_grammar.Recognizer()
        self._fh = open(self.path, "wb")  # noqa: SIM115 - closed by commit/abort

    def write(self, data: bytes) -> None:
        """Append a block; :class:`SnapshotError` past a cap (413) or when it is not gzip (415)."""
        self.size += len(data)
        if self.size > self.store.max_snapshot_bytes:
            raise SnapshotError("body", f"larger than {self.store.max_snapshot_bytes} bytes (max_snapshot_bytes)", 413)
        try:
            for piece in self._inflater.feed(data):
                self._grammar.feed(piece)
        except LimitExceeded as exc:
            raise SnapshotError("body", f"{exc.message} ({exc.limit})", 413) from None
        except OSError:
            raise SnapshotError("body", "not gzip data (upload the pickle gzip-compressed)", 415) from None
        self._fh.write(data)
        self.store._grow(self.id, len(data))

    def commit(self, *, run: str, host: str, rank: int, step: int, trigger: str, directive: str | None
               ) -> SnapshotInfo:
        """Keep it: renamed into place with its sidecar and indexed, the oldest evicted to fit."""
        try:
            self._inflater.finish()
        except OSError:
            raise SnapshotError("body", "truncated gzip data" if self.size else "empty body", 400) from None
        self._fh.close()
        self._grammar.finish()
        info = SnapshotInfo(self.id, run, host, rank, step, trigger, directive, time.time(), self.size)
        info = self.store._commit(self, info)
        if self._grammar.proven():
            with contextlib.suppress(OSError):  # evicted meanwhile: nothing to remember
                safe_pickle.remember_file(self.store.data_path(info.id))
        return info

    def abort(self) -> None:
        self._fh.close()
        self.path.unlink(missing_ok=True)
        self.store._grow(self.id, None)


class SnapshotStore:
    """Snapshot files beside the database, with one in-memory index of them.

    * **Index**: built once from the sidecars when the store opens (O(snapshots)), then kept in
      memory (``id`` → :class:`SnapshotInfo`, oldest first): a save, a list or a download reads
      no sidecar. The owner's start-up (``owner=True``: the collector) removes what a crash
      left: temporary files, data without a sidecar, sidecars without data.
    * **Writes**: an upload streams into ``.upload-<id>.tmp`` (:class:`SnapshotUpload`), then data
      and sidecar are renamed into place: nothing half-stored is ever listed.
    * **Bounds**: a snapshot at most ``max_snapshot_bytes`` compressed and ``max_inflated_bytes``
      inflated (checked while it arrives); the folder at most ``max_total_bytes`` and
      ``max_snapshots`` snapshots, uploads still being written counted (the oldest evicted
      first); ``upload_slots`` bounds the uploads received at once (the route holds a slot).
    """

    def __init__(self, folder: str | os.PathLike[str], *, max_snapshot_bytes: int = 64 * 2**20,
                 max_total_bytes: int = 2 * 2**30, max_snapshots: int = 10_000,
                 max_inflated_bytes: int = 2**30, max_concurrent_uploads: int = 4, owner: bool = False) -> None:
        self.folder = Path(folder)
        self.max_snapshot_bytes = max_snapshot_bytes
        self.max_total_bytes = max_total_bytes
        self.max_snapshots = max_snapshots
        self.max_inflated_bytes = max_inflated_bytes
        self.upload_slots = asyncio.Semaphore(max_concurrent_uploads)
        self.max_concurrent_uploads = max_concurrent_uploads
        self._lock = threading.Lock()
        self._index: dict[str, SnapshotInfo] = {}
        self._stored = 0
        self.evicted = 0  # snapshots removed to fit the caps (each logged)
        self._uploading: dict[str, int] = {}  # upload id -> bytes written so far
        self._load(clean=owner)

    @classmethod
    def beside(cls, db_path: str, **kw: Any) -> SnapshotStore:
        return cls(str(db_path) + ".snapshots", **kw)

    def _load(self, clean: bool) -> None:
        """The index from the sidecars; with ``clean`` (the collector that owns the folder, never a
        reader such as ``snapshots diff --db`` beside a running one) what a crash left behind is
        removed: temporary files, data without a sidecar, sidecars without data."""
        if not self.folder.is_dir():
            return
        infos, data = [], set()
        for entry in os.scandir(self.folder):
            name = entry.name
            if name.endswith(".tmp"):
                if clean:
                    Path(entry.path).unlink(missing_ok=True)
            elif name.endswith(".pickle.gz"):
                data.add(name.removesuffix(".pickle.gz"))
            elif name.endswith(".json"):
                try:
                    with open(entry.path, "rb") as fh:
                        infos.append(SnapshotInfo(**json.loads(fh.read(64 * 1024))))
                except (OSError, ValueError, TypeError):
                    continue  # a half-deleted or foreign file: not a snapshot
        for info in sorted(infos, key=lambda i: i.ts):
            if info.id in data and _ID_RE.match(info.id):
                self._index[info.id] = info
                self._stored += info.bytes
                data.discard(info.id)
            elif clean:
                self.delete(info.id)
        for orphan in data if clean else ():  # data renamed into place, sidecar never written
            if _ID_RE.match(orphan):
                self.data_path(orphan).unlink(missing_ok=True)

    def usage(self) -> dict[str, int]:
        """Snapshots and bytes stored, and uploads (and their bytes) being written now."""
        with self._lock:
            return {"snapshots": len(self._index), "bytes": self._stored, "uploads": len(self._uploading),
                    "upload_bytes": sum(self._uploading.values())}

    def begin(self) -> SnapshotUpload:
        """A new upload (its temporary file counted from now until commit or abort)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        upload = SnapshotUpload(self)
        self._grow(upload.id, 0)
        return upload

    def _grow(self, upload_id: str, size: int | None) -> None:
        with self._lock:
            if size is None:
                self._uploading.pop(upload_id, None)
            else:
                self._uploading[upload_id] = self._uploading.get(upload_id, 0) + size

    def _commit(self, upload: SnapshotUpload, info: SnapshotInfo) -> SnapshotInfo:
        with self._lock:
            self._uploading.pop(upload.id, None)
            self._evict(info.bytes)
            sidecar = self.folder / f".{info.id}.json.tmp"
            sidecar.write_bytes(json.dumps(asdict(info)).encode())
            os.replace(upload.path, self.data_path(info.id))
            os.replace(sidecar, self.folder / f"{info.id}.json")
            self._index[info.id] = info
            self._stored += info.bytes
        return info

    def save(self, *, run: str, host: str, rank: int, step: int, trigger: str, directive: str | None,
             gz: bytes) -> SnapshotInfo:
        """Store one gzip-compressed pickle held in memory (an upload in one block)."""
        if len(gz) > self.max_snapshot_bytes:
            raise SnapshotError("body", f"{len(gz)} bytes; at most {self.max_snapshot_bytes} per snapshot", 413)
        upload = self.begin()
        try:
            upload.write(gz)
            return upload.commit(run=run, host=host, rank=rank, step=step, trigger=trigger, directive=directive)
        except BaseException:
            upload.abort()
            raise

    def data_path(self, snapshot_id: str) -> Path:
        """Where a snapshot's gzip-compressed pickle lives (its sidecar is ``<id>.json``)."""
        return self.folder / f"{snapshot_id}.pickle.gz"

    def _evict(self, incoming: int) -> None:
        """Oldest first, until the incoming snapshot fits beside the rest and the uploads in flight
        (called with the lock held); one log line for all it removed: their count and bytes, the
        oldest and the newest of them."""
        total = self._stored + sum(self._uploading.values()) + incoming
        gone: list[SnapshotInfo] = []
        while self._index and (total > self.max_total_bytes or len(self._index) >= self.max_snapshots):
            oldest = next(iter(self._index.values()))
            self._forget(oldest.id)
            total -= oldest.bytes
            gone.append(oldest)
        if not gone:
            return
        self.evicted += len(gone)
        first, last = gone[0], gone[-1]
        span = "" if len(gone) == 1 else f" to {last.id} (run {last.run!r} rank {last.rank} step {last.step})"
        _log.info("%d snapshot(s), %d bytes, evicted to fit the snapshot caps (max_snapshots %d, "
                  "max_snapshots_bytes %d): from %s (run %r rank %d step %d)%s", len(gone),
                  sum(g.bytes for g in gone), self.max_snapshots, self.max_total_bytes, first.id, first.run,
                  first.rank, first.step, span)

    def _forget(self, snapshot_id: str) -> None:
        """Drop a snapshot from the index and remove its files (called with the lock held)."""
        info = self._index.pop(snapshot_id, None)
        if info is not None:
            self._stored -= info.bytes
        for suffix in (".pickle.gz", ".json"):
            (self.folder / f"{snapshot_id}{suffix}").unlink(missing_ok=True)

    def delete(self, snapshot_id: str) -> None:
        """Remove a snapshot's files and its index entry."""
        with self._lock:
            self._forget(snapshot_id)

    def list(self, run: str | None = None) -> list[SnapshotInfo]:
        with self._lock:
            return [i for i in self._index.values() if run is None or i.run == run]

    def open(self, snapshot_id: str) -> tuple[SnapshotInfo, Path]:
        """The snapshot's record and its gzip file; SnapshotError (404) when unknown."""
        info = self._index.get(snapshot_id) if _ID_RE.match(snapshot_id) else None
        if info is None:
            raise SnapshotError("id", f"no snapshot {snapshot_id}", 404)
        return info, self.data_path(snapshot_id)
