"""One model of a run's life: ranks, their processes, how each process ended, and what that
makes of a rank (liveness, ``died``) and of the run (status). Every view reads it.

A run has ranks; a rank has incarnations (one per process: the samples' ``incarnation``);
each incarnation has a start, an end (its latest sample) and an outcome
(:class:`~vramwatch.verdicts.Outcome`, names and meanings defined once in
:mod:`vramwatch.verdicts`):

* ``exited``: its latest sample is the hook's clean-close marker (``exit: true``);
* ``oom``: an out-of-memory error is its last word (the OOM counter's latest rise, or a sample
  sent from the OOM observer, is its latest sample);
* ``killed``: killed alone: it stopped while a process of another rank that was already running
  went on for longer than its rank's silence window after it (:func:`rank_window`: a multiple of
  its own step time within a floor and a ceiling, :func:`vramwatch.verdicts.silence_window`);
* ``stopped``: stopped with the job: it ended (a newer process of its rank started, or the whole
  run has been quiet for the silence window) and no peer went on without it;
* ``ended``: the same, for a source that marks neither clean closes nor OOMs (imports, dcgm);
* ``running``: none of these yet.

A rank's liveness is its latest incarnation's outcome (``live``/``silent`` while running,
``exited``, ``dead`` for the three deaths, ``ended``); the run's status follows from its ranks
(:meth:`RunTally.status`).

Two parts, so that every path builds the same story:

* **the fold** (:class:`RankLife`, :class:`RunLife`): fed samples one by one. Per incarnation it
  keeps an :class:`IncarnationRecord` (first and latest moment, end markers, OOM count and
  moments) whose value does not depend on the order samples arrive in or on duplicates: live
  ingest (arrival order, resends, spool replays), the start-up replay (store order) and
  ``import`` build equal records. O(1) per sample, O(incarnations) memory per rank.
* **the judgement** (:func:`judge`): a pure function of the records and an explicit ``now``
  returning a :class:`RunStory`. Every judgement uses the samples' own timestamps (``ts``), so a
  death judged once is judged the same after a restart: peers' latest samples only grow, and a
  later ``now`` only ends more. O(n log n) in the run's incarnations.

Clocks: ``now`` is compared with the ranks' ``ts``; the windows are minutes, so hosts need their
clocks within seconds of the collector's (NTP), as the post-mortem always assumed.

Records are immutable: the per-rank ones are typed named tuples (a judgement builds a few per
rank: ~1 µs each, against ~10 µs for a frozen dataclass), the per-run ones frozen dataclasses.

A process whose latest sample carries last words died at once of what :mod:`vramwatch.causes`
says they name. A rank that failed on its own at or before other ranks' collective timeouts is
the culprit (:attr:`Failure.victims`); those ranks are its victims (``Death.culprit``).

Low layer: imports only :mod:`vramwatch.causes`, :mod:`vramwatch.verdicts` and :mod:`vramwatch.wire`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from vramwatch.causes import LastWords, classify, killed_by, last_words_of
from vramwatch.verdicts import (
    DEATHS,
    OWN_FAILURES,
    RUN_ACTIVE_S,
    SILENT_AFTER_S,
    Liveness,
    Outcome,
    RunStatus,
    silence_window,
)
from vramwatch.wire import Sample

#: Incarnations a rank keeps as records; past it the middle ones are summed into counts (a
#: rank crash-looping all night stays bounded: the first and the latest processes are kept).
MAX_INCARNATIONS = 256

_Key = tuple[float, int, int]  # (ts, step, seq): order of samples within one process


class Moment(NamedTuple):
    """A point in a rank's life: the step and the sample's own timestamp."""

    step: int
    ts: float


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
                 "incarnation", "last_seq", "last_step", "last_ts", "last_words", "marked", "oom_at", "oom_marked",
                 "ooms", "phase_s", "step_key", "step_s")

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
            self.last_words, self.host_available, self.host_rss)


def _moment(key: _Key) -> Moment:
    return Moment(key[1], key[0])


def sample_key(sample: Sample) -> _Key:
    """Order of a sample within its process: its timestamp (the process's own clock), then the
    step, then ``seq``. The hook's end markers are sent last, so they sort last."""
    return (sample["ts"], sample["step"], sample.get("seq") or 0)


class RankLife:
    """The fold of one (run, host, rank): its incarnations' records. Not thread-safe (the
    collector feeds it under its live-state lock)."""

    __slots__ = ("_current", "_procs", "dropped", "dropped_deaths", "dropped_oom_ts", "dropped_ooms", "host", "rank")

    def __init__(self, host: str, rank: int) -> None:
        self.host, self.rank = host, rank
        # one process needs no dict (most ranks never restart: ~250 bytes less per series)
        self._procs: dict[str, _Process] | None = None
        self._current: _Process | None = None
        #: incarnations summed into counts past MAX_INCARNATIONS, their OOMs and their deaths
        self.dropped = self.dropped_ooms = self.dropped_deaths = 0
        #: the latest OOM among the dropped incarnations (their records are gone)
        self.dropped_oom_ts: float | None = None

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


# ---------------------------------------------------------------- the judgement


class Incarnation(NamedTuple):
    """One process with its judged outcome."""

    record: IncarnationRecord
    outcome: Outcome

    @property
    def start(self) -> Moment:
        return self.record.first

    @property
    def end(self) -> Moment:
        """When it ended (its latest sample; for an OOM, the OOM)."""
        if self.outcome == Outcome.OOM and self.record.oom_at is not None:
            return self.record.oom_at
        return self.record.last


class Death(NamedTuple):
    """How and when a rank's latest process died (``died`` in the API), and what it said."""

    cause: Outcome  # one of verdicts.DEATHS
    step: int
    ts: float
    last_words: LastWords | None = None
    #: for ``killed``: "host_oom" (the host's memory shows its OOM killer) or "launcher"; None: unknown
    killed_by: str | None = None
    #: for a victim (a collective timeout after another rank failed on its own): that rank
    culprit: tuple[str, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"cause": str(self.cause), "step": self.step, "ts": self.ts,
                "last_words": None if self.last_words is None else self.last_words.as_dict(),
                "killed_by": self.killed_by,
                "culprit": None if self.culprit is None else {"host": self.culprit[0], "rank": self.culprit[1]}}


@dataclass(frozen=True, slots=True)
class Failure:
    """A process that failed: an OOM (fatal or not) or a death, at that moment, with its last words.
    As a run's first failure: ``victims`` are the ranks that then died timing out in a collective."""

    host: str
    rank: int
    step: int
    ts: float
    cause: Outcome
    last_words: LastWords | None = None
    victims: tuple[tuple[str, int], ...] = ()


class RankStory(NamedTuple):
    """One rank judged: its liveness, processes, counts, and its death if its latest process died."""

    host: str
    rank: int
    liveness: Liveness
    incarnations: tuple[Incarnation, ...]
    died: Death | None
    ooms: int  # every process's OOMs (monotonic)
    restarts: int  # processes after the first (monotonic)
    deaths: int  # processes that died (oom, killed, stopped), the latest included
    #: how long it may stay quiet before it reads silent (and, quiet with its whole run, stopped):
    #: :func:`~vramwatch.verdicts.silence_window` of its own cadence and phases
    window_s: float = SILENT_AFTER_S
    #: the interval its samples are expected at (:attr:`IncarnationRecord.cadence_s`), or None
    cadence_s: float | None = None

    @property
    def current(self) -> Incarnation:
        return self.incarnations[-1]

    @property
    def outcome(self) -> Outcome:
        """How its latest process ended (``running`` while it runs)."""
        return self.current.outcome

    @property
    def ended(self) -> bool:
        """No process of this rank runs any more (exited, dead or ended)."""
        return self.liveness not in (Liveness.LIVE, Liveness.SILENT)


@dataclass(frozen=True, slots=True)
class RunTally:
    """Counts a run's status follows from; parts (shards of one run) add up to the whole."""

    ranks: int = 0
    live: int = 0
    silent: int = 0
    exited: int = 0
    dead: int = 0
    ended: int = 0
    ooms: int = 0
    restarts: int = 0
    deaths: int = 0

    @property
    def status(self) -> RunStatus:
        """``running`` while a rank is live or silent; then ``crashed`` if a rank's latest process
        died; ``recovered`` if an earlier one died or an OOM was survived; ``ended`` if a rank's
        source cannot tell; else ``finished``."""
        if self.live or self.silent:
            return RunStatus.RUNNING
        if self.dead:
            return RunStatus.CRASHED
        if self.deaths or self.ooms:
            return RunStatus.RECOVERED
        if self.ended:
            return RunStatus.ENDED
        return RunStatus.FINISHED

    def __add__(self, other: RunTally) -> RunTally:
        return RunTally(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[int, ...]:
        return (self.ranks, self.live, self.silent, self.exited, self.dead, self.ended, self.ooms, self.restarts,
                self.deaths)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(_TALLY_FIELDS, self.as_tuple(), strict=True))

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> RunTally:
        """From :meth:`as_dict` (missing counts are 0; a non-integer is a ValueError)."""
        return cls(*(int(doc.get(name) or 0) for name in _TALLY_FIELDS))

    @classmethod
    def of(cls, ranks: Iterable[RankStory]) -> RunTally:
        counts = dict.fromkeys(_TALLY_FIELDS, 0)
        for r in ranks:
            counts["ranks"] += 1
            counts[str(r.liveness)] += 1
            counts["ooms"] += r.ooms
            counts["restarts"] += r.restarts
            counts["deaths"] += r.deaths
        return cls(**counts)


_TALLY_FIELDS = ("ranks", "live", "silent", "exited", "dead", "ended", "ooms", "restarts", "deaths")


@dataclass(frozen=True, slots=True)
class RunStory:
    """A run judged at ``now``: every rank's story, the counts and status, the first failure."""

    run: str
    now: float
    ranks: tuple[RankStory, ...]  # by (rank, host)
    tally: RunTally
    last: Moment | None  # the run's latest sample (by time)
    first_failure: Failure | None

    @property
    def status(self) -> RunStatus:
        return self.tally.status

    def rank(self, host: str, rank: int) -> RankStory | None:
        """One rank's story: O(ranks); for many look-ups, :meth:`index`."""
        for story in self.ranks:
            if story.rank == rank and story.host == host:
                return story
        return None

    def index(self) -> dict[tuple[str, int], RankStory]:
        """Every rank's story by (host, rank): O(ranks) once."""
        return {(r.host, r.rank): r for r in self.ranks}


class _Peers:
    """Which processes went on after a moment: the latest end among processes started by then.
    Built once per judgement, O(n log n); each question O(log n)."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        spans.sort()
        self.starts = [s for s, _ in spans]
        self.went_on: list[float] = []
        best = float("-inf")
        for _, end in spans:
            best = max(best, end)
            self.went_on.append(best)

    def latest_end_of_started_by(self, ts: float) -> float:
        i = bisect.bisect_right(self.starts, ts)
        return self.went_on[i - 1] if i else float("-inf")


def _outcome(rec: IncarnationRecord, *, superseded: bool, peers: _Peers, run_quiet: bool, window: float
             ) -> Outcome:
    if rec.exit:
        return Outcome.EXITED
    if rec.last_words is not None:
        return classify(rec.last_words)  # it said how it ended: no need to wait for silence
    if rec.oom_is_last_word:
        return Outcome.OOM
    killed_alone = peers.latest_end_of_started_by(rec.last.ts) - rec.last.ts > window
    if not (superseded or killed_alone or run_quiet):
        return Outcome.RUNNING
    if not rec.marked:
        return Outcome.ENDED
    return Outcome.KILLED if killed_alone else Outcome.STOPPED


_LIVENESS = {Outcome.EXITED: Liveness.EXITED, Outcome.ENDED: Liveness.ENDED,
             **dict.fromkeys(DEATHS, Liveness.DEAD)}


def rank_window(records: tuple[IncarnationRecord, ...], fixed: float | None = None) -> float:
    """A rank's silence window: ``fixed`` when asked for one, else from its latest process's
    cadence and the longest phase any of its processes marked (a restart keeps the knowledge)."""
    if fixed is not None:
        return fixed
    phases = [rec.longest_phase_s for rec in records if rec.longest_phase_s is not None]
    return silence_window(records[-1].cadence_s, max(phases) if phases else None)


def _rank_story(life: RankLife, records: tuple[IncarnationRecord, ...], peers: _Peers, *, now: float,
                run_last: float, window: float, run_window: float) -> RankStory:
    run_quiet = now - run_last > run_window
    judged = tuple(
        Incarnation(rec, _outcome(rec, superseded=i < len(records) - 1, peers=peers, run_quiet=run_quiet,
                                  window=window))
        for i, rec in enumerate(records))
    current = judged[-1]
    if current.outcome == Outcome.RUNNING:
        quiet = now - current.record.last.ts > window and now - run_last < RUN_ACTIVE_S
        liveness = Liveness.SILENT if quiet else Liveness.LIVE
    else:
        liveness = _LIVENESS[current.outcome]
    died = None
    if current.outcome in DEATHS:
        end, rec = current.end, current.record
        by = killed_by(rec.host_available, rec.host_rss) if current.outcome == Outcome.KILLED else None
        died = Death(current.outcome, end.step, end.ts, rec.last_words, by)
    deaths = life.dropped_deaths + sum(1 for inc in judged if inc.outcome in DEATHS)
    return RankStory(life.host, life.rank, liveness, judged, died, life.ooms, life.restarts, deaths, window,
                     records[-1].cadence_s)


def _failures(story: RankStory) -> Iterator[Failure]:
    for inc in story.incarnations:
        first_oom = inc.record.first_oom
        if first_oom is not None:  # its words, when they are the OOM's (the OOM killed it)
            said = inc.record.last_words if inc.outcome == Outcome.OOM else None
            yield Failure(story.host, story.rank, first_oom.step, first_oom.ts, Outcome.OOM, said)
        elif inc.outcome in DEATHS:
            yield Failure(story.host, story.rank, inc.end.step, inc.end.ts, inc.outcome, inc.record.last_words)


def first_failure(ranks: Iterable[RankStory]) -> Failure | None:
    """The earliest OOM or death of any process. A process stopped with the job is a victim, not a
    cause: its latest sample comes before the failure that stopped it (it hung in the next
    collective), so it is named only when nothing else failed. A collective timeout at or after a
    rank's own failure (:data:`~vramwatch.verdicts.OWN_FAILURES`) is that failure's victim, never
    the first failure; the culprit lists its victims. An OOM wins a tie."""
    found = [f for story in ranks for f in _failures(story)]
    own = min((f.ts for f in found if f.cause in OWN_FAILURES), default=float("inf"))
    victims = {(f.rank, f.host) for f in found if f.cause == Outcome.COLLECTIVE_TIMEOUT and own <= f.ts}
    first = min(found, default=None, key=lambda f: (f.cause == Outcome.STOPPED, (f.rank, f.host) in victims, f.ts,
                                                    f.cause != Outcome.OOM, f.rank, f.host))
    if first is None or first.cause not in OWN_FAILURES:
        return first
    return replace(first, victims=tuple((h, r) for r, h in sorted(victims) if (h, r) != (first.host, first.rank)))


def _with_culprit(stories: tuple[RankStory, ...], first: Failure | None) -> tuple[RankStory, ...]:
    """Mark the victims' deaths with their culprit (the first failure's rank)."""
    if first is None or not first.victims:
        return stories
    victims, culprit = set(first.victims), (first.host, first.rank)
    return tuple(s._replace(died=s.died._replace(culprit=culprit))
                 if s.died is not None and s.died.cause == Outcome.COLLECTIVE_TIMEOUT and (s.host, s.rank) in victims
                 else s for s in stories)


def judge(run: str, ranks: Iterable[RankLife], now: float, *, silent_after_s: float | None = None,
          stopped: bool = False) -> RunStory:
    """The run's story at ``now`` from its ranks' folds. Pure: the same records and ``now`` give
    the same story. Ranks without a sample are left out. O(n log n) in incarnations.

    ``silent_after_s``: one silence window for every rank (``vramwatch postmortem --silent-after``);
    None (every view) gives each rank its own from its cadence (:func:`rank_window`); the run is
    quiet once nothing arrived for its slowest rank's window. ``stopped``: the run is known to have
    stopped (a collector retired it): judged no earlier than that window after its latest sample."""
    lives = sorted((life for life in ranks if life._current is not None), key=lambda life: (life.rank, life.host))
    per_rank = [life.records() for life in lives]
    records = [rec for recs in per_rank for rec in recs]
    if not records:
        return RunStory(run, now, (), RunTally(), None, None)
    peers = _Peers([(rec.first.ts, rec.last.ts) for rec in records])
    latest = max(records, key=lambda rec: rec.last.ts).last
    windows = [rank_window(recs, silent_after_s) for recs in per_rank]
    run_window = max(windows)
    if stopped:
        now = max(now, latest.ts + run_window + 1.0)
    stories = tuple(_rank_story(life, recs, peers, now=now, run_last=latest.ts, window=w, run_window=run_window)
                    for life, recs, w in zip(lives, per_rank, windows, strict=True))
    first = first_failure(stories)
    stories = _with_culprit(stories, first)
    return RunStory(run, now, stories, RunTally.of(stories), latest, first)


class RunLife:
    """The fold of one run: a :class:`RankLife` per (host, rank)."""

    __slots__ = ("_ranks", "run")

    def __init__(self, run: str) -> None:
        self.run = run
        self._ranks: dict[tuple[str, int], RankLife] = {}

    def rank(self, host: str, rank: int) -> RankLife:
        """The rank's fold (created empty on first use)."""
        life = self._ranks.get((host, rank))
        if life is None:
            life = self._ranks[(host, rank)] = RankLife(host, rank)
        return life

    def feed(self, sample: Sample) -> None:
        self.rank(sample["host"], sample["rank"]).feed(sample)

    def ranks(self) -> list[RankLife]:
        return list(self._ranks.values())

    def __len__(self) -> int:
        return len(self._ranks)

    def story(self, now: float) -> RunStory:
        """:func:`judge` of this run at ``now``."""
        return judge(self.run, self._ranks.values(), now)


def fold(samples: Iterable[Sample]) -> dict[str, RunLife]:
    """Every run's fold from samples in any order (a trace file, the store, an import)."""
    runs: dict[str, RunLife] = {}
    for sample in samples:
        life = runs.get(sample["run"])
        if life is None:
            life = runs[sample["run"]] = RunLife(sample["run"])
        life.feed(sample)
    return runs


__all__ = [
    "MAX_INCARNATIONS", "Death", "Failure", "Incarnation", "IncarnationRecord", "Moment", "RankLife", "RankStory",
    "RunLife", "RunStory", "RunTally", "first_failure", "fold", "judge", "rank_window", "sample_key",
]
