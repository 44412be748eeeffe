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
from dataclasses import dataclass, field, replace
from typing import Any

from vramwatch.decisions.grid import declared_step
from vramwatch.decisions.memory import MemoryFold
from vramwatch.decisions.model import RankModelBuilder, folded_fields
from vramwatch.decisions.trials import MAX_TRIALS, Trial, note_event, record_oom
from vramwatch.engine import TrendEngine
from vramwatch.engine.blocks import keep_last
from vramwatch.errors import VramwatchError
from vramwatch.runlife import RunLife
from vramwatch.verdicts import headroom_bytes

#: Engine events a track keeps (the latest): readiness reads only the recent ones.
EVENTS_KEPT = 1000
#: Plateau-break causes that are the training loop itself; any other names a phase
#: (checkpoint, eval) whose peak the allocator kept: a re-level, not instability.
LOOP_CAUSES = frozenset({"allocated", "reserved", None})
_RESETS = frozenset({"leak", "fragmentation", "restart", "oom"})
#: Engine states in which a started plateau goes on holding.
HOLDING = frozenset({"plateau", "rising"})
#: Engine events kept as evidence for a later OOM's cause (trials.oom_cause).
_EVIDENCE_EVENTS = frozenset({"leak", "fragmentation"})


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
        if self.since is None or last_step is None or state not in HOLDING:
            return 0
        return max(0, last_step - self.since)


class SourceError(VramwatchError, ValueError):
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
    """Everything observed for one (run, host, rank), all incarnations together; each process
    is a :class:`~vramwatch.decisions.trials.Trial` of its batch setting (``log``)."""

    run: str
    host: str
    rank: int
    engine: TrendEngine = field(default_factory=TrendEngine)
    builder: RankModelBuilder = field(default_factory=RankModelBuilder)
    events: list[dict[str, Any]] = field(default_factory=list)  # the latest EVENTS_KEPT
    plateau: PlateauClock = field(default_factory=PlateauClock)
    trial: Trial | None = None  # the current process
    past: list[Trial] | None = None  # the earlier ones (the latest MAX_TRIALS - 1), made at the first restart
    started: int = 0  # processes seen (the next one's ordinal)
    ooms: int = 0  # OOMs seen (counter increments across incarnations)
    total_bytes: int | None = None
    peak_by_phase: dict[str, int] = field(default_factory=dict)  # allocator peak per phase kind
    need_by_phase: dict[str, int] = field(default_factory=dict)  # device need per phase kind
    memory: MemoryFold | None = None  # memory by category, peaks against seq_len: made by the first sample with one
    _last_ooms: int = 0
    _need_key: Any = None
    _need_peak: int = 0
    _need_alloc: int = 0

    @property
    def last_step(self) -> int | None:
        return self.trial.last_step if self.trial else None

    @property
    def last_ts(self) -> float | None:
        return self.trial.last_ts if self.trial else None

    @property
    def checkpoints_passed(self) -> int:
        """Checkpoints the current process passed (a checkpoint phase, then a training step without OOM)."""
        return self.trial.checkpoints_passed if self.trial else 0

    @property
    def min_headroom_bytes(self) -> int | None:
        """Worst headroom of the current process, any phase."""
        return self.trial.min_headroom_bytes if self.trial else None

    @property
    def min_headroom_phase(self) -> str | None:
        return self.trial.min_headroom_phase if self.trial else None

    def trials(self) -> list[Trial]:
        """The rank's processes, oldest first (the live objects: see :meth:`copy_trials`)."""
        return [*(self.past or ()), *((self.trial,) if self.trial else ())]

    def copy_trials(self) -> tuple[Trial, ...]:
        """Copies of the processes (a reader's snapshot; the track goes on changing its own), the
        current one's plateau as the clock reads it now."""
        copies = tuple(replace(t) for t in self.trials())
        if copies:
            now = copies[-1]
            now.plateau_steps = max(now.plateau_steps, self.plateau.held(now.last_step, self.engine.state))
        return copies

    def _begin(self, incarnation: Any, step: int, ts: float) -> Trial:
        if self.trial is not None:
            past = self.past if self.past is not None else []
            past.append(self.trial)
            if len(past) >= MAX_TRIALS:
                del past[0]
            self.past = past
        self.trial = Trial(incarnation, self.started, step, ts, step, ts)
        self.started += 1
        return self.trial

    def update(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        """Fold one sample in (O(1) beyond the engine's own update); returns the engine's new events.
        Written for the common sample (same process, a training step, nothing new): a few compares."""
        engine = self.engine
        state_before = engine.state
        new = engine.update(sample)
        incarnation, ooms, peak, allocated, reserved, used = folded_fields(sample)
        step, ts = sample["step"], sample["ts"]
        trial = self.trial
        if trial is None or incarnation != trial.incarnation:
            trial = self._new_process(incarnation, step, ts, state_before)
            trial.marked = ooms is not None  # its source sends the hook's OOM counter
        # sparse samples (schema 2: dcgm, nvidia-smi, imports) fold in too: the builder skips what
        # it cannot split (no allocated/peak), headroom is judged on whatever level was measured
        phase = sample["phase"]
        self.builder.fold(sample, phase, incarnation, ooms, peak, allocated, reserved, used)
        memory = self.memory
        if memory is not None or MemoryFold.wanted(sample):
            if memory is None:
                memory = self.memory = MemoryFold()
            memory.fold(sample)
        trial.last_step, trial.last_ts = step, ts
        if new:
            self._events(trial, new)
        tokens = None
        if phase == "train":
            kind = phase
            tokens = sample.get("tokens")
            if tokens:
                if trial.tokens is None or tokens > trial.tokens:
                    trial.tokens = tokens
                if trial.tokens_min is None or tokens < trial.tokens_min:
                    trial.tokens_min = tokens
            extra = sample.get("extra")
            if extra:
                trial.grid = declared_step(extra) or trial.grid
            if trial.pending_checkpoint:
                trial.checkpoints_passed += 1
                trial.pending_checkpoint = False
        else:
            kind = phase_kind(phase)
            if kind == "checkpoint":
                trial.pending_checkpoint = True
        # None: not measured (sparse sources), never an OOM
        if ooms is not None and ooms != self._last_ooms:
            if ooms > self._last_ooms:
                self.ooms += ooms - self._last_ooms
                record_oom(trial, list(self.past or ()), step, ts, phase, tokens, state_before)
            self._last_ooms = ooms
        if sample.get("exit"):
            trial.marked = trial.exited = True
        total = sample["total_bytes"]
        if total and total != trial.total_bytes:
            self.total_bytes = trial.total_bytes = total
        key = (kind, reserved, used, total)
        if (key != self._need_key or peak is None or allocated is None or peak > self._need_peak
                or allocated > self._need_alloc):
            # the device need is monotone in peak and allocated at equal reserved/used: a sample of
            # a plateau under both is neither the new worst headroom nor a new phase peak (most are)
            self._headroom(trial, key, peak, allocated)
        return new

    def _new_process(self, incarnation: Any, step: int, ts: float, state_before: str) -> Trial:
        """A new process: its batch, plateau, checkpoints and worst headroom are its own. The one
        ending keeps the longest its plateau held; when healthy it sets the floor a restarted
        process warms up to (the model's)."""
        old = self.trial
        if old is not None:
            self._hold_until(old, old.last_step, state_before)  # the clock has not heard of the restart yet
            if old.oom is None and old.leak is None and old.fragmentation_step is None:
                self.builder.settle()  # before the builder starts the new process
        self._last_ooms, self._need_key = 0, None
        return self._begin(incarnation, step, ts)

    def _events(self, trial: Trial, new: list[dict[str, Any]]) -> None:
        for event in new:
            keep_last(self.events, event, EVENTS_KEPT)
            if self.plateau.since is not None:  # the held plateau may end here: keep how long it held
                self._hold_until(trial, event["step"], "plateau")
            self.plateau.feed(event)
            if event["type"] in _EVIDENCE_EVENTS:
                note_event(trial, event)

    def _hold_until(self, trial: Trial, step: int | None, state: str) -> None:
        """``trial.plateau_steps``: the longest the plateau held, kept when the clock may stop (not
        per sample: the clock's own reading is the current process's, :meth:`copy_trials`)."""
        held = self.plateau.held(step, state)
        if held > trial.plateau_steps:
            trial.plateau_steps = held

    def _headroom(self, trial: Trial, key: tuple[str, int | None, int | None, int], peak: int | None,
                  allocated: int | None) -> None:
        """The process's worst headroom and the run's device need and peak per phase kind."""
        kind, reserved, used, total = key
        if peak is None or allocated is None:
            # a sparse sample (device used only, or no per-step peak): judge what it measured
            headroom = headroom_bytes(total, allocated=allocated, reserved=reserved, peak=peak, nvml_used=used)
        else:
            if key != self._need_key:
                self._need_key, self._need_peak, self._need_alloc = key, peak, allocated
            else:
                self._need_peak, self._need_alloc = max(peak, self._need_peak), max(allocated, self._need_alloc)
            headroom = headroom_bytes(total, allocated=allocated, reserved=reserved, peak=peak, nvml_used=used)
        if headroom is not None:
            if trial.min_headroom_bytes is None or headroom < trial.min_headroom_bytes:
                trial.min_headroom_bytes, trial.min_headroom_phase = headroom, kind
            need = total - headroom  # what the device held (verdicts.device_need_bytes)
            if need > self.need_by_phase.get(kind, -1):
                self.need_by_phase[kind] = need
        if peak is not None and peak > self.peak_by_phase.get(kind, -1):
            self.peak_by_phase[kind] = peak


@dataclass
class RunObservation:
    run: str
    ranks: dict[tuple[str, int], RankTrack] = field(default_factory=dict)
    samples: int = 0
    #: the run-life model's fold of the same samples (vramwatch.runlife): how each process ended,
    #: OOMs, restarts and deaths per rank, as every view reads them
    life: RunLife | None = None

    def __post_init__(self) -> None:
        if self.life is None:
            self.life = RunLife(self.run)

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
        obs.life.feed(sample)  # type: ignore[union-attr]
        obs.samples += 1
    return runs


__all__ = ["LOOP_CAUSES", "PlateauClock", "RankTrack", "RunObservation", "SourceError", "observe", "phase_kind"]
