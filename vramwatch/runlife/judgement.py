"""The judgement of a run's life: a pure function of the ranks' records and an explicit ``now``
(see the package docstring). O(n log n) in the run's incarnations."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from vramwatch.causes import LastWords, classify, killed_by
from vramwatch.runlife.fold import IncarnationRecord, Moment, RankLife, SuspectedOom
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
    #: OOMs suspected from device memory alone (monotonic; never in ``ooms``) and the ones kept
    suspected_ooms: int = 0
    suspected: tuple[SuspectedOom, ...] = ()

    @property
    def last_suspected_oom_ts(self) -> float | None:
        """When the latest suspected OOM happened (the sample's own ``ts``), None before one."""
        return self.suspected[-1].ts if self.suspected else None

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
    #: OOMs suspected from device memory alone (:attr:`RankStory.suspected_ooms`): never in ``ooms``
    #: nor in the status
    suspected_ooms: int = 0

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
                self.deaths, self.suspected_ooms)

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
            counts["suspected_ooms"] += r.suspected_ooms
        return cls(**counts)


_TALLY_FIELDS = ("ranks", "live", "silent", "exited", "dead", "ended", "ooms", "restarts", "deaths", "suspected_ooms")


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
    cadence and the longest phase any of its processes marked (a restart keeps the knowledge),
    and whether its latest sample opened a phase that has not ended."""
    if fixed is not None:
        return fixed
    phases = [rec.longest_phase_s for rec in records if rec.longest_phase_s is not None]
    return silence_window(records[-1].cadence_s, max(phases) if phases else None, in_phase=records[-1].in_phase)


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
                     records[-1].cadence_s, life.suspected_ooms, life.suspected)


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


