"""One pass over a run's samples: per rank a trend engine, a memory-model builder and the figures
that readiness, advice and compare read (checkpoints passed, OOMs, worst headroom, peaks per phase).

Sources (the database, read-only, or trace files: ``vramwatch.cli.decisions``) both yield the
same :class:`RunObservation`. Cost: one
``TrendEngine.update`` plus O(1) bookkeeping per sample; memory is bounded by ranks,
phases and token buckets, except the engine events, which are kept in full (a run raises
tens to hundreds; the latest :data:`EVENTS_KEPT` are kept).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vramwatch.engine import TrendEngine
from vramwatch.engine.blocks import keep_last
from vramwatch.verdicts import headroom_bytes

from .model import RankModelBuilder, folded_fields

#: Engine events a track keeps (the latest): readiness reads only the recent ones.
EVENTS_KEPT = 1000
#: Plateau-break causes that are the training loop itself; any other names a phase
#: (checkpoint, eval) whose peak the allocator kept: a re-level, not instability.
LOOP_CAUSES = frozenset({"allocated", "reserved", None})
_RESETS = frozenset({"leak", "fragmentation", "restart", "oom"})


class PlateauClock:
    """Since when the current plateau has held, from engine events fed in order (O(1) each).

    A ``plateau`` event starts the clock; a break caused by a marked phase (a checkpoint
    ratchet) does not stop it; a break of the loop itself, a leak, fragmentation, a
    restart or an OOM does.
    """

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: int | None = None

    def feed(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "plateau" and self.since is None:
            self.since = event["step"]
        elif (kind == "plateau_break" and event.get("cause") in LOOP_CAUSES) or kind in _RESETS:
            self.since = None

    def held(self, last_step: int | None, state: str) -> int:
        if self.since is None or last_step is None or state not in ("plateau", "rising"):
            return 0
        return max(0, last_step - self.since)


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


@dataclass(slots=True)
class RankTrack:
    """Everything observed for one (run, host, rank), all incarnations together."""

    run: str
    host: str
    rank: int
    engine: TrendEngine = field(default_factory=TrendEngine)
    builder: RankModelBuilder = field(default_factory=RankModelBuilder)
    events: list[dict[str, Any]] = field(default_factory=list)  # the latest EVENTS_KEPT
    plateau: PlateauClock = field(default_factory=PlateauClock)
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
    _need_key: Any = None
    _need_peak: int = 0
    _need_alloc: int = 0

    def update(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        """Fold one sample in (O(1) beyond the engine's own update); returns the engine's new events."""
        new = self.engine.update(sample)
        if new:
            for event in new:
                keep_last(self.events, event, EVENTS_KEPT)
                self.plateau.feed(event)
        incarnation, ooms, peak, allocated, reserved, used = folded_fields(sample)
        # sparse samples (schema 2: dcgm, nvidia-smi, imports) fold in too: the builder skips what
        # it cannot split (no allocated/peak), headroom is judged on whatever level was measured
        self.builder.fold(sample, incarnation, ooms, peak, allocated, reserved, used)
        if incarnation != self._incarnation:
            # a new process: the worst headroom is judged on the process running now
            self._incarnation, self._last_ooms = incarnation, 0
            self.min_headroom_bytes = self.min_headroom_phase = None
            self._pending_checkpoint = False
        if ooms is not None:  # None: not measured (sparse sources), never an OOM
            if ooms > self._last_ooms:
                self.ooms += ooms - self._last_ooms
                self._pending_checkpoint = False
            self._last_ooms = ooms
        phase = sample["phase"]
        kind = "train" if phase == "train" else phase_kind(phase)
        if kind == "train":
            if self._pending_checkpoint:
                self.checkpoints_passed += 1
                self._pending_checkpoint = False
        elif kind == "checkpoint":
            self._pending_checkpoint = True
        self.last_step = sample["step"]
        total = sample["total_bytes"]
        self.total_bytes = total or self.total_bytes
        key = (kind, reserved, used, total)
        if peak is None or allocated is None:
            # a sparse sample (device used only, or no per-step peak): judge what it measured
            headroom = headroom_bytes(total, allocated=allocated, reserved=reserved, peak=peak, nvml_used=used)
        elif key == self._need_key and peak <= self._need_peak and allocated <= self._need_alloc:
            # the device need is monotone in peak and allocated at equal reserved/used: this
            # sample cannot be the new worst (skips most samples of a plateau); nor a new phase
            # peak: _need_peak is a peak of this kind, so peak_by_phase[kind] >= it
            return new
        else:
            if key != self._need_key:
                self._need_key, self._need_peak, self._need_alloc = key, peak, allocated
            else:
                self._need_peak, self._need_alloc = max(peak, self._need_peak), max(allocated, self._need_alloc)
            headroom = headroom_bytes(total, allocated=allocated, reserved=reserved, peak=peak, nvml_used=used)
        if headroom is not None:
            if self.min_headroom_bytes is None or headroom < self.min_headroom_bytes:
                self.min_headroom_bytes, self.min_headroom_phase = headroom, kind
            need = total - headroom  # what the device held (verdicts.device_need_bytes)
            if need > self.need_by_phase.get(kind, -1):
                self.need_by_phase[kind] = need
        if peak is not None and peak > self.peak_by_phase.get(kind, -1):
            self.peak_by_phase[kind] = peak
        return new


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


__all__ = ["LOOP_CAUSES", "PlateauClock", "RankTrack", "RunObservation", "SourceError", "observe", "phase_kind"]
