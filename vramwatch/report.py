"""``vramwatch report RUN --db PATH --out FILE``: one run's dashboard as a single HTML file
(``--url URL`` instead of ``--db``: built from a collector's or a front's API, so a run spread
over several collectors gets one report).

For post-mortems and sharing: the file opens offline, from disk or a mail attachment,
with no collector behind it. It is the live dashboard itself (the same index.html,
app.js and style.css, plotly.js inlined) with every API answer it needs embedded as
``window.VRAMWATCH_STATIC``: the partial plotly bundle the dashboard serves (1.5 MB, not the
full 4.8 MB one), verdicts from replaying the run through the same
TrendEngine the collector uses, min/max-envelope series per rank (as ``/chart``), phases,
events, the ranks x steps heatmaps, the snapshot list, the advice (readiness and the next step
of the batch procedure) and, when a rank failed, the post-mortem (first failure, how each rank
ended). Zooming works on the embedded points.

Series are embedded for at most ``MAX_SERIES_RANKS`` ranks (the worst first, plus rank 0),
sharing a budget of ``REPORT_POINTS`` chart points (each rank gets between
``MIN_RANK_POINTS`` and ``SERIES_POINTS``), so the data stays about 2 MB whatever the run's
length or width; the verdict table and the heatmap cover every rank. Heatmap columns are
bounded by ``HEATMAP_COLS`` whatever the timestamps.
"""

from __future__ import annotations

import html
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from vramwatch import verdicts
from vramwatch.collector.app import dashboard_dir, dashboard_plotly_js_path
from vramwatch.collector.bundle import BundleError, bundle
from vramwatch.collector.live import LiveState, summary_row
from vramwatch.collector.processes import ProcessBook
from vramwatch.collector.rows import MAX_RANK_ROWS, rank_rows
from vramwatch.collector.snapshots import SnapshotStore
from vramwatch.collector.store import Store
from vramwatch.collector.suspects import DiffCache, enrich_postmortem, run_suspects
from vramwatch.collector.views import run_chart, run_heatmap
from vramwatch.evidence import postmortem
from vramwatch.runlife import RunStory

#: Fields the run page charts (the rank chart's list in rankchart.js, and memsplit.js's
#: device split / host memory fields).
SERIES_FIELDS = (
    "ts", "allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "nvml_used_bytes",
    "total_bytes", "inactive_split_bytes", "alloc_retries",
    "foreign_used_bytes", "host_rss_bytes", "host_children_rss_bytes", "host_available_bytes", "host_pinned_bytes",
)
#: most points embedded for one rank, and for all ranks together (spikes survive: min/max envelope)
SERIES_POINTS = 2000
REPORT_POINTS = 16_000
MIN_RANK_POINTS = 250
MAX_SERIES_RANKS = 64
HEATMAP_COLS = 240


class ReportError(ValueError):
    """The report cannot be built (unknown run, missing database or front-end files)."""


def points_per_rank(ranks: int, budget: int = REPORT_POINTS) -> int:
    """Chart points for each of ``ranks`` embedded ranks: the budget shared, within bounds."""
    return max(MIN_RANK_POINTS, min(SERIES_POINTS, budget // max(1, ranks)))


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
        live.rebuild(store.iter_samples(run))
        states = live.for_run(run)
        now = time.time()
        story = live.story(run, states, now)  # one judgement for the table, the runs row and the post-mortem
        rows = rank_rows(states, story)
        # the ranks to embed: the rows' worst-first order, the one report --url uses too
        by_key = {(s.host, s.rank): s for s in states}
        chosen = [by_key[r["host"], r["rank"]] for r in sorted(rows, key=_row_order)[:MAX_SERIES_RANKS]]
        rank0 = [s for s in states if s.rank == 0 and s not in chosen]
        series: dict[str, Any] = {}
        phases: dict[str, Any] = {}
        events: dict[str, Any] = {}
        for s in states:
            key = f"{s.host}\u0000{s.rank}"
            events[key] = [{"run": s.run, "host": s.host, "rank": s.rank, **e} for e in s.events]
        embedded = chosen + rank0[:1]
        per_rank = points if points is not None else points_per_rank(len(embedded))
        for s in embedded:
            key = f"{s.host}\u0000{s.rank}"
            series[key] = run_chart(store, run, s.rank, host=s.host, fields=list(SERIES_FIELDS), points=per_rank)
            phases[key] = store.phase_samples(run, s.host, s.rank)
        evidence = _evidence(db_path, run, store, live, story)
        advice = _advice(run, states)
        heatmap = {
            x: {f: run_heatmap(store, run, field=f, x=x, cols=HEATMAP_COLS) for f in ("headroom", "reserved")}
            for x in ("step", "ts")
        }
        return {
            "run": run,
            "generated_at": time.time(),
            "db": os.path.basename(db_path),
            "runs": [summary_row(states, story, now)],
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


def _advice(run: str, states: list[Any]) -> dict[str, Any]:
    """The advice document the dashboard's panel shows (``advice`` key; absent when the engines
    cannot say), decided on the rebuilt live state as the collector's route decides."""
    from vramwatch.collector.routes_decisions import live_view
    from vramwatch.decisions.advice import decide
    from vramwatch.decisions.readiness import ReadinessConfig

    config = ReadinessConfig()
    view = live_view(run, states, config)
    return {} if view is None else {"advice": decide(view, [], config=config).as_dict()}


def _evidence(db_path: str, run: str, store: Store, live: LiveState, story: RunStory) -> dict[str, Any]:
    """The run's snapshot list, leak suspects and named foreign processes, and its post-mortem
    when a rank failed (``postmortem`` key absent otherwise), judged as ``story`` (the table's).
    Cost: two sequential reads of the run's samples, the snapshot diffs of leaking ranks."""
    from vramwatch.collector.processes import foreign_only, rank_pids, report_doc

    snapshots, book = SnapshotStore.beside(db_path), ProcessBook.beside(db_path)
    diffs = DiffCache(snapshots)
    infos = snapshots.list(run)
    pids = rank_pids(live, run)
    out: dict[str, Any] = {"snapshots": [i.to_dict() for i in infos],
                           "suspects": [s.to_dict() for s in run_suspects(diffs, live, run, infos)],
                           "processes": [report_doc(foreign_only(r, pids)) for r in book.run(run)]}
    pm = postmortem.build(run, lambda: store.iter_samples(run), now=story.now, story=story)
    if pm.first_failure is not None:
        enrich_postmortem(pm, snapshots=snapshots, diffs=diffs, processes=book, live=live)
        doc = pm.to_dict()
        for r in doc["ranks"]:
            r.pop("last_sample", None)  # the verdict table has the last sample; 512 of them add ~0.5 MB
        out["postmortem"] = doc
    return out


def _script_safe(js: str) -> str:
    # Inline <script> content ends at the first "</script", whatever JS thinks of it.
    return js.replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT")


def _json_for_script(data: Any) -> str:
    text = orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY).decode()
    # Escaped so that no data string (a run named "</script><script>...") can end the
    # script element or open a comment: JSON keeps the same value with \u escapes.
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _replace_once(page: str, old: str, new: str) -> str:
    if page.count(old) != 1:
        raise ReportError(f"dashboard: index.html no longer contains {old!r} exactly once; cannot inline it")
    return page.replace(old, new)


def _row_order(row: dict[str, Any]) -> tuple[int, float, int]:
    """Worst first: severity (liveness and OOMs included), then least headroom, then rank."""
    verdict = row.get("verdict") or {}
    headroom = verdict.get("checkpoint_headroom_bytes") or verdict.get("headroom_bytes")
    return (-int(row.get("severity") or 0), headroom if headroom is not None else 1e30, int(row["rank"]))


def _all_rank_rows(doc: Callable[..., Any]) -> list[dict[str, Any]]:
    """Every rank row, page by page (a collector pages ``/ranks`` at MAX_RANK_ROWS; a front
    answers every page with the full list, so a page that adds no rank ends it)."""
    rows: list[dict[str, Any]] = []
    seen: set[tuple[str, int]] = set()
    while True:
        page = doc("ranks", offset=len(rows)) if rows else doc("ranks")
        new = [r for r in page if (r["host"], r["rank"]) not in seen]
        rows += new
        seen.update((r["host"], r["rank"]) for r in new)
        if len(page) < MAX_RANK_ROWS or not new:
            return rows


def report_data_remote(url: str, run: str, *, points: int | None = None,
                       get: Callable[..., Any] | None = None) -> dict[str, Any]:
    """:func:`report_data` asked of a collector or a front (``vramwatch report --url``): the same
    document from the API, so a run spread over shards gets one report. Cost: one request per
    run-level document plus two per charted rank (at most ``MAX_SERIES_RANKS + 1``).
    ``get(url, path, params)``: :func:`vramwatch.remote.get_json` (raises its RemoteError)."""
    from vramwatch import remote

    get = get or remote.get_json

    def doc(what: str, **params: Any) -> Any:
        return get(url, remote.run_path(run, what), params or None)

    rows = _all_rank_rows(doc)
    chosen = sorted(rows, key=_row_order)[:MAX_SERIES_RANKS]
    chosen += [r for r in rows if r["rank"] == 0 and r not in chosen][:1]
    per_rank = points if points is not None else points_per_rank(len(chosen))
    events: dict[str, list[Any]] = {f"{r['host']}\u0000{r['rank']}": [] for r in rows}
    for event in doc("events"):
        events.setdefault(f"{event['host']}\u0000{event['rank']}", []).append(event)
    series, phases = {}, {}
    for r in chosen:
        key = f"{r['host']}\u0000{r['rank']}"
        series[key] = doc("chart", rank=r["rank"], host=r["host"], fields=",".join(SERIES_FIELDS), points=per_rank)
        phases[key] = doc("phases", rank=r["rank"], host=r["host"])
    heatmap = {x: {f: doc("heatmap", field=f, x=x, cols=HEATMAP_COLS) for f in ("headroom", "reserved")}
               for x in ("step", "ts")}
    data: dict[str, Any] = {
        "run": run, "generated_at": time.time(), "db": url,
        "runs": [r for r in get(url, "/api/v1/runs", None) if r["run"] == run],
        "ranks": rows, "series": series, "phases": phases, "events": events, "heatmap": heatmap,
        "snapshots": doc("snapshots"),
        "suspects": _optional(doc, "suspects"),
        "processes": _optional(doc, "processes"),
    }
    try:
        data["advice"] = doc("advice")
    except remote.RemoteError as exc:
        if exc.status is None or exc.status >= 500:
            raise  # an outage is an outage; a collector without the route has no advice to embed
    pm = doc("postmortem")
    if pm.get("first_failure") is not None:
        for r in pm.get("ranks", []):
            r.pop("last_sample", None)
        data["postmortem"] = pm
    return data


def _optional(doc: Callable[..., Any], what: str) -> list[Any]:
    """A run-level list an older collector does not serve (404 on the route): empty."""
    from vramwatch import remote

    try:
        return doc(what)
    except remote.RemoteError as exc:
        if exc.status == 404:
            return []
        raise


def build_report(db_path: str, run: str) -> str:
    """Self-contained HTML (plotly.js, CSS, JS and data inlined) of ``run``'s dashboard page."""
    return render_report(report_data(str(db_path), run))


def render_report(data: dict[str, Any]) -> str:
    """The dashboard page with ``data`` (:func:`report_data` or :func:`report_data_remote`) inlined."""
    run = data["run"]
    static = dashboard_dir()
    try:
        page = (static / "index.html").read_text(encoding="utf-8")
        css = (static / "style.css").read_text(encoding="utf-8")
        app_js = bundle(static)  # the ES modules as one inline module script
        plotly_js = dashboard_plotly_js_path().read_text(encoding="utf-8")
    except (OSError, BundleError) as exc:
        raise ReportError(f"dashboard: front-end files missing from this installation ({exc})") from None
    page = _replace_once(page, "<title>vramwatch</title>", f"<title>vramwatch report · {html.escape(run)}</title>")
    css = css.replace("</style", "<\\/style")
    page = _replace_once(page, '<link rel="stylesheet" href="static/style.css">', f"<style>\n{css}\n</style>")
    plotly_tag = f"<script>{_script_safe(plotly_js)}</script>"
    page = _replace_once(page, '<script id="plotly-js" src="vendor/plotly.min.js" async></script>', plotly_tag)
    data_tag = f"<script>window.VRAMWATCH_STATIC = {_json_for_script({**data, 'meta': verdicts.meta()})};</script>"
    app_tag = f"{data_tag}\n<script type=\"module\">{_script_safe(app_js)}</script>"
    page = _replace_once(page, '<script type="module" src="static/app.js"></script>', app_tag)
    return page


def write_report(db_path: str, run: str, out: str | os.PathLike[str]) -> int:
    """Write the report to ``out``; returns its size in bytes."""
    text = build_report(db_path, run)
    data = text.encode("utf-8")
    Path(out).write_bytes(data)
    return len(data)


__all__ = [
    "MAX_SERIES_RANKS", "REPORT_POINTS", "ReportError", "build_report", "points_per_rank", "render_report",
    "report_data", "report_data_remote", "write_report",
]
