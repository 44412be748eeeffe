"""Start-up: rebuild live state from the database, bounded by what is still running.

Replaying every stored sample (the old way) made start-up time and memory grow with the
database: a week of finished runs meant minutes with the port dead and gigabytes of
engines that were evicted right after. :func:`restore` replays only the runs that had a
sample in the last ``finished_after_s``; every other run gets a small
:class:`~vramwatch.collector.live.RetiredRun` row (its page is rebuilt on demand, see
``LiveState.revived``).

Which runs are recent is read from the store: the run's newest series first (one indexed
query answers for a running run), then one query over the whole run (for a finished run
an empty answer after a C-level scan). Cost: two queries per finished run plus the replay
of the running runs' samples; memory: the running runs' engines.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vramwatch.collector.live import LiveState, RetiredRun

log = logging.getLogger("vramwatch.collector")


def _run_is_recent(store: Any, run: str, cutoff: float) -> tuple[bool, list[Any]]:
    rows = store.series(run)
    if not rows:
        return False, rows
    newest = rows[-1]  # the latest series created: a running run has recent samples there
    xs, _ = store.query_columns(run, newest.host, newest.rank, [], phase=None, x="ts", start=cutoff)
    if xs:
        return True, rows
    # one query over the whole run: empty (a C-level scan) for a finished run
    xs, _ = store.query_columns(run, None, None, [], phase=None, x="ts", start=cutoff)
    return bool(xs), rows


def _retired_row(run: str, rows: list[Any]) -> dict[str, Any]:
    keys = {(r.host, r.rank) for r in rows}
    return {
        "run": run, "ranks": len(keys), "hosts": len({h for h, _ in keys}), "samples": None, "last_ts": None,
        "last_step": None, "worst_state": None, "worst_rank": None, "min_headroom_bytes": None,
        "seconds_to_oom": None, "last_seen": 0.0, "ooms": None, "restarts": None, "silent_ranks": 0,
        "status": "finished",
    }


def restore(live: LiveState, store: Any, *, cutoff: float) -> dict[str, float]:
    """Replay the runs with a sample stamped at or after ``cutoff``; retire the others.
    Returns counts and the seconds it took (for the start-up log line)."""
    started = time.perf_counter()
    replayed = retired = 0
    for run in store.runs():
        recent, rows = _run_is_recent(store, run, cutoff)
        if recent:
            replayed += live.rebuild(store.iter_samples(run))
        elif rows:
            live.retire(run, RetiredRun(_retired_row(run, rows)))
            retired += 1
    live.evict_quiet(cutoff)
    return {"samples": replayed, "retired_runs": retired, "seconds": time.perf_counter() - started}
