"""Merging the answers of several collectors (shards) into one, as the front serves them.

Pure functions over the shards' JSON documents (no I/O). Rules, each defined once here:

* a rank row is tagged with the ``shard`` that owns it; a shard that did not answer keeps
  its last known rows, marked ``unreachable: true`` and ``liveness: "unreachable"``;
* a run row sums counts (ranks, hosts, samples, OOMs, suspected OOMs, restarts, deaths), keeps the latest time
  and step, the minimum headroom and the soonest OOM, the worst state by
  :func:`verdicts.severity`; its status is the run-life model's rule applied to the sum of the
  shards' tallies (:class:`vramwatch.runlife.RunTally`: one shard's ranks all ended while
  another's run on is a running run), the worst by severity only for a shard that sends none;
* events are concatenated and ordered as a collector orders them (step, rank);
* a post-mortem's first failure is the earliest across shards (a rank stopped with the job
  only when no shard has another failure), its status the model's rule on the summed tallies;
* advice and compare figures are recomputed on the union of the shards' ranks (the same
  answer as one collector holding them all); snapshot links point at the front.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from vramwatch.decisions.advice import join
from vramwatch.decisions.figures import RunFigures
from vramwatch.incidents.incident import KIND_ORDER
from vramwatch.incidents.nextsteps import ACTION_ORDER
from vramwatch.runlife import RunTally
from vramwatch.verdicts import RUN_STATUS_SEVERITY, SEVERITY, SILENT_AFTER_S

_STATUS_ORDER = {str(k): v for k, v in RUN_STATUS_SEVERITY.items()}


def _merged_status(statuses: list[Any], tallies: list[Any]) -> str | None:
    """The model's status of the summed tallies when every part sends one; else the worst status."""
    if tallies and all(isinstance(t, dict) for t in tallies) and len(tallies) == len(statuses):
        total = RunTally()
        for t in tallies:
            total = total + RunTally.from_dict(t)
        return str(total.status)
    known = [s for s in statuses if s in _STATUS_ORDER]
    return max(known, key=_STATUS_ORDER.__getitem__) if known else None


@dataclass(frozen=True)
class ShardAnswer:
    """One shard's answer to one request: ``data`` is None when it did not answer in time."""

    shard: str
    data: Any
    error: str | None = None
    stale: bool = False  # data is the last known answer, the shard did not answer now
    status: int | None = None  # the shard's 4xx when it refused the request (``error``: its detail)

    @property
    def refused(self) -> bool:
        """The shard answered and refused this request (unknown run, bad parameter): the
        request's fault, not the shard's, so it is not unreachable and has no stale answer."""
        return self.status is not None and 400 <= self.status < 500


def _min(a: Any, b: Any) -> Any:
    if a is None:
        return b
    return a if b is None else min(a, b)


def _max(a: Any, b: Any) -> Any:
    if a is None:
        return b
    return a if b is None else max(a, b)


def _merge_run_row(into: dict[str, Any], row: dict[str, Any], shard: str) -> None:
    for key in ("ranks", "hosts", "samples", "ooms", "restarts", "deaths", "silent_ranks", "dead_ranks",
                "suspected_ooms"):
        if isinstance(row.get(key), int):
            into[key] = (into.get(key) or 0) + row[key]
    for key in ("last_ts", "last_step", "last_seen"):
        into[key] = _max(into.get(key), row.get(key))
    for key in ("first_ts",):
        into[key] = _min(into.get(key), row.get(key))
    for key in ("min_headroom_bytes", "seconds_to_oom"):
        into[key] = _min(into.get(key), row.get(key))
    # a job-wide incident is one on every shard it touched: the most any shard saw, not the sum
    into["incidents"] = _max(into.get("incidents"), row.get("incidents"))
    state = row.get("worst_state")
    if state is not None and SEVERITY.get(state, -1) > SEVERITY.get(into.get("worst_state") or "", -1):
        into["worst_state"], into["worst_rank"] = state, row.get("worst_rank")
    into.setdefault("_statuses", []).append(row.get("status"))
    into.setdefault("_tallies", []).append(row.get("tally"))
    into.setdefault("shards", []).append(shard)


def _finish_run_row(row: dict[str, Any]) -> dict[str, Any]:
    statuses, tallies = row.pop("_statuses", []), row.pop("_tallies", [])
    row["status"] = _merged_status(statuses, tallies)
    if tallies and all(isinstance(t, dict) for t in tallies):
        total = RunTally()
        for t in tallies:
            total = total + RunTally.from_dict(t)
        row["tally"] = total.as_dict()
    return row


def merge_runs(answers: Sequence[ShardAnswer]) -> list[dict[str, Any]]:
    runs: dict[str, dict[str, Any]] = {}
    for answer in answers:
        for row in answer.data or []:
            merged = runs.setdefault(row["run"], {"run": row["run"], "worst_state": None, "status": None})
            _merge_run_row(merged, row, answer.shard)
            if answer.stale:
                merged.setdefault("unreachable_shards", []).append(answer.shard)
    return sorted((_finish_run_row(r) for r in runs.values()), key=lambda r: -(r.get("last_seen") or r.get("last_ts")
                                                                                 or 0))


def _rank_sort_key(row: dict[str, Any]) -> tuple[int, str]:
    return (row.get("rank", 0), str(row.get("host", "")))


def merge_ranks(answers: Sequence[ShardAnswer]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for answer in answers:
        for row in answer.data or []:
            tagged = {**row, "shard": answer.shard}
            tagged.pop("version", None)  # a shard's own counter: meaningless across shards
            if answer.stale:
                tagged["unreachable"] = True
                tagged["liveness"] = "unreachable"
            out.append(tagged)
    out.sort(key=_rank_sort_key)
    return out


def merge_lists(answers: Sequence[ShardAnswer], *, order: Sequence[str] = ("step", "rank")) -> list[dict[str, Any]]:
    """Events, phases, snapshots: concatenated, tagged with the shard, in the collectors' order."""
    out = [{**item, "shard": a.shard} for a in answers for item in (a.data or []) if isinstance(item, dict)]
    out.sort(key=lambda e: tuple(e.get(k) if e.get(k) is not None else -1 for k in order))
    return out


def merge_heatmap(answers: Sequence[ShardAnswer], cols: int = 240) -> dict[str, Any] | None:
    """Every shard's rows on one grid. Shards choose their bucket width from their own range
    (a power of two, :meth:`HeatmapCache._width`), so the grid is the coarsest width among them,
    doubled until at most ``2 x cols`` columns span the union; finer cells fold into it with
    the field's worst (headroom: the least; bytes: the most). Rows carry their ``shard``."""
    docs = [(a.shard, a.data) for a in answers if isinstance(a.data, dict) and a.data.get("rows")]
    if not docs:
        return None
    worst = min if docs[0][1].get("field", "headroom") == "headroom" else max
    for _, doc in docs:  # a width of 0, a negative or an infinite one cannot place a cell
        if not (isinstance(doc["bucket"], int | float) and 0 < doc["bucket"] < math.inf):
            raise ValueError(f"bucket must be a positive finite number, got {doc['bucket']!r}")
    width = max(float(d["bucket"]) for _, d in docs)
    cells: list[tuple[tuple[int, str], dict[str, Any], dict[float, float | None]]] = []
    for shard, doc in docs:
        for row, z in zip(doc["rows"], doc["z"], strict=False):
            cells.append(((row["rank"], str(row["host"])), {**row, "shard": shard},
                          dict(zip(doc["x"], z, strict=False))))
    centres = [x for _, _, by_x in cells for x in by_x]
    lo, hi = min(centres), max(centres)
    while (hi // width) - (lo // width) + 1 > 2 * cols:
        width *= 2
    first, last = int(lo // width), int(hi // width)
    z_out = []
    for _, _, by_x in sorted(cells, key=lambda c: c[0]):
        row: list[float | None] = [None] * (last - first + 1)
        for x, value in by_x.items():
            if value is not None:
                i = int(x // width) - first
                row[i] = value if row[i] is None else worst(row[i], value)
        z_out.append(row)
    return {**docs[0][1], "x": [(b + 0.5) * width for b in range(first, last + 1)],
            "bucket": int(width) if width.is_integer() else width,
            "rows": [row for _, row, _ in sorted(cells, key=lambda c: c[0])], "z": z_out,
            "outside": sum(int(d.get("outside") or 0) for _, d in docs)}


def merge_postmortem(run: str, answers: Sequence[ShardAnswer]) -> dict[str, Any]:
    ranks: list[dict[str, Any]] = []
    snapshots: list[dict[str, Any]] = []
    suspects: list[dict[str, Any]] = []
    first: dict[str, Any] | None = None
    statuses: list[Any] = []
    tallies: list[Any] = []

    def order(f: dict[str, Any]) -> tuple[bool, bool, float, bool]:  # runlife.first_failure's rule
        return (f["cause"] == "stopped", f["cause"] == "collective_timeout", f["ts"], f["cause"] != "oom")

    for answer in answers:
        doc = answer.data
        if not isinstance(doc, dict):
            continue
        ranks.extend({**r, "shard": answer.shard} for r in doc.get("ranks", []))
        snapshots.extend(snapshot_via_front({**s, "shard": answer.shard}) for s in doc.get("snapshots", []))
        suspects.extend({**s, "shard": answer.shard} for s in doc.get("suspects", []))
        f = doc.get("first_failure")
        if f and (first is None or order(f) < order(first)):
            first = {**f, "shard": answer.shard}
        statuses.append(doc.get("status"))
        tallies.append(doc.get("tally"))
    ranks.sort(key=lambda r: (r.get("rank", 0), str(r.get("host", ""))))
    suspects.sort(key=lambda s: (s.get("rank", 0), str(s.get("host", ""))))
    docs = [a.data for a in answers if isinstance(a.data, dict)]
    return {"run": run, "status": _merged_status(statuses, tallies), "first_failure": first, "ranks": ranks,
            "snapshots": snapshots, "suspects": suspects, **merge_incidents(docs)}


def merge_incidents(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Shards' incidents as one story: the same failure seen by several shards (within the silence
    window) is one incident, named by the shard that holds its cause (an OOM before a death before
    a stop), with the ranks every shard saw it take down; open findings and next steps joined
    (a step once per action and rank). O(n log n) in incidents."""
    found = sorted((i for d in docs for i in d.get("incidents") or []), key=lambda i: i.get("ts") or 0.0)
    rank_of_kind = {kind: i for i, kind in enumerate(KIND_ORDER)}
    merged: list[dict[str, Any]] = []
    for inc in found:
        last = merged[-1] if merged else None
        if last is not None and (inc.get("ts") or 0.0) - (last.get("_first_ts") or 0.0) <= SILENT_AFTER_S:
            ranks = list(dict.fromkeys([*last["ranks_affected"], *inc.get("ranks_affected", [])]))
            unknown = len(KIND_ORDER)
            if rank_of_kind.get(inc.get("kind"), unknown) < rank_of_kind.get(last.get("kind"), unknown):
                merged[-1] = {**inc, "_first_ts": last["_first_ts"]}
            merged[-1]["ranks_affected"] = ranks
            merged[-1]["restarted"] = bool(last.get("restarted")) and bool(inc.get("restarted"))
        else:
            merged.append({**inc, "ranks_affected": list(inc.get("ranks_affected", [])), "_first_ts": inc.get("ts")})
    for inc in merged:
        inc.pop("_first_ts", None)
    steps: dict[tuple[Any, Any], dict[str, Any]] = {}
    for d in docs:
        for step in d.get("next") or []:
            steps.setdefault((step.get("action"), step.get("rank")), step)
    order = {a: i for i, a in enumerate(ACTION_ORDER)}
    joined = sorted(steps.values(), key=lambda s: order.get(s.get("action"), len(order)))
    if any(s.get("action") != "hold" for s in joined):
        joined = [s for s in joined if s.get("action") != "hold"]  # a shard's "nothing to do" is not the run's
    return {"incidents": merged, "open_findings": [f for d in docs for f in d.get("open_findings") or []],
            "next": joined}


def merge_advice(answers: Sequence[ShardAnswer]) -> dict[str, Any] | None:
    """Advice over every shard's ranks, decided once on all of them (:func:`decisions.advice.join`):
    the same readiness, binding rank, largest batch and recommendation one collector holding
    the whole run would give. ``shards``: those that contributed ranks."""
    docs = [(a.shard, a.data) for a in answers if isinstance(a.data, dict)]
    if not docs:
        return None
    doc = join([d for _, d in docs]).as_dict()
    doc["shards"] = [shard for shard, _ in docs]
    return doc


def merge_figures(run: str, answers: Sequence[ShardAnswer]) -> dict[str, Any] | None:
    """Every shard's per-rank compare figures of ``run`` as one document (None: no shard has it)."""
    found = [a for a in answers if isinstance(a.data, dict)]
    if not found:
        return None
    return {**RunFigures.join(run, [a.data for a in found]).as_dict(), "shards": [a.shard for a in found]}


def snapshot_via_front(item: dict[str, Any]) -> dict[str, Any]:
    """A shard's snapshot entry with its download ``url`` pointing at the front (which streams it
    from the owning shard): the dashboard and ``curl`` need not reach the shard."""
    if "id" in item and "shard" in item:
        ident, shard = quote(str(item["id"]), safe=""), quote(str(item["shard"]), safe="")
        return {**item, "url": f"/api/v1/snapshots/{ident}?shard={shard}"}
    return item
