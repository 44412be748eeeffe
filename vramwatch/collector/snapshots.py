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

import json
import os
import re
import threading
import time
import uuid as _uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vramwatch.evidence.suspects import FOLLOWUP_STEPS, FOLLOWUP_TRIGGER, LEAK_TRIGGER

SeriesKey = tuple[str, str, int]

#: Engine events that ask for a snapshot on their own (configurable per collector).
DEFAULT_AUTO_TRIGGERS = frozenset({"leak", "outside_allocator_leak", "fragmentation", "plateau_break", "oom"})
#: plateau breaks with these causes are the allocator keeping a phase's buffers: explained.
_EXPLAINED_BREAK_CAUSES = frozenset({"checkpoint", "eval"})
_ID_RE = re.compile(r"[0-9a-f]{32}\Z")
DEFAULT_STEPS = 5
MAX_STEPS = 1000


class SnapshotError(ValueError):
    """A snapshot upload or directive request that cannot be accepted; ``field`` names why."""

    def __init__(self, field_name: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.status = status


@dataclass(frozen=True)
class Directive:
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
    directive: Directive
    created: float


@dataclass
class DirectiveBoard:
    """Pending capture directives per rank, and the triggers that create them. Thread-safe."""

    auto_triggers: frozenset[str] = DEFAULT_AUTO_TRIGGERS
    auto_interval_s: float = 1800.0
    directive_ttl_s: float = 3600.0
    steps: int = DEFAULT_STEPS
    #: steps the second capture of a leaking rank records (its blocks then carry their stacks)
    followup_steps: int = FOLLOWUP_STEPS
    _pending: dict[SeriesKey, list[_Pending]] = field(default_factory=dict)
    #: (series, trigger) -> when it last asked: one automatic capture per rank and trigger per interval
    #: (a leak usually starts as a plateau break; its own capture must not wait 30 minutes behind it)
    _last_auto: dict[tuple[SeriesKey, str], float] = field(default_factory=dict)
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
                directive = Directive(_uuid.uuid4().hex, "capture", steps, trigger)
                queue.append(_Pending(directive, now))
                ids.append(directive.id)
        return ids

    def take(self, keys: Iterable[SeriesKey], now: float | None = None) -> list[Directive]:
        """Hand out (and forget) the directives waiting for these series."""
        now = time.time() if now is None else now
        out: list[Directive] = []
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


class SnapshotStore:
    """Snapshot files beside the database. Writes are atomic (temp file + rename)."""

    def __init__(self, folder: str | os.PathLike[str], *, max_snapshot_bytes: int = 64 * 2**20,
                 max_total_bytes: int = 2 * 2**30) -> None:
        self.folder = Path(folder)
        self.max_snapshot_bytes = max_snapshot_bytes
        self.max_total_bytes = max_total_bytes
        self._lock = threading.Lock()

    @classmethod
    def beside(cls, db_path: str, **kw: Any) -> SnapshotStore:
        return cls(str(db_path) + ".snapshots", **kw)

    def save(self, *, run: str, host: str, rank: int, step: int, trigger: str, directive: str | None,
             gz: bytes) -> SnapshotInfo:
        """Store one gzip-compressed pickle; raises :class:`SnapshotError` (413) past the cap."""
        if len(gz) > self.max_snapshot_bytes:
            raise SnapshotError("body", f"{len(gz)} bytes; at most {self.max_snapshot_bytes} per snapshot", 413)
        if gz[:2] != b"\x1f\x8b":
            raise SnapshotError("body", "not gzip data (upload the pickle gzip-compressed)", 415)
        info = SnapshotInfo(_uuid.uuid4().hex, run, host, rank, step, trigger, directive, time.time(), len(gz))
        with self._lock:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._evict(len(gz))
            for suffix, data in ((".pickle.gz", gz), (".json", json.dumps(asdict(info)).encode())):
                tmp = self.folder / f".{info.id}{suffix}.tmp"
                tmp.write_bytes(data)
                os.replace(tmp, self.folder / f"{info.id}{suffix}")
        return info

    def _infos(self) -> list[SnapshotInfo]:
        out = []
        if not self.folder.is_dir():
            return out
        for meta in self.folder.glob("*.json"):
            try:
                out.append(SnapshotInfo(**json.loads(meta.read_text())))
            except (OSError, ValueError, TypeError):
                continue  # a half-deleted or foreign file: not a snapshot
        return sorted(out, key=lambda i: i.ts)

    def _evict(self, incoming: int) -> None:
        infos = self._infos()
        total = sum(i.bytes for i in infos) + incoming
        for info in infos:
            if total <= self.max_total_bytes:
                break
            self.delete(info.id)
            total -= info.bytes

    def delete(self, snapshot_id: str) -> None:
        for suffix in (".pickle.gz", ".json"):
            try:
                (self.folder / f"{snapshot_id}{suffix}").unlink()
            except FileNotFoundError:
                pass

    def list(self, run: str | None = None) -> list[SnapshotInfo]:
        return [i for i in self._infos() if run is None or i.run == run]

    def open(self, snapshot_id: str) -> tuple[SnapshotInfo, Path]:
        """The snapshot's record and its gzip file; SnapshotError (404) when unknown."""
        if not _ID_RE.match(snapshot_id):
            raise SnapshotError("id", "not a snapshot id", 404)
        meta = self.folder / f"{snapshot_id}.json"
        try:
            info = SnapshotInfo(**json.loads(meta.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise SnapshotError("id", f"no snapshot {snapshot_id}", 404) from exc
        return info, self.folder / f"{snapshot_id}.pickle.gz"
