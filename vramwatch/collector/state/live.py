"""In-memory live state: each rank's engine, its run-life fold and its latest samples, under one lock.

Everything a scrape or a dashboard poll needs is here, so neither touches the database.
After a restart the state is rebuilt by replaying the store through the same engines,
so verdicts continue where they left off (no spurious plateau breaks).

Bounded (docs/reliability.md, "cardinality"): at most ``max_series`` series and
``max_ranks_per_run`` per run (:meth:`LiveState.check_capacity`, a 422 naming the limit);
runs quiet for ``finished_after_s`` are evicted (:meth:`LiveState.evict_quiet`) and leave
one small :class:`RetiredRun` row behind for the runs list. A run's life (its ranks'
processes, how each ended, liveness, deaths, status) is :mod:`vramwatch.runlife`'s model: every
sample is folded into its rank's :class:`~vramwatch.runlife.RankLife` (in any order: resends and
spool replays change nothing) and :meth:`LiveState.story` judges it; states and severity come
from :mod:`vramwatch.verdicts`.
"""

from __future__ import annotations

import gc
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vramwatch import incidents, verdicts
from vramwatch.collector.state.snapshot import RankEngine, RankSnapshot, RunSnapshot, SeriesKey
from vramwatch.decisions.online import DecisionEngine
from vramwatch.decisions.readiness import ReadinessConfig
from vramwatch.decisions.views import RankView
from vramwatch.errors import VramwatchError
from vramwatch.runlife import RankLife, RankStory, RunStory, SuspectedOom, SuspectedRecords, judge
from vramwatch.wire import Sample

#: Engine events kept per series for the API (the engine keeps its own bounded list too).
EVENTS_KEPT = 500
#: evicted runs rebuilt on demand (a finished run's page) and kept for the next request
REVIVED_KEPT = 4
#: new series between two ``gc.freeze()`` calls (see ``LiveState._add``)
GC_FREEZE_EVERY = 512
#: allocations between two young-generation collections in a serving collector (CPython: 700)
GC_YOUNG_THRESHOLD = 10_000


def tune_gc_for_serving() -> None:
    """Fewer, larger young collections in the collector process (called once by the app).

    With CPython's 700, a request's in-flight objects (decoded samples, h11 events, futures)
    are alive at several young collections each, get promoted, and the promotions trigger full
    collections over every live object not frozen: at 4,096 ranks x 1 step/s the collector
    paused 2-3 times a minute for 54-190 ms (measured with gc.callbacks), longer than
    the whole p99 budget of a POST. At 10,000 the same runs had no full collection. Cost:
    at most 10,000 young objects scanned at once (a few ms), less GC CPU in all."""
    young, middle, old = gc.get_threshold()
    if 0 < young < GC_YOUNG_THRESHOLD:
        gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


class SeriesLimitError(VramwatchError):
    """A batch would take live state past ``max_series`` or a run past ``max_ranks_per_run``."""

    status = 422

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SeriesState:
    """One (run, host, rank), mutable, owned by :class:`LiveState`: its engine track, its part of the
    run's life (the fold: OOMs, restarts, how each process ended) and its latest samples. Readers
    take a :class:`~vramwatch.collector.state.snapshot.RankSnapshot` (:meth:`LiveState.freeze`).

    ``__slots__`` and a lazily created event deque: a series that has raised no event
    costs a few hundred bytes here (the engine is the rest, see docs/reliability.md).
    """

    __slots__ = (
        "_events",
        "_frontier_phases",
        "_frontier_step",
        "engine",
        "exited",
        "gpu",
        "host",
        "incarnation",
        "last",
        "last_seen",
        "last_train",
        "late_samples",
        "life",
        "local_rank",
        "rank",
        "run",
        "samples",
        "shown_liveness",
        "uuid",
        "version",
    )

    def __init__(self, run: str, host: str, rank: int, engine: RankEngine, life: RankLife | None = None) -> None:
        self.run, self.host, self.rank, self.engine = run, host, rank, engine
        #: this rank's part of the run's life (vramwatch.runlife): OOMs, restarts, how each process ended
        self.life = life if life is not None else RankLife(host, rank)
        self.incarnation = ""
        self.uuid: str | None = None
        self.gpu: int | None = None
        self.local_rank: int | None = None
        self.last: Sample | None = None
        self.last_train: Sample | None = None
        self.samples = 0
        self.late_samples = 0
        self.last_seen = 0.0
        self._events: deque[dict[str, Any]] | None = None
        # (step, phases seen at that step) of the current incarnation: resends and late
        # arrivals (spool replay) are stored but not fed to the engine out of order.
        self._frontier_step = -1
        self._frontier_phases: tuple[str, ...] = ()
        self.version = 0  # LiveState.version when this series last changed (delta polling)
        self.shown_liveness = ""  # the liveness the last /ranks answer showed (delta polling)

    @property
    def key(self) -> SeriesKey:
        return (self.run, self.host, self.rank)

    @property
    def events(self) -> deque[dict[str, Any]] | tuple[()]:
        return self._events if self._events is not None else ()

    def add_event(self, event: dict[str, Any]) -> None:
        if self._events is None:
            self._events = deque(maxlen=EVENTS_KEPT)
        self._events.append(event)

    def accepts(self, sample: Sample) -> bool:
        incarnation = sample.get("incarnation", "")
        step = sample["step"]
        if incarnation != self.incarnation:
            return True
        if step > self._frontier_step:
            return True
        return step == self._frontier_step and sample["phase"] not in self._frontier_phases

    def advance(self, sample: Sample) -> None:
        """Move the engine's frontier to ``sample`` (a new process, step or phase)."""
        incarnation = sample.get("incarnation", "")
        step = sample["step"]
        if incarnation != self.incarnation or step != self._frontier_step:
            self._frontier_phases = ()
        self.incarnation = incarnation
        self._frontier_step = step
        self._frontier_phases = (*self._frontier_phases, sample["phase"])


@dataclass
class RetiredRun:
    """What the runs list keeps of an evicted run (a few hundred bytes per run)."""

    row: dict[str, Any]


def collector_engine() -> RankEngine:
    """The collector's per-series engine: the trend engine plus the decision figures
    (largest tokens per step, readiness; vramwatch.decisions.online)."""
    return DecisionEngine()


class LiveState:
    """Thread-safe map of series → state. ``ingest`` is called by the single writer; readers
    take frozen copies (:meth:`freeze`, :meth:`freeze_live`, :meth:`views`) under the same lock,
    the only lock guarding the engines."""

    def __init__(self, engine_factory: Callable[[], RankEngine] = collector_engine, *,
                 silent_after_s: float | None = None, kept_suspected: Callable[[str], SuspectedRecords] | None = None,
                 ) -> None:
        self._engine_factory = engine_factory
        #: one silence window for every rank, or None: each rank's own (vramwatch.runlife.rank_window)
        self.silent_after_s = silent_after_s
        #: a run's suspected OOMs as the store kept them (``Store.suspected_records``): told to a run
        #: rebuilt on demand (:meth:`revived`), whose replay may no longer see them
        self.kept_suspected = kept_suspected
        self._series: dict[SeriesKey, SeriesState] = {}
        self._ranks_per_run: dict[str, int] = {}
        self._retired: dict[str, RetiredRun] = {}
        self._revived: dict[str, list[SeriesState]] = {}
        self._stories: dict[str, tuple[tuple[Any, ...], RunStory]] = {}  # the latest judgement per run
        self._unfrozen = 0  # series created since the last gc.freeze()
        self._lock = threading.Lock()
        #: bumped by every change; rows carry the version of their last change
        self.version = 0

    def __len__(self) -> int:
        return len(self._series)

    # ------------------------------------------------------------ writes

    def check_capacity(self, samples: Iterable[Sample], *, max_series: int, max_ranks_per_run: int) -> None:
        """Raise :class:`SeriesLimitError` if ingesting ``samples`` would create more series
        than the limits allow. O(batch)."""
        new: dict[SeriesKey, None] = {}
        series = self._series
        for s in samples:
            key = (s["run"], s["host"], s["rank"])
            if key not in series:
                new[key] = None
        if not new:
            return
        if len(series) + len(new) > max_series:
            raise SeriesLimitError(
                f"series: the collector holds {len(series)} live series and this batch adds {len(new)}; "
                f"the cap is {max_series} (--max-series)")
        per_run: dict[str, int] = {}
        for run, _host, _rank in new:
            per_run[run] = per_run.get(run, 0) + 1
        for run, added in per_run.items():
            have = self._ranks_per_run.get(run, 0)
            if have + added > max_ranks_per_run:
                raise SeriesLimitError(
                    f"rank: run {run!r} has {have} series and this batch adds {added}; the cap is "
                    f"{max_ranks_per_run} per run (--max-ranks-per-run)")

    def ingest(self, samples: Iterable[Sample], received_at: float | None = None,
               accepted: Mapping[SeriesKey, int] | None = None) -> list[dict[str, Any]]:
        """Feed new samples to their engines; returns the events they raised (with identity).

        ``accepted``: new samples per series as the store counted them (duplicates excluded);
        without it (replay) every sample counts.

        Hot path (every ingested sample): the common case — same process, next step, no
        OOM, no exit — costs a few attribute writes besides the engine's update."""
        now = time.time() if received_at is None else received_at
        raised: list[dict[str, Any]] = []
        series = self._series
        with self._lock:
            self.version += 1
            version = self.version
            for s in samples:
                key = (s["run"], s["host"], s["rank"])
                state = series.get(key)
                if state is None:
                    state = self._add(key)
                if accepted is None:
                    state.samples += 1
                state.last_seen = now
                state.version = version
                # the model takes every sample, late and resent ones too: its records do not
                # depend on the order (an exit marker repeats the last step: the engine skips it)
                state.life.feed(s)
                # sparse (schema 2) samples are judged too: the engine uses whatever level was measured
                step = s["step"]
                if (step > state._frontier_step and s.get("incarnation", "") == state.incarnation
                        and state.last is not None):
                    state._frontier_step = step
                    state._frontier_phases = (s["phase"],)
                elif state.accepts(s):
                    state.advance(s)
                    state.uuid = s.get("uuid", state.uuid)
                    state.gpu = s.get("gpu", state.gpu)
                    state.local_rank = s.get("local_rank", state.local_rank)
                else:
                    state.late_samples += 1
                    continue
                state.last = s
                if s["phase"] == "train":
                    state.last_train = s
                events = state.engine.update(s)
                if events:
                    for event in events:
                        # when and in which process: a step axis that runs twice after a restart
                        # from a checkpoint is ordered by time and drawn as attempts
                        event["ts"] = s["ts"]
                        event["incarnation"] = s.get("incarnation", "")
                        state.add_event(event)
                        if event["type"] == "suspected_oom":  # the model keeps it (never as an OOM)
                            state.life.suspect(SuspectedOom.of(event, s["ts"]))
                        raised.append({"run": key[0], "host": key[1], "rank": key[2], **event})
            if accepted:
                for key, count in accepted.items():
                    state = series.get(key)
                    if state is not None:
                        state.samples += count
        return raised

    def _add(self, key: SeriesKey) -> SeriesState:
        state = SeriesState(key[0], key[1], key[2], self._engine_factory())
        self._series[key] = state
        self._unfrozen += 1
        if self._unfrozen >= GC_FREEZE_EVERY:
            # engines are long-lived and hold no reference cycles (checked: forgetting a run
            # leaves no cyclic garbage): move them out of the collector's sight, so a full
            # collection scans only what is new (at 20,000 series a gen-2 pass otherwise
            # holds the GIL for ~1.6 s: /healthz stalls). The young generations are
            # collected first so that no transient cyclic garbage is frozen with them.
            gc.collect(1)
            gc.freeze()
            self._unfrozen = 0
        self._ranks_per_run[key[0]] = self._ranks_per_run.get(key[0], 0) + 1
        self._retired.pop(key[0], None)
        self._revived.pop(key[0], None)
        return state

    def rebuild(self, samples: Iterable[Sample]) -> int:
        """Replay stored samples (per series, in step order) to restore engine state.
        Cost: the samples' engine updates; only the series replayed are touched."""
        count = 0
        touched: set[SeriesKey] = set()
        batch: list[Sample] = []
        for s in samples:
            batch.append(s)
            if len(batch) >= 5000:
                self.ingest(batch, received_at=s["ts"])
                touched.update((x["run"], x["host"], x["rank"]) for x in batch)
                count += len(batch)
                batch = []
        if batch:
            self.ingest(batch, received_at=batch[-1]["ts"])
            touched.update((x["run"], x["host"], x["rank"]) for x in batch)
            count += len(batch)
        with self._lock:
            for key in touched:
                state = self._series.get(key)
                # last_seen is the collector's receive time; after a replay the best we
                # know is the sample's own timestamp.
                if state is not None and state.last is not None:
                    state.last_seen = state.last["ts"]
        return count

    def tell_suspected(self, run: str, records: SuspectedRecords) -> None:
        """Tell the run's live folds the suspected OOMs the store kept (``Store.suspected_records``:
        what its engines said before a restart, which a replay no longer sees once retention took
        the climb's samples): :meth:`RankLife.add_suspected`, a moment already known is a no-op."""
        with self._lock:
            self.version += 1
            for (host, rank), (kept, dropped) in records.items():
                state = self._series.get((run, host, rank))
                if state is not None:
                    state.life.add_suspected(kept, dropped)
                    state.version = self.version

    def evict_quiet(self, cutoff: float, now: float | None = None) -> list[str]:
        """Drop the live state of runs with no sample received since ``cutoff``; each leaves
        a :class:`RetiredRun` row for the runs list (its status judged as a run that has
        stopped: finished or crashed). Returns the runs evicted. O(series)."""
        now = time.time() if now is None else now
        by_run: dict[str, list[SeriesState]] = {}
        for state in self.snapshot():
            by_run.setdefault(state.run, []).append(state)
        quiet = [run for run, states in by_run.items() if max(s.last_seen for s in states) < cutoff]
        for run in quiet:
            states = by_run[run]
            row = summary_row(self._frozen(states, self.story(run, states, now, stopped=True), now, 0))
            with self._lock:
                for state in states:
                    self._series.pop(state.key, None)
                self._ranks_per_run.pop(run, None)
                self._retired[run] = RetiredRun(row)
                self.version += 1
        return quiet

    def touch(self, state: SeriesState) -> int:
        """Mark ``state`` changed now (for delta polls); returns the new version."""
        with self._lock:
            self.version += 1
            state.version = self.version
            return self.version

    def retire(self, run: str, row: RetiredRun) -> None:
        """List ``run`` by its summary row only (a run not replayed at start-up)."""
        with self._lock:
            if not self._ranks_per_run.get(run):
                self._retired[run] = row

    def forget_series(self, keys: Iterable[SeriesKey]) -> None:
        """Remove series whose samples retention deleted (their run may go on)."""
        with self._lock:
            for key in keys:
                if self._series.pop(tuple(key), None) is not None:  # type: ignore[arg-type]
                    self._ranks_per_run[key[0]] = max(0, self._ranks_per_run.get(key[0], 1) - 1)
            self.version += 1

    def forget(self, runs: Iterable[str]) -> None:
        """Remove runs entirely (their samples were deleted by retention)."""
        with self._lock:
            for run in runs:
                for key in [k for k in self._series if k[0] == run]:
                    del self._series[key]
                self._ranks_per_run.pop(run, None)
                self._retired.pop(run, None)
                self._revived.pop(run, None)
            self.version += 1

    def revived(self, run: str, replay: Callable[[str], Iterable[Sample]]) -> list[SeriesState]:
        """The series of an evicted run, rebuilt on demand from ``replay(run)`` (the store)
        into a separate state; the last :data:`REVIVED_KEPT` such runs are kept."""
        with self._lock:
            if run not in self._retired:
                return []
            states = self._revived.pop(run, None)
        if states is None:
            scratch = LiveState(self._engine_factory, silent_after_s=self.silent_after_s)
            scratch.rebuild(replay(run))
            if self.kept_suspected is not None:
                scratch.tell_suspected(run, self.kept_suspected(run))
            states = scratch.for_run(run)
        with self._lock:
            self._revived[run] = states
            while len(self._revived) > REVIVED_KEPT:
                self._revived.pop(next(iter(self._revived)))
        return states

    # ------------------------------------------------------------ reads

    def snapshot(self) -> list[SeriesState]:
        with self._lock:
            return list(self._series.values())

    def get(self, run: str, host: str, rank: int) -> SeriesState | None:
        with self._lock:
            return self._series.get((run, host, rank))

    def for_run(self, run: str) -> list[SeriesState]:
        with self._lock:
            return sorted((s for s in self._series.values() if s.run == run), key=lambda s: (s.rank, s.host))

    def runs(self) -> set[str]:
        with self._lock:
            return {k[0] for k in self._series} | set(self._retired)

    def is_retired(self, run: str) -> bool:
        with self._lock:
            return run in self._retired

    def story(self, run: str, states: Iterable[SeriesState] | None = None, now: float | None = None, *,
              stopped: bool = False) -> RunStory:
        """The run's life judged at ``now`` (:func:`vramwatch.runlife.judge`) from its ranks' folds
        (``states``: the run's series, live or revived; default: the live ones). A run evicted from
        live state (``stopped``, or retired) is judged as a run that has stopped: at least the
        silence window after its latest sample. O(n log n) in the run's processes."""
        now = time.time() if now is None else now
        if states is None:
            states = self.for_run(run) or self._revived.get(run, [])
        stopped = stopped or self.is_retired(run)
        # one judgement per run per second of the clock and per change of its ranks, however many
        # readers ask (a 4,096-rank judgement is ~90 ms): pollers, /runs, the post-mortem, /metrics
        key = (len(states), max((s.version for s in states), default=-1), stopped, math.floor(now))
        cached = self._stories.get(run)
        if cached is not None and cached[0] == key:
            return cached[1]
        story = judge(run, [s.life for s in states], now, stopped=stopped, silent_after_s=self.silent_after_s)
        with self._lock:
            if len(self._stories) > 4096:
                self._stories.clear()
            self._stories[run] = (key, story)
        return story

    # ------------------------------------------------------------ frozen reads

    def freeze_states(self, states: list[SeriesState], story: RunStory, *, events: int = 0) -> RunSnapshot:
        """``states`` (some of one run's series, live or revived) frozen with ``story``, the whole
        run's judgement (:meth:`story`), so a page of ranks reads what the full list reads."""
        return self._frozen(states, story, story.now, events)

    def _frozen(self, states: list[SeriesState], story: RunStory, now: float, events: int) -> RunSnapshot:
        index = story.index()
        lock = self._lock
        ranks = []
        for state in states:
            rank_story: RankStory | None = index.get((state.host, state.rank))
            with lock:  # one rank between two of the writer's batches
                tail = tuple(list(state.events)[-events:]) if events and state.events else ()
                ranks.append(RankSnapshot(
                    state.run, state.host, state.rank, state.uuid, state.gpu, state.local_rank, state.incarnation,
                    state.samples, state.last_seen, state.version, state.last, state.last_train,
                    state.engine.summary(), tail, rank_story, state.life.last_oom_ts, state.life.process_start_ts))
        return RunSnapshot(story.run, now, story, tuple(ranks))

    def freeze(self, run: str, now: float | None = None, *, events: int = 0,
               replay: Callable[[str], Iterable[Sample]] | None = None) -> RunSnapshot | None:
        """The run's ranks frozen at ``now`` (None when it has none): live ones, else an evicted
        run rebuilt from ``replay`` (:meth:`revived`). ``events``: the latest events kept per rank.
        O(ranks) engine summaries plus one judgement (cached)."""
        now = time.time() if now is None else now
        states = self.for_run(run)
        if not states and replay is not None:
            states = self.revived(run, replay)
        if not states:
            return None
        return self._frozen(states, self.story(run, states, now), now, events)

    def freeze_live(self, now: float | None = None, *, since: float | None = None) -> list[RunSnapshot]:
        """Every live run frozen at ``now`` (ranks with a sample only); runs with no sample received
        since ``since`` are left out (a scrape's age-out). O(series)."""
        now = time.time() if now is None else now
        by_run: dict[str, list[SeriesState]] = {}
        for state in self.snapshot():
            if state.last is not None:
                by_run.setdefault(state.run, []).append(state)
        out = []
        for run, states in by_run.items():
            if since is not None and max(s.last_seen for s in states) < since:
                continue
            states.sort(key=lambda s: (s.rank, s.host))
            out.append(self._frozen(states, self.story(run, states, now), now, 0))
        return out

    def views(self, run: str, config: ReadinessConfig,
              replay: Callable[[str], Iterable[Sample]] | None = None) -> tuple[list[RankView], list[RankLife], int]:
        """The run's ranks as the decisions read them (each engine's frozen track, copied under the
        lock), their run-life folds and the run's sample count. O(ranks x (buckets + processes))."""
        states = self.for_run(run)
        if not states and replay is not None:
            states = self.revived(run, replay)
        views = []
        for state in states:
            with self._lock:
                views.append(state.engine.view(config))
        return views, [s.life for s in states], sum(s.samples for s in states)

    def run_summaries(self, now: float | None = None) -> list[dict[str, Any]]:
        """One row per run (live and retired): status, OOMs, the worst rank's state, min
        headroom, soonest OOM, last sample. Newest first."""
        now = time.time() if now is None else now
        by_run: dict[str, list[SeriesState]] = {}
        for state in self.snapshot():
            by_run.setdefault(state.run, []).append(state)
        out = [summary_row(self._frozen(states, self.story(run, states, now), now, 0))
               for run, states in by_run.items()]
        with self._lock:
            out.extend(dict(r.row) for run, r in self._retired.items() if run not in by_run)
        out.sort(key=lambda r: -(r["last_seen"] or 0))
        return out


def story_row(story: RunStory) -> dict[str, Any]:
    """The part of a ``/api/v1/runs`` row the model answers alone (a run not replayed at
    start-up has only this): status, counts (``tally``: what a front adds up across shards),
    ranks and hosts, latest sample time and step. O(ranks)."""
    tally = story.tally
    return {
        "run": story.run, "status": str(story.status), "ranks": tally.ranks,
        "hosts": len({r.host for r in story.ranks}), "samples": None,
        "last_ts": None if story.last is None else story.last.ts,
        "last_step": max((r.current.record.last.step for r in story.ranks), default=None),
        "worst_state": None, "worst_rank": None, "min_headroom_bytes": None, "seconds_to_oom": None,
        "last_seen": 0.0 if story.last is None else story.last.ts, "ooms": tally.ooms, "restarts": tally.restarts,
        "deaths": tally.deaths, "silent_ranks": tally.silent, "dead_ranks": tally.dead,
        "suspected_ooms": tally.suspected_ooms, "tally": tally.as_dict(),
        "incidents": incidents.count(story),
    }


def summary_row(frozen: RunSnapshot) -> dict[str, Any]:
    """One ``/api/v1/runs`` row: :func:`story_row` with the engines' worst state, least headroom
    and soonest OOM (live ranks only), samples and receive time. O(ranks)."""
    row = story_row(frozen.story)
    row["samples"] = frozen.samples
    row["last_seen"] = frozen.last_seen
    worst = -10**9
    for rank in frozen.ranks:
        summary = rank.summary
        liveness = rank.liveness
        severity = verdicts.severity(summary.get("state"), liveness, rank.ooms, rank.suspected_ooms)
        if summary.get("state") is not None and severity > worst:
            worst, row["worst_state"], row["worst_rank"] = severity, summary["state"], rank.rank
        headroom = summary.get("headroom_bytes")
        if headroom is not None and (row["min_headroom_bytes"] is None or headroom < row["min_headroom_bytes"]):
            row["min_headroom_bytes"] = headroom
        eta = summary.get("seconds_to_oom")
        if liveness == verdicts.Liveness.LIVE and eta is not None and (
                row["seconds_to_oom"] is None or eta < row["seconds_to_oom"]):
            row["seconds_to_oom"] = eta
    return row
