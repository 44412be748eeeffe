"""``nvidia-smi --query-gpu=timestamp,index,uuid,memory.used,memory.total --format=csv`` logs.

Accepted: with or without ``nounits`` (``1234 MiB`` or ``1234``), with or without the
header (``noheader``: the columns are then taken in the query order above), ``-l``/``-lms``
loops whose output repeats the header, extra query columns (ignored), gzip. The header
names the columns, so any order works.

What nvidia-smi measures is device-level: each row becomes a sample with
``nvml_used_bytes`` and ``total_bytes`` (plus ``uuid``/``gpu``) and nothing else. The rank
is the GPU index; the step is the row's ordinal for that GPU (a loop polls at a fixed
interval). Timestamps are local time of the machine that ran nvidia-smi (it prints no
zone): they are read in the importing process's local zone; set ``TZ`` to match.

Cost: one ``csv`` row and one ``strptime`` per line, O(GPUs) memory; a line is at most
``max_line_bytes`` (longer: a bad row, never held whole).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

from vramwatch.bounded import CsvRows, LimitExceeded, open_input
from vramwatch.importers.common import (
    DEFAULT_HOST,
    ImportOptions,
    ImportStats,
    RowError,
    as_bytes,
    base_sample,
    checked,
    stem,
)
from vramwatch.wire import Sample
from vramwatch.wire.tracefile import LINE_FLAG

#: The documented query, in order: what a header-less file is assumed to hold.
QUERY = ("timestamp", "index", "uuid", "memory.used", "memory.total")
_UNITS = {"mib": 1024**2, "kib": 1024, "gib": 1024**3, "b": 1}
_TS_FORMATS = ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S")
_MISSING = ("[n/a]", "[not supported]", "n/a", "[unknown error]", "[insufficient permissions]", "")


def _header(cells: list[str]) -> tuple[dict[str, int], dict[str, int]] | None:
    """Column positions and byte scales when ``cells`` is a header row, else None."""
    names = [c.strip().lower() for c in cells]
    if "timestamp" not in [n.split(" [")[0] for n in names]:
        return None
    columns: dict[str, int] = {}
    scales: dict[str, int] = {}
    for i, name in enumerate(names):
        base, _, unit = name.partition(" [")
        columns[base] = i
        if unit:
            scales[base] = _UNITS.get(unit.rstrip("]").strip(), 0)
    return columns, scales


def _number(text: str, default_scale: int) -> tuple[float, int] | None:
    """``'1234 MiB'`` or ``'1234'`` → (1234.0, scale); None for N/A."""
    value = text.strip()
    if value.lower() in _MISSING:
        return None
    number, _, unit = value.partition(" ")
    scale = _UNITS.get(unit.strip().lower(), 0) if unit else default_scale
    if not scale:
        raise ValueError(f"unknown unit in {text!r}")
    return float(number), scale


def _timestamp(text: str) -> float:
    value = text.strip()
    for fmt in _TS_FORMATS:
        try:
            return datetime.strptime(value, fmt).timestamp()
        except ValueError:
            continue
    raise ValueError(f"not an nvidia-smi timestamp (YYYY/MM/DD HH:MM:SS.mmm): {value!r}")


@dataclass
class _File:
    """What one file's rows are read with: the header's layout and the per-GPU counters."""

    path: str
    run: str
    host: str
    stats: ImportStats
    columns: dict[str, int] = field(default_factory=lambda: {name: i for i, name in enumerate(QUERY)})
    scales: dict[str, int] = field(default_factory=lambda: {"memory.used": 1024**2, "memory.total": 1024**2})
    #: GPU key → [rank, next step]
    ordinal: dict[str, list[int]] = field(default_factory=dict)
    #: every GPU's row of one poll carries the same stamp and strptime is the costliest call
    #: per row: each distinct stamp is parsed once (per read, so a TZ change between reads counts)
    stamps: dict[str, float] = field(default_factory=dict)


def read(path: str, options: ImportOptions, stats: ImportStats) -> Iterator[Sample]:
    """Samples from one nvidia-smi CSV log, in file order."""
    state = _File(path, options.run or stem(path), options.host or DEFAULT_HOST, stats)
    with open_input(path) as fh:
        for line, cells in CsvRows(fh, path, options.max_line_bytes, LINE_FLAG, skipinitialspace=True):
            if isinstance(cells, LimitExceeded):
                stats.refused(path, line, cells)
                continue
            if not cells or not "".join(cells).strip():
                continue
            header = _header(cells)
            if header is not None:
                state.columns, state.scales = header
                missing = [c for c in ("timestamp", "memory.used", "memory.total") if c not in state.columns]
                if missing or ("index" not in state.columns and "uuid" not in state.columns):
                    raise RowError(path, line, "header", "needs timestamp, memory.used, memory.total and index or "
                                   f"uuid (missing: {', '.join(missing) or 'index/uuid'})")
                continue
            stats.rows += 1
            sample = _row(state, line, cells)
            if sample is not None:
                out = checked(sample, path, line, stats)
                if out is not None:
                    yield out


def _row(state: _File, line: int, cells: list[str]) -> dict | None:
    columns = state.columns

    def cell(name: str) -> str:
        i = columns[name]
        if i >= len(cells):
            raise IndexError(name)
        return cells[i]

    current = "timestamp"
    try:
        text = cell("timestamp")
        ts = state.stamps.get(text)
        if ts is None:
            if len(state.stamps) > 256:
                state.stamps.clear()
            ts = state.stamps[text] = _timestamp(text)
        current = "index"
        index = int(cell("index")) if "index" in columns else None
        current = "uuid"
        uuid = cell("uuid").strip() if "uuid" in columns else None
        current = "memory.used"
        used = _number(cell("memory.used"), state.scales.get("memory.used", 1024**2))
        if used is None:
            raise ValueError(f"not measured ({cell(current).strip() or 'empty'}): the row has no memory level")
        current = "memory.total"
        total = _number(cell("memory.total"), state.scales.get("memory.total", 1024**2))
        if total is None:
            raise ValueError(f"not measured ({cell(current).strip() or 'empty'}): the device capacity is unknown")
        used_bytes, total_bytes = as_bytes(*used), as_bytes(*total)
    except IndexError:
        state.stats.bad(RowError(state.path, line, f"column {columns[current] + 1} ({current})",
                                 f"missing: the row has {len(cells)} columns"))
        return None
    except ValueError as exc:
        state.stats.bad(RowError(state.path, line, f"column {columns[current] + 1} ({current})", str(exc)))
        return None
    key = uuid or str(index)
    seen = state.ordinal.get(key)
    if seen is None:  # a new GPU: its rank is its index (or its order of appearance)
        seen = state.ordinal[key] = [index if index is not None else len(state.ordinal), 0]
    rank, step = seen
    seen[1] = step + 1
    sample = base_sample(state.run, state.host, rank, step, ts)
    sample["nvml_used_bytes"] = used_bytes
    sample["total_bytes"] = total_bytes
    if uuid:
        sample["uuid"] = uuid
    if index is not None:
        sample["gpu"] = index
    return sample
