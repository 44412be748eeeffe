"""The fold of a run's life: per process an :class:`IncarnationRecord`, per rank a :class:`RankLife`
(see the package docstring). O(1) per sample, O(incarnations) memory per rank."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from vramwatch.causes import LastWords, last_words_of
from vramwatch.wire import Sample

#: Incarnations a rank keeps as records; past it the middle ones are summed into counts (a
#: rank crash-looping all night stays bounded: the first and the latest processes are kept).
MAX_INCARNATIONS = 256
#: suspected OOMs a rank keeps as records (the first and the latest); past it they are counted only
MAX_SUSPECTED = 64

_Key = tuple[float, int, int]  # (ts, step, seq): order of samples within one process


class Moment(NamedTuple):
    """A point in a rank's life: the step and the sample's own timestamp."""

    step: int
    ts: float


class SuspectedOom(NamedTuple):
    """An OOM suspected from device memory alone (no OOM counter: dcgm, nvidia-smi, a hook without
    the allocator's fields): the trend engine saw the process's memory vanish with the device near
    full (``near_full``) or at the top of a climb it followed as a leak (``top_of_climb``). A
    suspicion: a kill or a crash looks the same from the device, so it never counts as an OOM."""

    step: int
    ts: float
    used_before_bytes: int  # device used before it vanished
    used_after_bytes: int  # and after
    total_bytes: int | None  # the device's capacity, when measured
    reason: str  # near_full | top_of_climb

    @property
    def headroom_bytes(self) -> int | None:
        """What was left on the device before it vanished (capacity minus used), when measured."""
        return None if self.total_bytes is None else max(0, self.total_bytes - self.used_before_bytes)

    @classmethod
    def of(cls, event: Mapping[str, Any], ts: float) -> SuspectedOom:
        """From the trend engine's ``suspected_oom`` event (its fields) at the sample's ``ts``."""
        return cls(int(event["step"]), float(ts), int(event["used_before_bytes"]), int(event["used_after_bytes"]),
                   None if event.get("total_bytes") is None else int(event["total_bytes"]), str(event["reason"]))


#: a run's suspected OOMs kept outside a fold (the store's, ``Store.suspected_records``): per
#: (host, rank) the records kept (by time) and the count dropped past MAX_SUSPECTED
SuspectedRecords = Mapping[tuple[str, int], tuple[tuple[SuspectedOom, ...], int]]


class IncarnationRecord(NamedTuple):
    """What the fold keeps of one process. Equal for any order of the same samples.

    ``ooms`` is the process's OOM counter at its highest (the hook's counter counts up from 0
    in each process); ``oom_at`` is when it first showed that value (the latest OOM) and
    ``first_oom`` when it first showed 1. ``marked``: its source sends the hook's markers (an
    OOM counter or an end flag), so a stop without a clean close is a death.
    """

    incarnation: str
    first: Moment
    last: Moment
    exit: bool
    oom_marked: bool
    ooms: int
    oom_at: Moment | None
    first_oom: Moment | None
    marked: bool
    #: the step time the process's latest timed training sample measured (``step_time_s``): the
    #: interval its samples arrive at; None when its source sends none (imports, dcgm)
    interval_s: float | None = None
    #: its longest marked phase (a phase sample's ``step_time_s``: checkpoint, eval): the silence
    #: such a phase makes
    longest_phase_s: float | None = None
    #: what it said as it ended (its latest sample's); host memory then (:func:`~vramwatch.causes.killed_by`)
    last_words: LastWords | None = None
    host_available: int | None = None
    host_rss: int | None = None
    #: its latest sample opened a marked phase (``phase_open``) whose phase sample has not come
    in_phase: bool = False

    @property
    def pace_s(self) -> float | None:
        """Seconds per step over the process's life (its first to its latest sample), or None."""
        steps = self.last.step - self.first.step
        return (self.last.ts - self.first.ts) / steps if steps > 0 else None

    @property
    def cadence_s(self) -> float | None:
        """The interval its next sample is expected within: the slower of the latest measured step
        time and the lifetime pace (a sample every N steps arrives every N step times)."""
        known = [v for v in (self.interval_s, self.pace_s) if v is not None and v > 0]
        return max(known) if known else None

    @property
    def oom_is_last_word(self) -> bool:
        """Its latest sample is an OOM (sent from the observer, or the counter's latest rise)."""
        return self.oom_marked or (self.oom_at is not None and self.oom_at == self.last)


class _Process:
    """The fold's mutable state for one incarnation (see :class:`IncarnationRecord`). Moments are
    kept as flat fields, not key tuples: no allocation per sample, ~130 bytes per process."""

    __slots__ = ("exit", "first_oom", "first_seq", "first_step", "first_ts", "host_available", "host_rss",
                 "in_phase", "incarnation", "last_seq", "last_step", "last_ts", "last_words", "marked", "oom_at",
                 "oom_marked", "ooms", "phase_s", "step_key", "step_s")

    def __init__(self, incarnation: str, ts: float, step: int, seq: int) -> None:
        self.incarnation = incarnation
        self.first_step, self.first_ts, self.first_seq = step, ts, seq
        self.last_step, self.last_ts, self.last_seq = step, ts, seq
        self.exit = False
        self.oom_marked = False
        self.ooms = 0
        self.oom_at: _Key | None = None
        self.first_oom: _Key | None = None
        self.marked = False
        self.step_key: _Key | None = None  # the latest training sample that measured its step time
        self.step_s: float | None = None
        self.phase_s: float | None = None
        self.last_words: LastWords | None = None
        self.host_available = self.host_rss = None
        self.in_phase = False

    def feed(self, sample: Sample) -> None:
        step, ts, seq = sample["step"], sample["ts"], sample.get("seq") or 0
        took = sample.get("step_time_s")
        if took is not None:
            self._timed(took, sample["phase"] == "train", (ts, step, seq))
        last_ts = self.last_ts
        if ts > last_ts or (ts == last_ts and (step, seq) >= (self.last_step, self.last_seq)):
            self.last_step, self.last_ts, self.last_seq = step, ts, seq
            self.exit = bool(sample.get("exit"))
            self.oom_marked = bool(sample.get("oom_marked"))
            self.in_phase = bool(sample.get("phase_open"))
            self.last_words = last_words_of(sample)
            self.host_available, self.host_rss = sample.get("host_available_bytes"), sample.get("host_rss_bytes")
        elif (ts, step, seq) < (self.first_ts, self.first_step, self.first_seq):
            self.first_step, self.first_ts, self.first_seq = step, ts, seq
        count = sample.get("ooms")
        if sample.get("oom_marked"):
            count = max(count or 0, 1)  # a marked OOM counts even where the counter is not sent
        if count is not None:
            self.marked = True
            if count:
                self._oom(count, (ts, step, seq))
        elif sample.get("exit") or sample.get("last_words_type"):
            self.marked = True

    def _timed(self, took: float, train: bool, key: _Key) -> None:
        """A step's or a phase's duration: the latest step time, the longest phase (order-free)."""
        if train:
            if self.step_key is None or key > self.step_key:
                self.step_key, self.step_s = key, took
        elif self.phase_s is None or took > self.phase_s:
            self.phase_s = took

    def _oom(self, count: int, key: _Key) -> None:
        if count > self.ooms:
            self.ooms, self.oom_at = count, key
        elif count == self.ooms and self.oom_at is not None and key < self.oom_at:
            self.oom_at = key
        if self.first_oom is None or key < self.first_oom:
            self.first_oom = key

    def record(self) -> IncarnationRecord:
        return IncarnationRecord(
            self.incarnation, Moment(self.first_step, self.first_ts), Moment(self.last_step, self.last_ts), self.exit,
            self.oom_marked, self.ooms, None if self.oom_at is None else _moment(self.oom_at),
            None if self.first_oom is None else _moment(self.first_oom), self.marked, self.step_s, self.phase_s,
            self.last_words, self.host_available, self.host_rss, self.in_phase)


def _moment(key: _Key) -> Moment:
    return Moment(key[1], key[0])


def sample_key(sample: Sample) -> _Key:
    """Order of a sample within its process: its timestamp (the process's own clock), then the
    step, then ``seq``. The hook's end markers are sent last, so they sort last."""
    return (sample["ts"], sample["step"], sample.get("seq") or 0)


class RankLife:
    """The fold of one (run, host, rank): its incarnations' records. Not thread-safe (the
    collector feeds it under its live-state lock)."""

    __slots__ = ("_current", "_procs", "_suspected", "dropped", "dropped_deaths", "dropped_oom_ts", "dropped_ooms",
                 "dropped_suspected", "host", "rank")

    def __init__(self, host: str, rank: int) -> None:
        self.host, self.rank = host, rank
        # one process needs no dict (most ranks never restart: ~250 bytes less per series)
        self._procs: dict[str, _Process] | None = None
        self._current: _Process | None = None
        #: incarnations summed into counts past MAX_INCARNATIONS, their OOMs and their deaths
        self.dropped = self.dropped_ooms = self.dropped_deaths = 0
        #: the latest OOM among the dropped incarnations (their records are gone)
        self.dropped_oom_ts: float | None = None
        #: OOMs suspected from device memory (:meth:`suspect`), by time; those past MAX_SUSPECTED counted only
        self._suspected: list[SuspectedOom] | None = None
        self.dropped_suspected = 0

    def suspect(self, found: SuspectedOom) -> None:
        """Take an OOM the trend engine suspected on this rank (the one who reads samples through an
        engine tells the fold: the collector's live state, the incidents' tracker). Order-free and
        idempotent: kept by time, a second report of a kept moment changes nothing. O(kept)."""
        kept = self._suspected if self._suspected is not None else []
        if any(k.step == found.step and k.ts == found.ts for k in kept):
            return
        kept.append(found)
        kept.sort(key=lambda k: (k.ts, k.step))
        if len(kept) > MAX_SUSPECTED:
            del kept[1]  # the first and the latest stay
            self.dropped_suspected += 1
        self._suspected = kept

    def add_suspected(self, kept: Iterable[SuspectedOom], dropped: int) -> None:
        """Take suspected OOMs kept elsewhere (the store's, :meth:`suspect`'s bound) and the count
        they dropped: each as :meth:`suspect` takes it; of the two dropped counts the larger (the
        same reports counted once). Into an empty fold (a run not replayed) it is exact."""
        self.dropped_suspected = max(self.dropped_suspected, dropped)
        for found in kept:
            self.suspect(found)

    @property
    def suspected(self) -> tuple[SuspectedOom, ...]:
        """The suspected OOMs kept, by time."""
        return () if self._suspected is None else tuple(self._suspected)

    @property
    def suspected_ooms(self) -> int:
        """OOMs suspected on this rank from device memory: monotonic; never counted in :attr:`ooms`."""
        return self.dropped_suspected + (0 if self._suspected is None else len(self._suspected))

    def feed(self, sample: Sample) -> None:
        """Fold one sample in: O(1) (a dict look-up when the process changes)."""
        incarnation = sample.get("incarnation") or ""
        proc = self._current
        if proc is None or proc.incarnation != incarnation:
            proc = self._switch(incarnation, sample)
        proc.feed(sample)

    def _switch(self, incarnation: str, sample: Sample) -> _Process:
        if self._current is None:
            proc = self._current = _Process(incarnation, *sample_key(sample))
            return proc
        if self._procs is None:
            self._procs = {self._current.incarnation: self._current}
        proc = self._procs.get(incarnation)  # type: ignore[assignment]
        if proc is None:
            proc = self._procs[incarnation] = _Process(incarnation, *sample_key(sample))
            if len(self._procs) > MAX_INCARNATIONS:
                self._drop_one()
        self._current = proc
        return proc

    def _all(self) -> list[_Process]:
        if self._procs is not None:
            return list(self._procs.values())
        return [] if self._current is None else [self._current]

    def _drop_one(self) -> None:
        assert self._procs is not None
        ordered = sorted(self._procs.values(), key=lambda p: p.first_ts)
        gone = ordered[1]  # the oldest but the first: the first failure usually lies in the first
        del self._procs[gone.incarnation]
        record = gone.record()
        self.dropped += 1
        self.dropped_ooms += record.ooms
        if record.oom_at is not None and (self.dropped_oom_ts is None or record.oom_at.ts > self.dropped_oom_ts):
            self.dropped_oom_ts = record.oom_at.ts
        self.dropped_deaths += int(record.marked and not record.exit)

    def add_record(self, record: IncarnationRecord) -> None:
        """Take a record computed elsewhere (the store's summary of a finished run)."""
        proc = _Process(record.incarnation, record.first.ts, record.first.step, 0)
        proc.last_step, proc.last_ts = record.last.step, record.last.ts
        proc.exit, proc.oom_marked, proc.ooms, proc.marked = record.exit, record.oom_marked, record.ooms, record.marked
        proc.last_words, proc.host_available, proc.host_rss = record.last_words, record.host_available, record.host_rss
        proc.in_phase = record.in_phase
        proc.oom_at = None if record.oom_at is None else (record.oom_at.ts, record.oom_at.step, 0)
        proc.first_oom = None if record.first_oom is None else (record.first_oom.ts, record.first_oom.step, 0)
        proc.step_key = None if record.interval_s is None else (record.last.ts, record.last.step, 0)
        proc.step_s, proc.phase_s = record.interval_s, record.longest_phase_s
        procs = self._procs if self._procs is not None else {p.incarnation: p for p in self._all()}
        procs[record.incarnation] = proc
        self._procs, self._current = procs, proc

    def records(self) -> tuple[IncarnationRecord, ...]:
        """Incarnations in the order they started (first sample's time)."""
        return tuple(p.record() for p in sorted(self._all(), key=lambda p: (p.first_ts, p.first_step)))

    @property
    def ooms(self) -> int:
        """OOMs of every process of this rank: monotonic across restarts."""
        return self.dropped_ooms + sum(p.ooms for p in self._all())

    @property
    def last_oom_ts(self) -> float | None:
        """When this rank last ran out of memory (the sample's own ``ts``), any process; None
        before its first OOM. Order-independent like the records: an event's time, so an alert
        can judge "recent" without any history of the counter. O(incarnations)."""
        times = [p.oom_at[0] for p in self._all() if p.oom_at is not None]
        if self.dropped_oom_ts is not None:
            times.append(self.dropped_oom_ts)
        return max(times, default=None)

    @property
    def process_start_ts(self) -> float | None:
        """The first sample's ``ts`` of the latest process (None before any sample)."""
        procs = self._all()
        return max((p.first_ts, p.first_step) for p in procs)[0] if procs else None

    @property
    def restarts(self) -> int:
        """Processes after the first: monotonic."""
        return self.dropped + max(0, len(self._all()) - 1)

    @property
    def incarnation(self) -> str:
        """The latest process's id ("" before any sample)."""
        procs = self._all()
        return max(procs, key=lambda p: (p.first_ts, p.first_step)).incarnation if procs else ""


