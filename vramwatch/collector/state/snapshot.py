"""A rank now, frozen: what every reader of the live state reads.

The live state (:mod:`.live`) owns each rank's mutable parts: its engine track, its run-life fold,
its latest samples. Readers never touch them: :meth:`LiveState.freeze` copies each rank of a run,
under the collector's one lock, into a :class:`RankSnapshot` that carries the rank's judgement of
the same instant (a :class:`~vramwatch.runlife.RankStory`), and the run's ranks into a
:class:`RunSnapshot`. ``/metrics``, the OTLP push, the ``/ranks`` rows, the run documents and the
post-mortem read these, so they cannot disagree on whether a rank runs, how many OOMs and
restarts it had, which OOMs were only suspected from device memory or what its engine says.

Cost of a freeze: per rank, one engine summary (cached figures, see
:mod:`vramwatch.decisions.online`) and a few attribute reads; the run's judgement is cached per run
and second (:meth:`LiveState.story`). A freeze holds the lock per rank, never across a whole run,
so ingest waits at most for one rank's copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from vramwatch import verdicts
from vramwatch.decisions.readiness import ReadinessConfig
from vramwatch.decisions.views import RankView
from vramwatch.engine.summary import RUNWAY_KEYS
from vramwatch.runlife import RankStory, RunStory
from vramwatch.wire import Sample

SeriesKey = tuple[str, str, int]

#: what a rank's suspected-OOM count means, as every exporter's help text says it
SUSPECTED_OOMS_MEANING = ("Out-of-memory errors suspected on this rank, inferred from device memory alone (no OOM "
                          "counter: its memory vanished with the device near full or at the top of a climb); never "
                          "counted with the confirmed OOMs.")


class RankEngine(Protocol):
    """What the live state needs of a rank's engine (:class:`vramwatch.decisions.online.DecisionEngine`;
    tests of bounds and benches pass lighter ones)."""

    def update(self, sample: Sample) -> list[dict[str, Any]]: ...

    def summary(self) -> dict[str, Any]: ...

    def view(self, config: ReadinessConfig) -> RankView: ...


class RankSnapshot(NamedTuple):
    """One rank at one instant: identity, latest samples, engine summary and its life's judgement.
    Immutable (a tuple: built per rank per read, ~5x cheaper than a frozen dataclass)."""

    run: str
    host: str
    rank: int
    uuid: str | None
    gpu: int | None
    local_rank: int | None
    incarnation: str
    samples: int
    last_seen: float
    version: int
    last: Sample | None
    last_train: Sample | None
    summary: dict[str, Any]  # the engine's summary (with the decision figures); never mutated by readers
    events: tuple[dict[str, Any], ...]  # the latest events, as many as the freeze asked for
    story: RankStory | None  # None: no judgement names this rank yet (a series with no sample)
    last_oom_ts: float | None = None  # the fold's latest OOM of the rank (any process, its clock)
    process_start_ts: float | None = None  # its latest process's first sample (its clock)

    @property
    def key(self) -> SeriesKey:
        return (self.run, self.host, self.rank)

    @property
    def liveness(self) -> str:
        return str(verdicts.Liveness.LIVE) if self.story is None else str(self.story.liveness)

    @property
    def running(self) -> bool:
        """Its latest process runs (live or silent): what decides whether state families are exported."""
        return self.story is None or not self.story.ended

    @property
    def ooms(self) -> int:
        """OOMs of every process of this rank (the run-life model's monotonic count)."""
        return 0 if self.story is None else self.story.ooms

    @property
    def suspected_ooms(self) -> int:
        """OOMs suspected from device memory on this rank (the run-life model's; never in :attr:`ooms`)."""
        return 0 if self.story is None else self.story.suspected_ooms

    @property
    def last_suspected_oom_ts(self) -> float | None:
        """When the rank's latest suspected OOM happened (its clock), None before one."""
        return None if self.story is None else self.story.last_suspected_oom_ts

    @property
    def restarts(self) -> int:
        return 0 if self.story is None else self.story.restarts

    @property
    def deaths(self) -> int:
        return 0 if self.story is None else self.story.deaths

    @property
    def shown(self) -> Sample | None:
        """The sample a reader shows: the latest training step's, else the latest."""
        return self.last_train or self.last

    def verdict(self) -> dict[str, Any]:
        """The engine summary with liveness applied: a rank that is not live has no time-to-OOM.
        A new dict (O(keys))."""
        verdict = dict(self.summary)
        if self.story is not None and self.story.liveness != verdicts.Liveness.LIVE:
            verdict.update(dict.fromkeys(RUNWAY_KEYS))
        return verdict


@dataclass(frozen=True, slots=True)
class RunSnapshot:
    """A run's ranks frozen at ``now`` with the one judgement they were read with."""

    run: str
    now: float
    story: RunStory
    ranks: tuple[RankSnapshot, ...]  # by (rank, host)

    @property
    def samples(self) -> int:
        return sum(r.samples for r in self.ranks)

    @property
    def last_seen(self) -> float:
        return max((r.last_seen for r in self.ranks), default=0.0)
