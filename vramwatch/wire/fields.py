"""The one definition of a vramwatch sample: its fields, their kinds and the error naming one.

A sample is one rank at one step (or one phase event), a flat JSON object. The hook
builds them, the collector validates and stores them, trace files hold them one per
line (JSON Lines, optionally gzipped), and ``vramwatch analyze`` reads them. Samples
travel as plain ``dict`` objects: the hot paths (hook, ingest, analyze) never pay for
object construction.

:data:`FIELD_TABLE` is the single description of every field (type, unit, whether it is
required and whether null means "not measured", its store column). Validation (fast and
slow path), the store's columns, the OpenAPI schema (:func:`sample_json_schema`) and the
docs' table (``docs/fields.md``, :func:`fields_markdown`) are all derived from it: adding a
field is one entry here plus its producer and its consumer.

Schemas: **1** requires every allocator measurement (only NVML may be null); **2** makes
every measurement optional ("not measured" is absent or null, never 0) and requires only
one memory level (``allocated_bytes`` or ``nvml_used_bytes``) plus ``total_bytes``. Both
are accepted; a schema-1 sample is accepted exactly as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypedDict

#: The schema this version writes; every schema in SCHEMA_VERSIONS is accepted.
SCHEMA_VERSION = 2
SCHEMA_VERSIONS = (1, 2)

#: Largest integer accepted anywhere: JSON numbers beyond 2**53 lose precision in
#: browsers and in any float-based consumer, and no GPU has 9 PB.
MAX_INT = 2**53

#: Oldest plausible timestamp (2000-01-01). Anything earlier is a unit mistake.
MIN_TS = 946684800.0

#: The phase of ordinary training steps (every other phase is an event: checkpoint, eval, ...).
TRAIN_PHASE = "train"

ALLOCATORS = ("native", "cudaMallocAsync")
MAX_NAME = 128
MAX_EXTRA_KEYS = 64
#: What a phase name may be (the hook checks names with the same pattern before sending).
PHASE_PATTERN = r"[A-Za-z0-9_.:-]{1,32}"
PHASE_RE = re.compile(PHASE_PATTERN + r"\Z")

#: Characters no name may hold: Unicode categories Cc (C0/C1 controls, \x85, \x9b), Cf
#: (format: bidi overrides U+202E and isolates U+2066-2069, zero-width U+200B-200F, BOM
#: U+FEFF, ...), Zl (U+2028) and Zp (U+2029). They are invisible or reorder text, so a run
#: named with them looks like another run. The ranges are Unicode 15's; tests/test_wire.py
#: checks them against the running interpreter's unicodedata.
_INVISIBLE = (
    "\x00-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890-\u0891\u08e2\u180e"
    "\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb"
    "\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0001\U000e0020-\U000e007f"
)
_CONTROL_RE = re.compile(f"[{_INVISIBLE}]")


@dataclass(frozen=True)
class Field:
    """One sample field. ``kind`` selects the validation rule:

    ``i`` whole number >= 0 (ids, steps), ``b`` bytes or counter (whole number >= 0),
    ``s`` name (1-128 visible characters), ``ts`` unix seconds, ``f`` number >= 0,
    ``phase`` short name, ``allocator`` enum, ``extra`` flat object of numbers, ``flag`` boolean.
    """

    name: str
    kind: str
    unit: str
    description: str
    #: schema versions in which the field must be present
    required: tuple[int, ...] = ()
    #: schema versions in which null is a value ("not measured", stored as NULL); elsewhere an
    #: explicit null of an optional field is the same as leaving it out
    nullable: tuple[int, ...] = ()
    #: where the store keeps it: "samples" (per sample), "series" (once per process), "" (not stored)
    table: str = "samples"
    #: the store column (default: the field's name; none when ``table`` is "")
    column: str = ""

    def __post_init__(self) -> None:
        if self.table and not self.column:
            object.__setattr__(self, "column", self.name)

    @property
    def json_type(self) -> str:
        return _JSON_TYPES[self.kind]


_JSON_TYPES = {"i": "integer", "b": "integer", "s": "string", "ts": "number", "f": "number",
               "phase": "string", "allocator": "string", "extra": "object", "flag": "boolean"}

_ALL = SCHEMA_VERSIONS
_MEASURED = {"required": (1,), "nullable": (2,)}  # schema 1 requires it; schema 2: not measured = null
_OPTIONAL = {"nullable": _ALL}  # a measurement any schema may leave out (null = not measured)

#: Every field, in the order samples are written.
FIELD_TABLE: tuple[Field, ...] = (
    Field("schema", "i", "", "Wire schema version: 1 or 2 (kept, so an export is what was sent).", required=_ALL),
    Field("run", "s", "", "Run name: one training job.", required=_ALL, table="series"),
    Field("host", "s", "", "Host name of the rank.", required=_ALL, table="series"),
    Field("rank", "i", "", "Global rank.", required=_ALL, table="series"),
    Field("step", "i", "step", "Training step the sample belongs to.", required=_ALL),
    Field("ts", "ts", "s", "Unix time of the reading.", required=_ALL),
    Field("phase", "phase", "", "`train` for step boundaries, else the phase (checkpoint, eval, ...).",
          required=_ALL),
    Field("seq", "i", "", "Number of a phase among same-named phases at one step (default 0): two checkpoints "
          "at one step are two samples."),
    Field("allocated_bytes", "b", "bytes", "Bytes held by live tensors (torch allocated).", **_MEASURED,
          column="allocated"),
    Field("reserved_bytes", "b", "bytes", "Bytes reserved by the caching allocator.", **_MEASURED,
          column="reserved"),
    Field("peak_allocated_bytes", "b", "bytes",
          "Peak allocated since the previous sample (the phase's peak for a phase sample).", **_MEASURED,
          column="peak"),
    Field("inactive_split_bytes", "b", "bytes", "Free bytes inside split allocator segments.", **_MEASURED,
          column="inactive_split"),
    Field("alloc_retries", "b", "count", "Allocator retries (cudaMalloc failed, caches flushed) so far.",
          **_MEASURED),
    Field("ooms", "b", "count", "Out-of-memory errors raised by the allocator so far.", **_MEASURED),
    Field("nvml_used_bytes", "b", "bytes", "Device-wide used bytes from NVML.", required=(1,), nullable=_ALL,
          column="nvml_used"),
    Field("total_bytes", "b", "bytes", "Device memory capacity (> 0).", required=_ALL, column="total"),
    Field("local_rank", "i", "", "Rank within the host.", table="series"),
    Field("world_size", "i", "", "Number of ranks in the run.", table="series"),
    Field("uuid", "s", "", "GPU UUID.", table="series"),
    Field("gpu", "i", "", "GPU index on the host.", table="series"),
    Field("pid", "i", "", "Process id of the rank.", table="series"),
    Field("process_used_bytes", "b", "bytes", "Bytes NVML attributes to this process.", **_OPTIONAL,
          column="process_used"),
    Field("active_bytes", "b", "bytes", "Allocated plus blocks awaiting cross-stream frees.", **_OPTIONAL,
          column="active"),
    Field("step_time_s", "f", "s", "Wall time of the step.", **_OPTIONAL, column="step_time"),
    Field("tokens", "b", "count", "Tokens processed in the step.", **_OPTIONAL),
    Field("incarnation", "s", "", "Process incarnation: a restarted rank gets a new one.", table="series"),
    Field("allocator", "allocator", "", "`native` (default) or `cudaMallocAsync`.", table="series"),
    Field("extra", "extra", "", "Up to 64 user numbers (loss, lr, ...) by name."),
    Field("host_rss_bytes", "b", "bytes", "Resident memory of the training process.", **_OPTIONAL,
          column="host_rss"),
    Field("host_children_rss_bytes", "b", "bytes", "Resident memory of its children (DataLoader workers).",
          **_OPTIONAL, column="host_children_rss"),
    Field("host_available_bytes", "b", "bytes", "Memory available on the node.", **_OPTIONAL,
          column="host_available"),
    Field("host_pinned_bytes", "b", "bytes", "Pinned (page-locked) host memory held by torch.", **_OPTIONAL,
          column="host_pinned"),
    Field("foreign_used_bytes", "b", "bytes", "Device memory held by other processes on this GPU.", **_OPTIONAL,
          column="foreign_used"),
    Field("oom_marked", "flag", "", "true on the sample sent as the process hits an out-of-memory error."),
    Field("exit", "flag", "", "true on the last sample of a clean close().", column="exited"),
)

FIELD_BY_NAME: dict[str, Field] = {f.name: f for f in FIELD_TABLE}
#: name -> kind of every field (compatibility view of the table)
FIELDS: dict[str, str] = {f.name: f.kind for f in FIELD_TABLE}
#: fields every schema requires
REQUIRED_NAMES: tuple[str, ...] = tuple(f.name for f in FIELD_TABLE if set(_ALL) <= set(f.required))
#: the memory levels a sample needs at least one of
LEVEL_FIELDS = ("allocated_bytes", "nvml_used_bytes")

_PY_TYPES = {"i": int, "b": int, "s": str, "ts": float, "f": float, "phase": str, "allocator": str,
             "extra": dict, "flag": bool}
#: A sample as a TypedDict derived from the table (every key optional for the type checker;
#: :func:`validate` enforces what each schema requires).
Sample = TypedDict("Sample", {f.name: _PY_TYPES[f.kind] | None for f in FIELD_TABLE}, total=False)  # type: ignore[misc]


class WireError(ValueError):
    """A sample or request body that cannot be true; ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def series_key(sample: Sample) -> tuple[str, str, int]:
    """A series is (run, host, rank): what the store, the engine, the dashboard, /metrics and
    analyze key on (the store adds the incarnation to tell restarts of one rank apart)."""
    return (sample["run"], sample["host"], sample["rank"])


#: the measurements schema 1 requires non-null
FULL_MEASUREMENTS: tuple[str, ...] = tuple(f.name for f in FIELD_TABLE if f.required == (1,) and 1 not in f.nullable)


def fully_measured(sample: Sample) -> bool:
    """True when every schema-1 allocator measurement is present and not null (what consumers
    that cannot yet judge sparse samples need)."""
    return all(sample.get(name) is not None for name in FULL_MEASUREMENTS)


def invisible_character(value: str) -> str | None:
    """The first control, format (bidi, zero-width) or line/paragraph separator in ``value``
    as ``U+XXXX``, or None when the text has none."""
    found = _CONTROL_RE.search(value)
    return None if found is None else f"U+{ord(found.group()):04X}"
