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

The documents come from the collector (:mod:`vramwatch.collector.reads.rundoc` for a database, the
API for ``--url``); this module renders them into the page.
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
from vramwatch.collector.reads.rundoc import (
    HEATMAP_COLS,
    MAX_RANK_ROWS,
    MAX_SERIES_RANKS,
    REPORT_POINTS,
    SERIES_FIELDS,
    ReportError,
    points_per_rank,
    report_data,
    row_order,
)
from vramwatch.collector.serving.app import dashboard_dir, dashboard_plotly_js_path
from vramwatch.collector.serving.bundle import BundleError, bundle


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
    chosen = sorted(rows, key=row_order)[:MAX_SERIES_RANKS]
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
    "MAX_SERIES_RANKS", "REPORT_POINTS", "SERIES_FIELDS", "ReportError", "build_report", "points_per_rank",
    "render_report", "report_data", "report_data_remote", "row_order", "write_report",
]
