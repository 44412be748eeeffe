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
from vramwatch.collector.state.snapshot import RankSnapshot, RunSnapshot

#: rows of one /ranks page at most (``limit``); ``offset`` pages through the rest
MAX_RANK_ROWS = 4096
#: events carried per full row (the events route has all of them); freeze with this many
ROW_EVENTS = 50

#: engine summary keys the compact row keeps
_COMPACT_VERDICT = (
    "state", "plateau_bytes", "headroom_bytes", "worst_headroom_bytes", "slope_bytes_per_step", "steps_to_oom",
    "seconds_to_oom", "checkpoint_peak_bytes", "checkpoint_headroom_bytes", "fragmentation", "plateau_breaks",
    "plateau_relevels", "plateau_break_cause", "leak_source",
)
#: sample fields the compact row keeps (of the latest training sample)
_COMPACT_LAST = ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "nvml_used_bytes", "total_bytes")


def _died(rank: RankSnapshot) -> dict[str, Any] | None:
    return None if rank.story is None or rank.story.died is None else rank.story.died.as_dict()


#: columns of the compact table, in order (``?compact=1``). ``suspected_ooms`` is not one: at 1,024 ranks
#: the table is at its 200 KiB bound, a column of it would pass it; ``severity`` ranks a suspected OOM as an
#: OOM, and the full rows the page reads again now and then carry the count
COMPACT_COLUMNS: tuple[str, ...] = (
    "host", "rank", "liveness", "ooms", "restarts", "deaths", "severity", "died", "last_step", "last_seen",
    *_COMPACT_VERDICT, *_COMPACT_LAST,
)


def rank_row(rank: RankSnapshot) -> dict[str, Any]:
    """One ``/api/v1/runs/{run}/ranks`` row. O(1) plus a copy of the engine summary."""
    liveness = rank.liveness
    verdict = rank.verdict()
    last = rank.last
    current = None if rank.story is None else rank.story.current
    return {
        "run": rank.run, "host": rank.host, "rank": rank.rank, "liveness": liveness, "ooms": rank.ooms,
        "restarts": rank.restarts, "deaths": rank.deaths, "suspected_ooms": rank.suspected_ooms,
        "severity": verdicts.severity(verdict.get("state"), liveness, rank.ooms, rank.suspected_ooms),
        "died": _died(rank), "outcome": None if current is None else str(current.outcome),
        "silence_window_s": None if rank.story is None else rank.story.window_s,
        "cadence_s": None if rank.story is None else rank.story.cadence_s,
        "process_start": None if current is None else {"step": current.start.step, "ts": current.start.ts},
        "last_step": last["step"] if last else None, "last_ts": last["ts"] if last else None,
        "last_seen": rank.last_seen, "version": rank.version, "local_rank": rank.local_rank,
        "uuid": rank.uuid, "gpu": rank.gpu, "incarnation": rank.incarnation, "samples": rank.samples,
        "last": rank.shown, "verdict": verdict, "events": list(rank.events[-ROW_EVENTS:]),
    }


def compact_row(rank: RankSnapshot) -> list[Any]:
    """The same rank as a list of :data:`COMPACT_COLUMNS` values (times to 0.1 s)."""
    liveness = rank.liveness
    verdict = rank.verdict()
    last = rank.last
    shown = rank.shown or {}
    return [
        rank.host, rank.rank, liveness, rank.ooms, rank.restarts, rank.deaths,
        verdicts.severity(verdict.get("state"), liveness, rank.ooms, rank.suspected_ooms), _died(rank),
        last["step"] if last else None, round(rank.last_seen, 1),
        *(verdict.get(k) for k in _COMPACT_VERDICT), *(shown.get(k) for k in _COMPACT_LAST),
    ]


def rank_rows(ranks: RunSnapshot | list[RankSnapshot] | tuple[RankSnapshot, ...], *,
              compact: bool = False) -> list[Any]:
    """Rows of frozen ranks (in the given order): dicts, or lists when ``compact``. Each rank
    carries the whole run's judgement (:meth:`LiveState.freeze`), so a page of ranks reads the
    same liveness as the full list."""
    build = compact_row if compact else rank_row
    return [build(r) for r in (ranks.ranks if isinstance(ranks, RunSnapshot) else ranks)]
