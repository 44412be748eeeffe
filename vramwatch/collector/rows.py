"""The ``/ranks`` row, built in one place for the API and the static report.

A row carries the rank's verdict with what sticks to it: ``liveness`` (``live`` /
``silent`` / ``exited``, the hook-silent alert's rule from :mod:`vramwatch.verdicts`), its
OOM and restart counts, and ``severity`` (:func:`vramwatch.verdicts.severity`, higher is
worse) for sorting. A rank that is not live, or whose current process hit an OOM, has no
time-to-OOM any more: ``died`` says when and how it stopped instead.

The compact table (``?compact=1``, what the polling page asks for) keeps only the numbers
the table shows, as lists under one ``columns`` header: under 200 bytes per rank instead
of ~1.6 KB.
"""

from __future__ import annotations

from typing import Any

from vramwatch import verdicts
from vramwatch.collector.live import SeriesState

#: rows of one /ranks page at most (``limit``); ``offset`` pages through the rest
MAX_RANK_ROWS = 4096
#: events carried per full row (the events route has all of them)
ROW_EVENTS = 50

#: engine summary keys the compact row keeps
_COMPACT_VERDICT = (
    "state", "plateau_bytes", "headroom_bytes", "worst_headroom_bytes", "slope_bytes_per_step", "steps_to_oom",
    "seconds_to_oom", "checkpoint_headroom_bytes", "fragmentation", "plateau_breaks", "plateau_relevels",
    "plateau_break_cause", "leak_source",
)
#: sample fields the compact row keeps (of the latest training sample)
_COMPACT_LAST = ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "nvml_used_bytes", "total_bytes")


def _died(state: SeriesState, alive: str) -> dict[str, Any] | None:
    last = state.last
    if last is None:
        return None
    if state.incarnation_ooms and state.last_oom is not None and state.last_oom["step"] >= last["step"]:
        # the OOM is the process's latest word: it died of it (samples after it: it went on)
        return {"how": "oom", **state.last_oom}
    if alive != "live":
        return {"how": alive, "step": last["step"], "ts": last["ts"], "last_seen": state.last_seen}
    return None


def verdict_of(state: SeriesState, alive: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The engine summary with liveness applied (a dead rank has no time-to-OOM), and ``died``."""
    verdict = state.engine.summary()
    died = _died(state, alive)
    if died is not None:
        verdict["steps_to_oom"] = verdict["seconds_to_oom"] = None
    return verdict, died


#: columns of the compact table, in order (``?compact=1``)
COMPACT_COLUMNS: tuple[str, ...] = (
    "host", "rank", "liveness", "ooms", "restarts", "severity", "died", "last_step", "last_seen",
    *_COMPACT_VERDICT, *_COMPACT_LAST,
)


def rank_row(state: SeriesState, *, now: float, run_last_seen: float) -> dict[str, Any]:
    """One ``/api/v1/runs/{run}/ranks`` row. O(1) plus the engine summary."""
    alive = verdicts.liveness(now, state.last_seen, run_last_seen, state.exited)
    verdict, died = verdict_of(state, alive)
    last = state.last
    return {
        "run": state.run, "host": state.host, "rank": state.rank, "liveness": alive, "ooms": state.ooms,
        "restarts": state.restarts, "severity": verdicts.severity(verdict.get("state"), alive, state.ooms),
        "died": died, "last_step": last["step"] if last else None, "last_ts": last["ts"] if last else None,
        "last_seen": state.last_seen, "version": state.version, "local_rank": state.local_rank,
        "uuid": state.uuid, "gpu": state.gpu, "incarnation": state.incarnation, "samples": state.samples,
        "last": state.last_train or last, "verdict": verdict, "events": list(state.events)[-ROW_EVENTS:],
    }


def compact_row(state: SeriesState, *, now: float, run_last_seen: float) -> list[Any]:
    """The same rank as a list of :data:`COMPACT_COLUMNS` values (times to 0.1 s)."""
    alive = verdicts.liveness(now, state.last_seen, run_last_seen, state.exited)
    verdict, died = verdict_of(state, alive)
    last = state.last
    shown = state.last_train or last or {}
    return [
        state.host, state.rank, alive, state.ooms, state.restarts,
        verdicts.severity(verdict.get("state"), alive, state.ooms), died,
        last["step"] if last else None, round(state.last_seen, 1),
        *(verdict.get(k) for k in _COMPACT_VERDICT), *(shown.get(k) for k in _COMPACT_LAST),
    ]


def rank_rows(states: list[SeriesState], *, now: float, compact: bool = False,
              run_last_seen: float | None = None) -> list[Any]:
    """Rows of series of one run (in the given order): dicts, or lists when ``compact``.
    ``run_last_seen``: the newest receive time of the whole run, when ``states`` is a part."""
    if not states:
        return []
    if run_last_seen is None:
        run_last_seen = max(s.last_seen for s in states)
    build = compact_row if compact else rank_row
    return [build(s, now=now, run_last_seen=run_last_seen) for s in states]
