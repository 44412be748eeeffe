"""dcgm-exporter series from Prometheus: range-query documents → samples.

Input: the JSON body of ``GET /api/v1/query_range`` (``{"status": "success", "data":
{"resultType": "matrix", "result": [{"metric": {...}, "values": [[t, "v"], ...]}]}}``),
one document or several (one per line), e.g. from

    curl -G $PROM/api/v1/query_range --data-urlencode 'query={__name__=~"DCGM_FI_DEV_FB_(USED|FREE|RESERVED)"}' \\
         --data-urlencode start=... --data-urlencode end=... --data-urlencode step=15s

dcgm-exporter reports framebuffer memory in MiB (``etc/default-counters.csv``):
``DCGM_FI_DEV_FB_USED``, ``DCGM_FI_DEV_FB_FREE``, ``DCGM_FI_DEV_FB_RESERVED`` (and
``DCGM_FI_DEV_FB_TOTAL`` where enabled). Series are joined per GPU on ``Hostname`` and
``UUID`` and per timestamp; each point becomes a sample with ``nvml_used_bytes`` (FB_USED)
and ``total_bytes`` (FB_TOTAL, else USED + FREE + RESERVED) and nothing else: rank = the
``gpu`` label, host = ``Hostname``, step = the timestamp in whole seconds (dcgm series
have no training step: time is the step, so a gap in the data is a gap in steps, the
engine's slope reads bytes per second, and a re-import or ``vramwatch watch`` lands on the
same steps).

The same conversion serves ``vramwatch watch`` (:func:`samples_from_results`).

Memory: one document (at most ``max_record_bytes`` of JSON, 64 MiB) and the points joined so
far, at most ``max_record_bytes / 16`` per file (what one document of that size can hold: a
point is at least 16 bytes of JSON); past either the file is refused, naming the limit.
Prometheus itself caps a range query at 11,000 points per series.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from vramwatch.bounded import LONG_LINE, LimitExceeded, Lines, open_input, size_text
from vramwatch.importers.common import RECORD_FLAG, ImportOptions, ImportStats, MiB, RowError, base_sample, checked
from vramwatch.wire import Sample

#: bytes of JSON a point takes at least (``[1715000000,"1"]``): the file's point budget
POINT_BYTES = 16
Joined = dict["Gpu", dict[float, dict[str, float]]]

#: dcgm-exporter metric → role; all in MiB.
DCGM_FB = {
    "DCGM_FI_DEV_FB_USED": "used",
    "DCGM_FI_DEV_FB_FREE": "free",
    "DCGM_FI_DEV_FB_RESERVED": "reserved",
    "DCGM_FI_DEV_FB_TOTAL": "total",
}
DEFAULT_RUN = "dcgm"
#: seconds per engine step for dcgm series (step = round(ts / STEP_S))
STEP_S = 1.0
#: the PromQL selector ``watch`` and the recipes use (dcgm-exporter's default counters)
DEFAULT_QUERY = '{__name__=~"DCGM_FI_DEV_FB_(USED|FREE|RESERVED|TOTAL)"}'


@dataclass(frozen=True)
class Gpu:
    """One GPU as dcgm-exporter labels it."""

    host: str
    uuid: str
    gpu: int


def gpu_of(labels: dict[str, str]) -> Gpu:
    """The GPU a series belongs to. Raises ValueError naming the missing label."""
    host = labels.get("Hostname") or labels.get("instance")
    uuid = labels.get("UUID")
    if not host:
        raise ValueError("series has no Hostname (or instance) label")
    if not uuid:
        raise ValueError("series has no UUID label")
    try:
        gpu = int(labels.get("gpu", "0"))
    except ValueError:
        raise ValueError(f"gpu label is not an index: {labels.get('gpu')!r}") from None
    return Gpu(host, uuid, gpu)


def sample_of(gpu: Gpu, ts: float, values: dict[str, float], run: str, step_s: float,
              known_total: float | None = None) -> dict[str, Any]:
    """One GPU at one instant → a sparse sample. Raises ValueError when it cannot be true.

    ``known_total``: this GPU's capacity (MiB) from an earlier instant. A device's capacity
    does not change, so a missed FB_FREE point reuses it; used memory is never carried over.
    """
    used = values.get("used")
    if used is None:
        raise ValueError("no DCGM_FI_DEV_FB_USED at this time")
    if "total" in values:
        total = values["total"]
    elif "free" in values:
        total = used + values["free"] + values.get("reserved", 0.0)
    elif known_total is not None:
        total = known_total
    else:
        raise ValueError("no DCGM_FI_DEV_FB_FREE or _FB_TOTAL at this time: the device capacity is unknown")
    for role, value in values.items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{role} is {value!r} MiB")
    sample = base_sample(run, gpu.host, gpu.gpu, round(ts / step_s), ts)
    sample["nvml_used_bytes"] = round(used * MiB)
    sample["total_bytes"] = round(total * MiB)
    sample["uuid"] = gpu.uuid
    sample["gpu"] = gpu.gpu
    return sample


@dataclass
class _Budget:
    """Joined points a file may hold: (GPU, time) pairs, counted as they are added."""

    left: int
    where: str
    max_record_bytes: int

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise LimitExceeded(self.where, RECORD_FLAG, f"more than {self.max_record_bytes // POINT_BYTES:,} points "
                                "(GPU x time) in one file: split it")


def _points(results: Iterable[dict[str, Any]], where: str, stats: ImportStats, joined: Joined | None = None,
            budget: _Budget | None = None) -> Joined:
    """Each series' points folded into ``joined`` per GPU and timestamp (a new dict when None)."""
    joined = {} if joined is None else joined
    for i, series in enumerate(results):
        labels = series.get("metric") or {}
        role = DCGM_FB.get(labels.get("__name__", ""))
        if role is None:
            continue  # other dcgm-exporter metrics in the same answer
        try:
            gpu = gpu_of(labels)
        except ValueError as exc:
            stats.bad(RowError(where, f"result[{i}]", "metric", str(exc)))
            continue
        points = joined.setdefault(gpu, {})
        values = series.get("values")
        if values is None and "value" in series:  # an instant query: one point
            values = [series["value"]]
        for j, point in enumerate(values or ()):
            try:
                ts, value = float(point[0]), float(point[1])
            except (TypeError, ValueError, IndexError):
                stats.bad(RowError(where, f"result[{i}]", f"values[{j}]", f"not a [time, \"value\"] pair: {point!r}"))
                continue
            at = points.get(ts)
            if at is None:
                if budget is not None:
                    budget.spend()
                at = points[ts] = {}
            at[role] = value
    return joined


def samples_from_results(results: list[dict[str, Any]], run: str, step_s: float, where: str,
                         stats: ImportStats) -> Iterator[Sample]:
    """Samples (per GPU, in time order) from the ``result`` list of one query answer."""
    return samples_from_points(_points(results, where, stats), run, step_s, where, stats)


def samples_from_points(joined: Joined, run: str, step_s: float, where: str, stats: ImportStats) -> Iterator[Sample]:
    """Samples (per GPU, in time order) from points joined per GPU and time."""
    step = step_s
    for gpu in sorted(joined, key=lambda g: (g.host, g.gpu, g.uuid)):
        total: float | None = None
        for ts in sorted(joined[gpu]):
            stats.rows += 1
            at = f"{gpu.host} gpu {gpu.gpu} t={ts:.3f}"
            try:
                sample = sample_of(gpu, ts, joined[gpu][ts], run, step, total)
            except ValueError as exc:
                stats.bad(RowError(where, at, "values", str(exc)))
                continue
            total = sample["total_bytes"] / MiB
            out = checked(sample, where, at, stats)
            if out is not None:
                yield out


def results_of(doc: Any, where: str) -> list[dict[str, Any]]:
    """The ``result`` list of a query_range answer. Raises RowError naming what is wrong."""
    if not isinstance(doc, dict):
        raise RowError(where, 1, "document", "not a Prometheus API answer (expected a JSON object)")
    if doc.get("status") != "success":
        raise RowError(where, 1, "status", f"{doc.get('status')!r}: {doc.get('error', 'not a successful answer')}")
    data = doc.get("data")
    if not isinstance(data, dict) or data.get("resultType") not in ("matrix", "vector"):
        raise RowError(where, 1, "data.resultType", "must be matrix (query_range) or vector (query)")
    result = data.get("result")
    if not isinstance(result, list):
        raise RowError(where, 1, "data.result", "must be a list")
    return result


def _documents(path: str, max_bytes: int) -> Iterator[tuple[int, Any]]:
    """(line, document) of a file holding one answer (pretty-printed or not) or one per line.
    A file within ``max_bytes`` is tried whole first; a larger one must be one document per
    line, each within ``max_bytes`` (read line by line, never whole)."""
    with open_input(path) as fh:
        data = fh.read(max_bytes + 1)
    if len(data) <= max_bytes:
        try:
            yield 1, orjson.loads(data)
            return
        except orjson.JSONDecodeError:
            lines: Iterable[Any] = data.splitlines()
            del data
            yield from _parse_lines(path, lines, max_bytes, large=False)
            return
    del data
    with open_input(path) as fh:
        yield from _parse_lines(path, Lines(fh, max_bytes), max_bytes, large=True)


def _parse_lines(path: str, lines: Iterable[Any], max_bytes: int, large: bool) -> Iterator[tuple[int, Any]]:
    too_big = f"larger than {size_text(max_bytes)}"
    for lineno, line in enumerate(lines, 1):
        if line is LONG_LINE:
            raise LimitExceeded(f"{path}:{lineno}", RECORD_FLAG, f"a document {too_big}")
        if line.strip():
            try:
                yield lineno, orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                if large and lineno == 1:  # a pretty-printed answer too large to read whole
                    raise LimitExceeded(path, RECORD_FLAG, f"{too_big} and not one document per line") from None
                raise RowError(path, lineno, "json", f"invalid JSON: {exc}") from None


def read(path: str, options: ImportOptions, stats: ImportStats) -> Iterator[Sample]:
    """Samples from a file holding one query_range answer, or one per line (series of the same
    GPU in different documents are joined). Documents are folded in one at a time."""
    joined: Joined = {}
    budget = _Budget(options.max_record_bytes // POINT_BYTES, path, options.max_record_bytes)
    many = False
    for lineno, doc in _documents(path, options.max_record_bytes):
        many = many or lineno > 1
        where = f"{path}:{lineno}" if many else path
        _points(results_of(doc, where), path, stats, joined, budget)
    yield from samples_from_points(joined, options.run or DEFAULT_RUN, STEP_S, path, stats)
