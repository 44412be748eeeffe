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

An OOM seen from device memory alone (no OOM counter: dcgm, nvidia-smi, a hook without the
allocator's fields) is a *suspected* OOM (:class:`SuspectedOom`): the trend engine suspects it (the
process's memory vanished with the device near full or at the top of a climb) and whoever runs the
engine tells the fold (:meth:`RankLife.suspect`). The story keeps it per rank
(``RankStory.suspected``) and never counts it as an OOM: ``ooms``, the outcomes and the run's
status are the hook's evidence alone.

A process whose latest sample carries last words died at once of what :mod:`vramwatch.causes`
says they name. A rank that failed on its own at or before other ranks' collective timeouts is
the culprit (:attr:`Failure.victims`); those ranks are its victims (``Death.culprit``).

Low layer: imports only :mod:`vramwatch.causes`, :mod:`vramwatch.verdicts` and :mod:`vramwatch.wire`.
"""

from __future__ import annotations

from collections.abc import Iterable

from vramwatch.runlife.fold import (
    MAX_INCARNATIONS,
    MAX_SUSPECTED,
    IncarnationRecord,
    Moment,
    RankLife,
    SuspectedOom,
    SuspectedRecords,
    sample_key,
)
from vramwatch.runlife.judgement import (
    Death,
    Failure,
    Incarnation,
    RankStory,
    RunStory,
    RunTally,
    first_failure,
    judge,
    rank_window,
)
from vramwatch.wire import Sample


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

    def add_suspected(self, records: SuspectedRecords | None) -> None:
        """Tell the ranks this fold knows the suspected OOMs kept elsewhere (``Store.suspected_records``;
        :meth:`RankLife.add_suspected`); a rank it has no process of has no story and is skipped."""
        for key, (kept, dropped) in (records or {}).items():
            life = self._ranks.get(key)
            if life is not None:
                life.add_suspected(kept, dropped)

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
    "MAX_INCARNATIONS", "MAX_SUSPECTED", "Death", "Failure", "Incarnation", "IncarnationRecord", "Moment", "RankLife",
    "RankStory", "RunLife", "RunStory", "RunTally", "SuspectedOom", "SuspectedRecords", "first_failure", "fold",
    "judge", "rank_window", "sample_key",
]
