"""One run's documents read from a database, as the collector's API would answer them: the
ranks (worst first), the runs row, min/max-envelope series of the worst ranks, phases, events,
heatmaps, the evidence (snapshots, leak suspects, named foreign processes, the post-mortem) and
the advice. What ``vramwatch report --db`` embeds; the report itself only renders.

Cost: the run's samples read twice (the live state rebuilt: the one fold of its life; the
post-mortem's one pass, judged by that fold), one chart read
per embedded rank (at most ``MAX_SERIES_RANKS + 1``), four heatmap reads.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from vramwatch.collector.ingest.processes import ProcessBook
from vramwatch.collector.reads.charts import run_chart, run_heatmap
from vramwatch.collector.snapshots.diffs import DiffCache, enrich_postmortem, run_suspects
from vramwatch.collector.snapshots.directives import SnapshotStore
from vramwatch.collector.state.live import EVENTS_KEPT, LiveState, summary_row
from vramwatch.collector.state.rows import MAX_RANK_ROWS, rank_rows
from vramwatch.collector.store import Store
from vramwatch.errors import VramwatchError
from vramwatch.evidence import postmortem
from vramwatch.runlife import RunStory
from vramwatch.wire import FIELD_TABLE

#: Fields the run page charts (every field a dashboard chart fetches: wire.Field.charts)
SERIES_FIELDS = ("ts", *(f.name for f in FIELD_TABLE if f.charts))
#: most points embedded for one rank, and for all ranks together (spikes survive: min/max envelope)
SERIES_POINTS = 2000
REPORT_POINTS = 16_000
MIN_RANK_POINTS = 250
MAX_SERIES_RANKS = 64
HEATMAP_COLS = 240


class ReportError(VramwatchError, ValueError):
    """The report cannot be built (unknown run, missing database or front-end files)."""

    status = 404


def points_per_rank(ranks: int, budget: int = REPORT_POINTS) -> int:
    """Chart points for each of ``ranks`` embedded ranks: the budget shared, within bounds."""
    return max(MIN_RANK_POINTS, min(SERIES_POINTS, budget // max(1, ranks)))


def row_order(row: dict[str, Any]) -> tuple[int, float, int]:
    """Worst first: severity (liveness and OOMs included), then least headroom, then rank."""
    verdict = row.get("verdict") or {}
    headroom = verdict.get("checkpoint_headroom_bytes") or verdict.get("headroom_bytes")
    return (-int(row.get("severity") or 0), headroom if headroom is not None else 1e30, int(row["rank"]))


def report_data(db_path: str, run: str, *, points: int | None = None) -> dict[str, Any]:
    """Everything the run page needs, as the live API would answer it.

    ``points``: chart points per embedded rank (default: :func:`points_per_rank`)."""
    if not Path(db_path).exists():
        raise ReportError(f"db: database {db_path} does not exist")
    store = Store(db_path, readonly=True)
    try:
        if run not in store.runs():
            known = store.runs()
            hint = f"; runs in this database: {', '.join(known[:10])}" if known else "; the database has no runs"
            raise ReportError(f"run: no run named {run!r} in {db_path}{hint}")
        live = LiveState()
        live.rebuild(store.iter_samples(run))  # the one replay of the run's life
        live.tell_suspected(run, store.suspected_records(run))  # and what no replay rebuilds
        # one frozen snapshot, one judgement: the table, the runs row, the post-mortem and the advice
        frozen = live.freeze(run, time.time(), events=EVENTS_KEPT)
        if frozen is None:
            raise ReportError(f"run: no samples of {run!r} in {db_path}")
        story = frozen.story
        rows = rank_rows(frozen)
        # the ranks to embed: the rows' worst-first order, the one report --url uses too
        by_key = {(s.host, s.rank): s for s in frozen.ranks}
        chosen = [by_key[r["host"], r["rank"]] for r in sorted(rows, key=row_order)[:MAX_SERIES_RANKS]]
        rank0 = [s for s in frozen.ranks if s.rank == 0 and s not in chosen]
        series: dict[str, Any] = {}
        phases: dict[str, Any] = {}
        events: dict[str, Any] = {}
        for s in frozen.ranks:
            key = f"{s.host}\u0000{s.rank}"
            events[key] = [{"run": s.run, "host": s.host, "rank": s.rank, **e} for e in s.events]
        embedded = chosen + rank0[:1]
        per_rank = points if points is not None else points_per_rank(len(embedded))
        for s in embedded:
            key = f"{s.host}\u0000{s.rank}"
            series[key] = run_chart(store, run, s.rank, host=s.host, fields=list(SERIES_FIELDS), points=per_rank)
            phases[key] = store.phase_samples(run, s.host, s.rank)
        evidence = _evidence(db_path, run, store, live, story)
        advice = _advice(run, live)
        heatmap = {
            x: {f: run_heatmap(store, run, field=f, x=x, cols=HEATMAP_COLS) for f in ("headroom", "reserved")}
            for x in ("step", "ts")
        }
        return {
            "run": run,
            "generated_at": time.time(),
            "db": os.path.basename(db_path),
            "runs": [summary_row(frozen)],
            "ranks": rows,
            "series": series,
            "phases": phases,
            "events": events,
            "heatmap": heatmap,
            **evidence,
            **advice,
        }
    finally:
        store.close()


def _advice(run: str, live: LiveState) -> dict[str, Any]:
    """The advice document the dashboard's panel shows (``advice`` key; absent when the engines
    cannot say), decided on the rebuilt live state as the collector's route decides."""
    from vramwatch.collector.reads.advice import live_view
    from vramwatch.decisions.advice import decide
    from vramwatch.decisions.readiness import ReadinessConfig

    config = ReadinessConfig()
    view = live_view(live, run, config)
    return {} if view is None else {"advice": decide(view, [], config=config).as_dict()}


def _evidence(db_path: str, run: str, store: Store, live: LiveState, story: RunStory) -> dict[str, Any]:
    """The run's snapshot list, leak suspects and named foreign processes, and its post-mortem
    when a rank failed or something is still open at the end, a leak (``postmortem`` key absent
    otherwise), judged as ``story`` (the table's).
    Cost: one sequential read of the run's samples, the snapshot diffs of leaking ranks."""
    from vramwatch.collector.ingest.processes import foreign_only, rank_pids, report_doc

    snapshots, book = SnapshotStore.beside(db_path), ProcessBook.beside(db_path)
    diffs = DiffCache(snapshots)
    infos = snapshots.list(run)
    pids = rank_pids(live, run)
    out: dict[str, Any] = {"snapshots": [i.to_dict() for i in infos],
                           "suspects": [s.to_dict() for s in run_suspects(diffs, live, run, infos)],
                           "processes": [report_doc(foreign_only(r, pids)) for r in book.run(run)]}
    pm = postmortem.build(run, lambda: store.iter_samples(run), now=story.now, story=story)
    if pm.first_failure is not None or pm.incidents or pm.open_findings:
        enrich_postmortem(pm, snapshots=snapshots, diffs=diffs, processes=book, live=live)
        doc = pm.to_dict()
        for r in doc["ranks"]:
            r.pop("last_sample", None)  # the verdict table has the last sample; 512 of them add ~0.5 MB
        out["postmortem"] = doc
    return out


__all__ = [
    "HEATMAP_COLS", "MAX_RANK_ROWS", "MAX_SERIES_RANKS", "REPORT_POINTS", "SERIES_FIELDS", "ReportError",
    "points_per_rank", "report_data", "row_order",
]
