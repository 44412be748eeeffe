"""One pass over a run's samples: per rank a trend engine, a memory-model builder and the figures
that readiness, advice and compare read (checkpoints passed, OOMs, worst headroom, peaks per phase).

Sources are the database (:func:`observe_db`, read-only) and trace files
(:func:`observe_files`); both yield the same :class:`RunObservation`. Cost: one
``TrendEngine.update`` plus O(1) bookkeeping per sample; memory is bounded by ranks,
phases and token buckets, except the engine events, which are kept in full (a run raises
tens to hundreds, not millions).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vramwatch.engine import TrendEngine
from vramwatch.verdicts import device_need_bytes, headroom_bytes

from .model import RankModelBuilder


class SourceError(ValueError):
    """A run or trace that cannot be read; the message names it (CLI: exit 2, HTTP: 404/422)."""


def phase_kind(phase: str) -> str:
    """``train``, ``checkpoint``, ``eval`` or the phase's own name (usual spellings folded)."""
    lowered = phase.lower()
    if lowered == "train":
        return "train"
    if lowered.startswith(("checkpoint", "ckpt", "save")):
        return "checkpoint"
    if lowered.startswith(("eval", "val", "test")):
        return "eval"
    return lowered


@dataclass
class RankTrack:
    """Everything observed for one (run, host, rank), all incarnations together."""

    run: str
    host: str
    rank: int
    engine: TrendEngine = field(default_factory=TrendEngine)
    builder: RankModelBuilder = field(default_factory=RankModelBuilder)
    events: list[dict[str, Any]] = field(default_factory=list)
    ooms: int = 0  # OOMs seen (counter increments across incarnations)
    checkpoints_passed: int = 0  # checkpoint phases followed by a train step without OOM
    last_step: int | None = None
    total_bytes: int | None = None
    min_headroom_bytes: int | None = None  # worst, over the latest process, any phase
    min_headroom_phase: str | None = None
    peak_by_phase: dict[str, int] = field(default_factory=dict)  # allocator peak per phase kind
    need_by_phase: dict[str, int] = field(default_factory=dict)  # device need per phase kind
    _pending_checkpoint: bool = False
    _last_ooms: int = 0
    _incarnation: Any = None

    def update(self, sample: dict[str, Any]) -> None:
        """Fold one sample in (O(1) beyond the engine's own update)."""
        self.events.extend(self.engine.update(sample))
        self.builder.update(sample)
        incarnation = sample.get("incarnation", "")
        if incarnation != self._incarnation:
            # a new process: the worst headroom is judged on the process running now
            self._incarnation, self._last_ooms = incarnation, 0
            self.min_headroom_bytes = self.min_headroom_phase = None
            self._pending_checkpoint = False
        ooms = sample["ooms"]
        if ooms > self._last_ooms:
            self.ooms += ooms - self._last_ooms
            self._pending_checkpoint = False
        self._last_ooms = ooms
        kind = phase_kind(sample["phase"])
        if kind == "train" and self._pending_checkpoint:
            self.checkpoints_passed += 1
            self._pending_checkpoint = False
        elif kind == "checkpoint":
            self._pending_checkpoint = True
        self.last_step = sample["step"]
        self.total_bytes = sample["total_bytes"] or self.total_bytes
        measured = {"allocated": sample["allocated_bytes"], "reserved": sample["reserved_bytes"],
                    "peak": sample["peak_allocated_bytes"], "nvml_used": sample.get("nvml_used_bytes")}
        headroom = headroom_bytes(sample["total_bytes"], **measured)
        if headroom is not None and (self.min_headroom_bytes is None or headroom < self.min_headroom_bytes):
            self.min_headroom_bytes, self.min_headroom_phase = headroom, kind
        need = device_need_bytes(**measured) or 0
        self.need_by_phase[kind] = max(self.need_by_phase.get(kind, 0), need)
        self.peak_by_phase[kind] = max(self.peak_by_phase.get(kind, 0), sample["peak_allocated_bytes"])


@dataclass
class RunObservation:
    run: str
    ranks: dict[tuple[str, int], RankTrack] = field(default_factory=dict)
    samples: int = 0

    def tracks(self) -> list[RankTrack]:
        return [self.ranks[k] for k in sorted(self.ranks, key=lambda k: (k[1], k[0]))]

    @property
    def world_size(self) -> int:
        sizes = [t.builder.world_size for t in self.ranks.values() if t.builder.world_size]
        return max(sizes) if sizes else len({t.rank for t in self.ranks.values()})


def observe(samples: Iterable[dict[str, Any]]) -> dict[str, RunObservation]:
    """Fold samples (per series in step order, as the store and the hook produce them) by run."""
    runs: dict[str, RunObservation] = {}
    for sample in samples:
        run = sample["run"]
        obs = runs.get(run)
        if obs is None:
            obs = runs[run] = RunObservation(run)
        key = (sample["host"], sample["rank"])
        track = obs.ranks.get(key)
        if track is None:
            track = obs.ranks[key] = RankTrack(run, sample["host"], sample["rank"])
        track.update(sample)
        obs.samples += 1
    return runs


def observe_db(db_path: str, run: str) -> RunObservation:
    """A stored run, read through a read-only Store (never writes)."""
    from vramwatch.collector.store import Store, StoreError

    if not os.path.exists(db_path):
        raise SourceError(f"no database at {db_path}")
    try:
        store = Store(db_path, readonly=True)
    except StoreError as exc:
        raise SourceError(str(exc)) from None
    try:
        if run not in store.runs():
            raise SourceError(f"no run named {run!r} in {db_path}")
        return observe(store.iter_samples(run))[run]
    finally:
        store.close()


def observe_files(paths: Iterable[str]) -> RunObservation:
    """Trace files (.jsonl / .jsonl.gz) holding one run; several runs in them is an error."""
    from vramwatch.wire import WireError, iter_samples

    def samples() -> Iterable[dict[str, Any]]:
        for path in paths:
            if not os.path.isfile(path):
                raise SourceError(f"cannot read {path}: no such file")
            try:
                yield from iter_samples(path)
            except WireError as exc:
                raise SourceError(str(exc)) from None
            except (OSError, EOFError, UnicodeDecodeError) as exc:
                raise SourceError(f"cannot read {path}: {exc}") from None

    runs = observe(samples())
    if not runs:
        raise SourceError("no samples in " + ", ".join(paths))
    if len(runs) > 1:
        raise SourceError(f"traces hold several runs ({', '.join(sorted(runs))}); give one run's files")
    return next(iter(runs.values()))


def resolve(source: str, db_path: str | None) -> RunObservation:
    """A run name in the database, or a trace file, or comma-separated trace files."""
    parts = [p for p in source.split(",") if p]
    if parts and all(os.path.isfile(p) for p in parts):
        return observe_files(parts)
    if db_path is None:
        raise SourceError(f"{source!r} is neither a trace file nor a run (no database given)")
    return observe_db(db_path, source)


__all__ = ["RankTrack", "RunObservation", "SourceError", "observe", "observe_db", "observe_files", "phase_kind",
           "resolve"]
