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

Memory: one document's points (Prometheus caps a range query at 11,000 points per series).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from vramwatch.wire import Sample

from .common import ImportOptions, ImportStats, MiB, RowError, base_sample, checked

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


def _points(results: Iterable[dict[str, Any]], where: str, stats: ImportStats
            ) -> dict[Gpu, dict[float, dict[str, float]]]:
    joined: dict[Gpu, dict[float, dict[str, float]]] = {}
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
            points.setdefault(ts, {})[role] = value
    return joined


def samples_from_results(results: list[dict[str, Any]], run: str, step_s: float, where: str,
                         stats: ImportStats) -> Iterator[Sample]:
    """Samples (per GPU, in time order) from the ``result`` list of one query answer."""
    joined = _points(results, where, stats)
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


def read(path: str, options: ImportOptions, stats: ImportStats) -> Iterator[Sample]:
    """Samples from a file holding one query_range answer, or one per line."""
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        docs = [(1, orjson.loads(data))]
    except orjson.JSONDecodeError:
        docs = []
        for lineno, line in enumerate(data.splitlines(), 1):
            if line.strip():
                try:
                    docs.append((lineno, orjson.loads(line)))
                except orjson.JSONDecodeError as exc:
                    raise RowError(path, lineno, "json", f"invalid JSON: {exc}") from None
    results: list[dict[str, Any]] = []
    for lineno, doc in docs:
        results.extend(results_of(doc, f"{path}:{lineno}" if len(docs) > 1 else path))
    yield from samples_from_results(results, options.run or DEFAULT_RUN, STEP_S, path, stats)
