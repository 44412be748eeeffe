"""What every importer shares: options, the row error, the skip counter, the sample builder.

An importer turns one file of some tool's format into schema-1 samples carrying only what
that tool measured: a field the source does not record is absent, never a zero. Every
importer streams (one row, record or document at a time) through :mod:`vramwatch.bounded`
and keeps per-series state only: memory is bounded per file by ``max_line_bytes`` (a CSV
row, a JSON line) and ``max_record_bytes`` (a TensorBoard record, a Prometheus document),
whatever the file holds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from vramwatch.bounded import LimitExceeded
from vramwatch.wire import SCHEMA_VERSION, Sample, WireError, validate
from vramwatch.wire.tracefile import MAX_LINE_BYTES

#: the largest record (TensorBoard event) or document (a Prometheus answer) read whole
MAX_RECORD_BYTES = 64 * 2**20
RECORD_FLAG = "--max-record-bytes"

#: Default run and host names when the source does not say (override with --run/--host).
DEFAULT_HOST = "unknown"

MiB = 1024**2

_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*\Z", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_size(text: str) -> int:
    """``80GiB``, ``81559MiB``, ``141GB`` or plain bytes → bytes. Raises ValueError."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 80GiB, 81559MiB, 143771009024)")
    number, unit = match.groups()
    value = float(number) * _UNITS[(unit or "").lower()]
    if not 0 < value <= 2**53:
        raise ValueError(f"size out of range: {text!r}")
    return int(value)


@dataclass(frozen=True)
class ImportOptions:
    """Identity and capacity the source file may not carry, and the bad-row policy."""

    #: run name; default: the file's stem (``train.csv`` → ``train``), for dcgm series ``dcgm``
    run: str | None = None
    #: host name; default: the source's own (dcgm ``Hostname``) or ``unknown``
    host: str | None = None
    #: rank of single-rank sources (TensorBoard, W&B); default 0
    rank: int | None = None
    #: device capacity in bytes for sources that do not log it (TensorBoard)
    total_bytes: int | None = None
    #: count and skip bad rows instead of stopping at the first
    skip_invalid: bool = False
    #: extra TensorBoard key table (TOML) merged over the built-in one
    keys_path: str | None = None
    #: the longest CSV row or JSON line read (a longer one is a bad row, never held whole)
    max_line_bytes: int = MAX_LINE_BYTES
    #: the largest TensorBoard record or Prometheus document read whole (past it: refused)
    max_record_bytes: int = MAX_RECORD_BYTES


#: characters of a column name and of a message an error line keeps (a field echoed in a
#: message can be the whole line: 200 KB of one cell), so a line echoes at most this much of any
#: field; the longest message of its own is ~150 characters
MAX_EXCERPT = 200


def excerpt(text: str, limit: int = MAX_EXCERPT) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


class RowError(WireError):
    """A row that cannot be read: names the file, the line (or record) and the column; the
    column and the message are bounded excerpts (:func:`excerpt`), whatever they echo."""

    def __init__(self, path: str, line: int | str, column: str, message: str) -> None:
        column, message = excerpt(str(column)), excerpt(str(message))
        super().__init__(f"{path}:{line}: {column}", message)
        self.path, self.line, self.column = path, line, column


@dataclass
class ImportStats:
    """Counts of one import; ``errors`` keeps the first few skipped rows' messages."""

    rows: int = 0
    samples: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    skip_invalid: bool = False

    MAX_ERRORS = 20

    def refused(self, path: str, line: int, exc: LimitExceeded) -> None:
        """A row a bounded reader refused (:class:`~vramwatch.bounded.LimitExceeded`): a bad row."""
        self.rows += 1
        self.bad(RowError(path, line, "row", f"{exc.message} ({exc.limit})"))

    def bad(self, error: WireError) -> None:
        """A bad row: raise it (strict), or count it and keep going (``--skip-invalid``)."""
        if not self.skip_invalid:
            raise error
        self.skipped += 1
        if len(self.errors) < self.MAX_ERRORS:
            self.errors.append(str(error))


def base_sample(run: str, host: str, rank: int, step: int, ts: float) -> dict[str, Any]:
    """The identity and time of one imported sample; the importer adds what was measured."""
    return {"schema": SCHEMA_VERSION, "run": run, "host": host, "rank": rank, "step": step, "ts": float(ts),
            "phase": "train"}


def checked(sample: dict[str, Any], path: str, line: int | str, stats: ImportStats) -> Sample | None:
    """Validate an imported sample with the wire rules; a failure is a row error naming the field."""
    try:
        out = validate(sample)
    except WireError as exc:
        stats.bad(RowError(path, line, exc.field, exc.message))
        return None
    stats.samples += 1
    return out


def as_bytes(value: float, scale: float) -> int:
    """A measured number in the source's unit → whole bytes (rounded, never negative)."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"not a byte count: {value!r}")
    return round(value * scale)


def capacity_from_share(used_bytes: float, percent: float) -> int:
    """Device capacity from a reading and its share of the device, rounded to whole MiB.

    Tools that log a percentage (W&B, torchtitan) round it, so the quotient jitters by a
    few KiB to MiB from row to row; NVML capacities are whole MiB, and the importers keep the
    first value per GPU (a device's capacity does not change).
    """
    return round(used_bytes * 100.0 / percent / MiB) * MiB


def stem(path: str) -> str:
    """Default run name of a file: its name without directories and suffixes."""
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    for suffix in (".gz", ".csv", ".json", ".jsonl", ".txt", ".log"):
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
    return name or "imported"


SampleIter = Iterator[Sample]
