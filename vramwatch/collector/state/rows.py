"""The ``/ranks`` row, built in one place for the API and the static report.

A row carries the rank's verdict with its life as :mod:`vramwatch.runlife` judged it
(a :class:`~vramwatch.runlife.RankStory`): ``liveness`` (``live`` / ``silent`` / ``exited`` /
``dead`` / ``ended``), ``died`` (``{"cause", "step", "ts"}`` while its latest process is dead),
its monotonic OOM, restart and death counts, the latest process's ``outcome`` and start, and
``severity`` (:func:`vramwatch.verdicts.severity`, higher is worse) for sorting. A rank that is not
live has no time-to-OOM. Which figures are the current process's and which span the rank's
whole life: :data:`vramwatch.verdicts.FIGURE_SCOPES` (``/api/v1/meta``).

The compact table (``?compact=1``, what the polling page asks for) keeps only the numbers
the table shows, as lists under one ``columns`` header: under 200 bytes per rank instead
of ~1.6 KB.
"""

from __future__ import annotations

from typing import Any

from vramwatch import verdicts
from vramwatch.collector.state.live import SeriesState
from vramwatch.runlife import RankStory, RunStory

#: rows of one /ranks page at most (``limit``); ``offset`` pages through the rest
MAX_RANK_ROWS = 4096
#: events carried per full row (the events route has all of them)
ROW_EVENTS = 50

#: engine summary keys the compact row keeps
_COMPACT_VERDICT = (
    "state", "plateau_bytes", "headroom_bytes", "worst_headroom_bytes", "slope_bytes_per_step", "steps_to_oom",
    "seconds_to_oom", "checkpoint_peak_bytes", "checkpoint_headroom_bytes", "fragmentation", "plateau_breaks",
    "plateau_relevels", "plateau_break_cause", "leak_source",
)
#: sample fields the compact row keeps (of the latest training sample)
_COMPACT_LAST = ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "nvml_used_bytes", "total_bytes")


def verdict_of(state: SeriesState, story: RankStory | None) -> dict[str, Any]:
    """The engine summary with liveness applied: a rank that is not live has no time-to-OOM."""
    verdict = state.engine.summary()
    if story is not None and story.liveness != verdicts.Liveness.LIVE:
        verdict["steps_to_oom"] = verdict["seconds_to_oom"] = None
    return verdict


def _life(story: RankStory | None) -> tuple[str, int, int, int, dict[str, Any] | None]:
    if story is None:  # a series with no sample yet
        return str(verdicts.Liveness.LIVE), 0, 0, 0, None
    return (str(story.liveness), story.ooms, story.restarts, story.deaths,
            None if story.died is None else story.died.as_dict())


#: columns of the compact table, in order (``?compact=1``)
COMPACT_COLUMNS: tuple[str, ...] = (
    "host", "rank", "liveness", "ooms", "restarts", "deaths", "severity", "died", "last_step", "last_seen",
    *_COMPACT_VERDICT, *_COMPACT_LAST,
)


def rank_row(state: SeriesState, story: RankStory | None) -> dict[str, Any]:
    """One ``/api/v1/runs/{run}/ranks`` row. O(1) plus the engine summary."""
    liveness, ooms, restarts, deaths, died = _life(story)
    verdict = verdict_of(state, story)
    last = state.last
    current = None if story is None else story.current
    return {
        "run": state.run, "host": state.host, "rank": state.rank, "liveness": liveness, "ooms": ooms,
        "restarts": restarts, "deaths": deaths, "severity": verdicts.severity(verdict.get("state"), liveness, ooms),
        "died": died, "outcome": None if current is None else str(current.outcome),
        "silence_window_s": None if story is None else story.window_s,
        "cadence_s": None if story is None else story.cadence_s,
        "process_start": None if current is None else {"step": current.start.step, "ts": current.start.ts},
        "last_step": last["step"] if last else None, "last_ts": last["ts"] if last else None,
        "last_seen": state.last_seen, "version": state.version, "local_rank": state.local_rank,
        "uuid": state.uuid, "gpu": state.gpu, "incarnation": state.incarnation, "samples": state.samples,
        "last": state.last_train or last, "verdict": verdict, "events": list(state.events)[-ROW_EVENTS:],
    }


def compact_row(state: SeriesState, story: RankStory | None) -> list[Any]:
    """The same rank as a list of :data:`COMPACT_COLUMNS` values (times to 0.1 s)."""
    liveness, ooms, restarts, deaths, died = _life(story)
    verdict = verdict_of(state, story)
    last = state.last
    shown = state.last_train or last or {}
    return [
        state.host, state.rank, liveness, ooms, restarts, deaths,
        verdicts.severity(verdict.get("state"), liveness, ooms), died,
        last["step"] if last else None, round(state.last_seen, 1),
        *(verdict.get(k) for k in _COMPACT_VERDICT), *(shown.get(k) for k in _COMPACT_LAST),
    ]


def rank_rows(states: list[SeriesState], story: RunStory, *, compact: bool = False) -> list[Any]:
    """Rows of series of one run (in the given order): dicts, or lists when ``compact``.
    ``story``: the whole run judged (:meth:`LiveState.story`), so a page of ranks reads the
    same liveness as the full list."""
    index = story.index()
    build = compact_row if compact else rank_row
    return [build(s, index.get((s.host, s.rank))) for s in states]
