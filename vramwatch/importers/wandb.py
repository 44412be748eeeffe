"""W&B system-metric CSV: GPU memory of every GPU the run's machine had.

Two documented ways to get one:

* the API: ``wandb.Api().run(path).history(stream="system").to_csv("sys.csv")``, columns
  ``_runtime``, ``_timestamp``, ``system.gpu.N.memoryAllocatedBytes``,
  ``system.gpu.N.memoryAllocated`` (percent of the device), ...;
* the app's panel export, columns ``"<run> - system/gpu.N.memoryAllocatedBytes"`` (and
  ``__MIN``/``__MAX`` envelopes, ignored) plus ``_timestamp`` when exported with it.

W&B reads these from NVML: device-level used memory. Each row and GPU becomes a sample
with ``nvml_used_bytes`` and ``total_bytes`` (``--device-memory``, else bytes / percent)
and nothing else; rank = GPU index, step = the row's ordinal for that GPU. Empty cells
(W&B logs system metrics on their own 15 s clock, other metrics leave gaps) are not
measurements and make no sample.

Cost: one ``csv`` row per line; memory O(columns), a row at most ``max_line_bytes`` (longer:
a bad row, never held whole).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from vramwatch.bounded import CsvRows, LimitExceeded, open_input
from vramwatch.importers.common import (
    DEFAULT_HOST,
    ImportOptions,
    ImportStats,
    RowError,
    as_bytes,
    base_sample,
    capacity_from_share,
    checked,
    stem,
)
from vramwatch.wire import Sample
from vramwatch.wire.tracefile import LINE_FLAG

_COLUMN = re.compile(
    r"(?:(?P<run>.+?) - )?system[./]gpu\.(?P<gpu>\d+)\.(?P<metric>memoryAllocatedBytes|memoryAllocated)\Z")
#: absolute time columns, in order of preference: the API's ``_timestamp`` (unix seconds), a
#: panel export with the x axis set to wall time (unix ms or an ISO date)
_TIME_COLUMNS = ("_timestamp", "timestamp", "Wall Time")


def _unix_time(text: str) -> float:
    """``1715679075.41``, ``1715679075410`` (ms) or ``2024-05-14T09:31:15.41Z`` → unix seconds."""
    try:
        value = float(text)
    except ValueError:
        from datetime import UTC, datetime

        parsed = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()
    return value / 1000.0 if value > 1e11 else value


def _layout(header: list[str], path: str) -> tuple[int, dict[tuple[str, int], dict[str, int]]]:
    """(timestamp column, {(run prefix, gpu): {metric: column}}) of a header row."""
    names = [h.strip() for h in header]
    ts_col = next((names.index(n) for n in _TIME_COLUMNS if n in names), None)
    if ts_col is None:
        raise RowError(path, 1, "header", "needs a _timestamp (or Wall Time) column: export with "
                       "run.history(stream='system').to_csv(...), or set the panel's x axis to Wall Time")
    gpus: dict[tuple[str, int], dict[str, int]] = {}
    for i, name in enumerate(names):
        match = _COLUMN.match(name)
        if match:
            gpus.setdefault((match["run"] or "", int(match["gpu"])), {})[match["metric"]] = i
    if not any("memoryAllocatedBytes" in cols for cols in gpus.values()):
        raise RowError(path, 1, "header", "no system.gpu.N.memoryAllocatedBytes column: not a W&B system-metric "
                       "export, or GPU metrics were off")
    return ts_col, gpus


def read(path: str, options: ImportOptions, stats: ImportStats) -> Iterator[Sample]:
    """Samples from one W&B CSV export, in file order."""
    host = options.host or DEFAULT_HOST
    ordinal: dict[tuple[str, int], int] = {}
    capacity: dict[tuple[str, int], int] = {}
    with open_input(path) as fh:
        rows = iter(CsvRows(fh, path, options.max_line_bytes, LINE_FLAG))
        first = next(rows, None)
        if first is None:
            return
        if isinstance(first[1], LimitExceeded):
            raise RowError(path, 1, "header", f"{first[1].message} ({first[1].limit})")
        header = first[1]
        ts_col, gpus = _layout(header, path)
        for line, cells in rows:
            if isinstance(cells, LimitExceeded):
                stats.refused(path, line, cells)
                continue
            if not cells:
                continue
            stats.rows += 1
            try:
                ts = _unix_time(cells[ts_col])
            except (ValueError, IndexError):
                stats.bad(RowError(path, line, f"column {ts_col + 1} ({header[ts_col].strip()})",
                                   f"not a unix time: {cells[ts_col] if ts_col < len(cells) else ''!r}"))
                continue
            for (prefix, gpu), cols in gpus.items():
                key = (prefix, gpu)
                sample = _gpu_sample(path, line, cells, header, cols, options, stats, capacity.get(key))
                if sample is None:
                    continue
                capacity.setdefault(key, sample["total_bytes"])
                step = ordinal.get(key, 0)
                ordinal[key] = step + 1
                sample.update(base_sample(options.run or prefix or stem(path), host, gpu, step, ts))
                sample["gpu"] = gpu
                out = checked(sample, path, line, stats)
                if out is not None:
                    yield out


def _gpu_sample(path: str, line: int, cells: list[str], header: list[str], cols: dict[str, int],
                options: ImportOptions, stats: ImportStats, known_total: int | None) -> dict | None:
    values: dict[str, float] = {}
    for metric, col in cols.items():
        text = cells[col].strip() if col < len(cells) else ""
        if not text:
            continue
        try:
            values[metric] = float(text)
        except ValueError:
            stats.bad(RowError(path, line, f"column {col + 1} ({header[col].strip()})", f"not a number: {text!r}"))
            return None
    used = values.get("memoryAllocatedBytes")
    if used is None:
        return None  # not measured at this row
    col = cols["memoryAllocatedBytes"]
    try:
        sample: dict = {"nvml_used_bytes": as_bytes(used, 1)}
    except ValueError as exc:
        stats.bad(RowError(path, line, f"column {col + 1} ({header[col].strip()})", str(exc)))
        return None
    percent = values.get("memoryAllocated")
    if options.total_bytes is not None:
        sample["total_bytes"] = options.total_bytes
    elif known_total is not None:
        sample["total_bytes"] = known_total
    elif percent and percent > 0 and used > 0:
        sample["total_bytes"] = capacity_from_share(used, percent)
    else:
        stats.bad(RowError(path, line, f"column {col + 1} ({header[col].strip()})",
                           "no device capacity: the row has no memoryAllocated percent; pass --device-memory SIZE"))
        return None
    return sample
