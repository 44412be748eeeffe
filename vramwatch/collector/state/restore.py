"""Start-up: rebuild live state from the database, bounded by what is still running.

Replaying every stored sample (the old way) made start-up time and memory grow with the
database: a week of finished runs meant minutes with the port dead and gigabytes of
engines that were evicted right after. :func:`restore` replays only the runs that had a
sample in the last ``finished_after_s``; every other run gets a small
:class:`~vramwatch.collector.state.live.RetiredRun` row (its page is rebuilt on demand, see
``LiveState.revived``) whose status and counts are the run-life model's judgement of the
store's per-process records (``Store.life_records``: the same records the fold builds) and the
OOMs its engines suspected from device memory (``Store.suspected_records``, kept as the fold keeps
them), so a finished run reads as it did before the restart. A replayed run's folds are told the
stored suspected OOMs too (a replay no longer sees one whose climb retention deleted).

Which runs are recent is read from the store: the run's newest series first (one indexed
query answers for a running run), then the records' one query over the whole run (a C-level
scan that also says the run's newest sample time). Cost: that scan plus a few indexed look-ups
per finished run, and the replay of the running runs' samples; memory: the running runs' engines.
"""

from __future__ import annotations

import logging
import time

from vramwatch.collector.state.live import LiveState, RetiredRun, story_row
from vramwatch.collector.store import Store
from vramwatch.runlife import IncarnationRecord, RunLife, RunStory, SuspectedRecords, judge

log = logging.getLogger("vramwatch.collector")


def _newest_is_recent(store: Store, run: str, cutoff: float) -> bool:
    rows = store.series(run)
    if not rows:
        return False
    newest = rows[-1]  # the latest series created: a running run has recent samples there
    xs, _ = store.query_columns(run, newest.host, newest.rank, [], phase=None, x="ts", start=cutoff)
    return bool(xs)


def stopped_story(run: str, records: list[tuple[str, int, IncarnationRecord]], now: float,
                  suspected: SuspectedRecords | None = None) -> RunStory:
    """The model's judgement of a run not replayed: from the store's records and suspected OOMs,
    as a run that has stopped (judged at least the silence window after its newest sample)."""
    life = RunLife(run)
    for host, rank, record in records:
        life.rank(host, rank).add_record(record)
    life.add_suspected(suspected)
    return judge(run, life.ranks(), now, stopped=True)


def restore(live: LiveState, store: Store, *, cutoff: float) -> dict[str, float]:
    """Replay the runs with a sample stamped at or after ``cutoff``; retire the others.
    Returns counts and the seconds it took (for the start-up log line)."""
    started = time.perf_counter()
    replayed = retired = 0
    now = time.time()
    for run in store.runs():
        if _newest_is_recent(store, run, cutoff):
            replayed += live.rebuild(store.iter_samples(run))
            live.tell_suspected(run, store.suspected_records(run))
            continue
        records, newest = store.life_records(run)
        if newest is not None and newest >= cutoff:
            replayed += live.rebuild(store.iter_samples(run))
            live.tell_suspected(run, store.suspected_records(run))
        elif records:
            story = stopped_story(run, records, now, store.suspected_records(run))
            live.retire(run, RetiredRun(story_row(story)))
            retired += 1
    live.evict_quiet(cutoff)
    return {"samples": replayed, "retired_runs": retired, "seconds": time.perf_counter() - started}
