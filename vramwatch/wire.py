"""Wire format: the one definition of a vramwatch sample.

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

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, NamedTuple, TypedDict

import orjson

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


# ---------------------------------------------------------------- validation

def _int(name: str, value: Any) -> int:
    # bool is an int subclass; true is not a byte count.
    if type(value) is int:
        if 0 <= value <= MAX_INT:
            return value
        raise WireError(name, f"must be between 0 and 2**53, got {value}")
    if type(value) is float:
        if math.isfinite(value) and value.is_integer() and 0 <= value <= MAX_INT:
            return int(value)
        raise WireError(name, f"must be a whole number between 0 and 2**53, got {value!r}")
    raise WireError(name, f"must be an integer, got {type(value).__name__}")


def invisible_character(value: str) -> str | None:
    """The first control, format (bidi, zero-width) or line/paragraph separator in ``value``
    as ``U+XXXX``, or None when the text has none."""
    found = _CONTROL_RE.search(value)
    return None if found is None else f"U+{ord(found.group()):04X}"


def _name(name: str, value: Any, limit: int = MAX_NAME) -> str:
    if type(value) is not str:
        raise WireError(name, f"must be a string, got {type(value).__name__}")
    if not value or len(value) > limit:
        raise WireError(name, f"must be 1 to {limit} characters long")
    bad = invisible_character(value)
    if bad is not None:
        raise WireError(name, f"must not contain control or invisible characters (found {bad})")
    return value


def _extra(name: str, value: Any) -> dict[str, float]:
    if type(value) is not dict:
        raise WireError(name, "must be a flat object of numbers")
    if len(value) > MAX_EXTRA_KEYS:
        raise WireError(name, f"at most {MAX_EXTRA_KEYS} keys")
    out = {}
    for key, number in value.items():
        _name(f"extra.{key}"[:80], key, 64)
        if type(number) not in (int, float) or not math.isfinite(number) or abs(number) > MAX_INT:
            raise WireError(f"extra.{key}"[:80], "must be a finite number")
        out[key] = number
    return out


def _check(name: str, kind: str, value: Any) -> Any:
    if kind == "b" or kind == "i":
        return _int(name, value)
    if kind == "s":
        return _name(name, value)
    if kind == "ts" or kind == "f":
        if type(value) not in (int, float) or not math.isfinite(value):
            raise WireError(name, f"must be a finite number, got {value!r}")
        if kind == "ts" and value < MIN_TS:
            raise WireError(name, f"must be unix seconds after 2000-01-01, got {value!r}")
        if value < 0:
            raise WireError(name, f"must not be negative, got {value!r}")
        return float(value)
    if kind == "phase":
        if type(value) is not str or not PHASE_RE.match(value):
            raise WireError(name, "must be a short name: 1-32 of A-Z a-z 0-9 _ . : -")
        return value
    if kind == "allocator":
        if value not in ALLOCATORS:
            raise WireError(name, f"must be one of {', '.join(ALLOCATORS)}")
        return value
    if kind == "flag":
        if type(value) is not bool:
            raise WireError(name, f"must be true or false, got {value!r}")
        return value
    if kind == "extra":
        return _extra(name, value)
    raise AssertionError(kind)  # pragma: no cover


_MISSING = object()
_known_phases: set[str] = {TRAIN_PHASE, "eval", "checkpoint"}
# run/host/uuid/incarnation repeat on every sample: remember the ones already checked
# (bounded, so hostile clients cannot grow it).
_known_names: set[str] = set()


def _plain_name(value: Any, limit: int = MAX_NAME) -> bool:
    if type(value) is not str:
        return False
    if limit == MAX_NAME and value in _known_names:
        return True
    ok = 0 < len(value) <= limit and _CONTROL_RE.search(value) is None
    if ok and limit == MAX_NAME and len(_known_names) < 4096:
        _known_names.add(value)
    return ok


#: the Python type each kind has in canonical form (anything else: the slow path normalises or refuses)
_CANONICAL = {"i": int, "b": int, "s": str, "ts": float, "f": float, "phase": str, "allocator": str,
              "extra": dict, "flag": bool}
_NAME_KINDS = ("s", "phase", "allocator")
_QUICK = ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes")


class _Shape(NamedTuple):
    """What is left to check of a sample once its schema, keys (in order) and value types are
    known: the value checks, as getters built once per shape."""

    ints: Callable[[dict[str, Any]], tuple[int, ...]]  # every whole-number value: range 0..2**53
    floats: tuple[str, ...]  # kind "f": finite and >= 0 (ts is checked apart)
    names: Callable[[dict[str, Any]], tuple[str, ...]]  # names, phase, allocator: checked once per tuple
    name_kinds: tuple[tuple[str, str], ...]  # (kind, field) in the order of ``names``
    extra: bool
    quick: bool  # allocated, reserved and peak measured, no foreign memory: the common cross-check


def _shape(schema: int, obj: dict[str, Any]) -> _Shape | None:
    """The checks for samples shaped like ``obj``, or None when the shape alone sends it to the
    slow path (unknown or missing field, a type that is not canonical, a null the schema drops)."""
    if schema not in SCHEMA_VERSIONS:
        return None
    ints, floats, names = [], [], []
    for name, value in obj.items():
        field = FIELD_BY_NAME.get(name)
        if field is None:
            return None
        if value is None:
            if schema not in field.nullable:
                return None  # refused, or dropped by the slow path
            continue
        if type(value) is not _CANONICAL[field.kind]:
            return None
        if field.kind in ("i", "b"):
            ints.append(name)
        elif field.kind == "f":
            floats.append(name)
        elif field.kind in _NAME_KINDS:
            names.append((field.kind, name))
    if any(schema in f.required and f.name not in obj for f in FIELD_TABLE):
        return None
    quick = all(obj.get(name) is not None for name in _QUICK) and "foreign_used_bytes" not in obj
    return _Shape(itemgetter(*ints), tuple(floats), itemgetter(*(n for _, n in names)), tuple(names),
                  "extra" in obj, quick)


#: shape (schema, keys in order, value types) -> its checks; bounded (a hostile client sending a new
#: key order per sample gets the plan built each time, never a growing cache)
_SHAPES: dict[tuple[Any, ...], _Shape | None] = {}
#: name tuples (run, host, phase, ...) already checked
_known_name_tuples: set[tuple[str, ...]] = set()


def _plain_names(shape: _Shape, names: tuple[str, ...]) -> bool:
    for (kind, _), value in zip(shape.name_kinds, names, strict=True):
        if kind == "s":
            if not _plain_name(value):
                return False
        elif kind == "phase":
            if value not in _known_phases and not PHASE_RE.match(value):
                return False
        elif value not in ALLOCATORS:
            return False
    if len(_known_name_tuples) < 4096:
        _known_name_tuples.add(names)
    return True


def _plainly_valid(obj: dict[str, Any]) -> bool:
    """Fast path for the common case: every field already in canonical form and valid.

    False means "take the slow path", which either normalises or names the bad field; both
    paths accept exactly the same samples (tests/test_wire.py checks agreement). Cost: one
    tuple of the keys and value types looked up in a cache of shapes (what is required,
    present, typed right is known per shape), then one min/max over the whole numbers, the
    names as one cached tuple and the cross-field rules: no per-field ``get``.
    """
    schema = obj.get("schema")
    if type(schema) is not int:
        return False
    key = (schema, *obj, *map(type, obj.values()))
    shape = _SHAPES.get(key, _MISSING)
    if shape is _MISSING:
        shape = _shape(schema, obj)
        if len(_SHAPES) < 1024:
            _SHAPES[key] = shape
    if shape is None:
        return False
    ints = shape.ints(obj)
    if min(ints) < 0 or max(ints) > MAX_INT:
        return False
    if not MIN_TS <= obj["ts"] < math.inf:
        return False
    for name in shape.floats:
        if not 0.0 <= obj[name] < math.inf:
            return False
    names = shape.names(obj)
    if names not in _known_name_tuples and not _plain_names(shape, names):
        return False
    if shape.extra:
        extra = obj["extra"]
        if len(extra) > MAX_EXTRA_KEYS or not all(
                _plain_name(key, 64) and type(number) in (int, float) and -MAX_INT <= number <= MAX_INT
                for key, number in extra.items()):
            return False
    if shape.quick and obj.get("allocator") != "cudaMallocAsync":
        allocated, reserved, total, used = (obj["allocated_bytes"], obj["reserved_bytes"], obj["total_bytes"],
                                            obj.get("nvml_used_bytes"))
        return (allocated <= reserved <= total and obj["peak_allocated_bytes"] >= allocated and total > 0
                and (used is None or used <= total))
    return _consistent(obj) is None  # sparse, foreign memory or cudaMallocAsync: the general rules


def _consistent(s: dict[str, Any]) -> WireError | None:
    """The cross-field rules, on a sample whose fields are each valid (None = not measured)."""
    get = s.get
    allocated, reserved, total = get("allocated_bytes"), get("reserved_bytes"), s["total_bytes"]
    used, peak = get("nvml_used_bytes"), get("peak_allocated_bytes")
    if allocated is None and used is None:
        return WireError("allocated_bytes", "a sample needs at least one memory level: allocated_bytes or "
                                            "nvml_used_bytes")
    if allocated is not None:
        if reserved is not None:
            if allocated > reserved and get("allocator") != "cudaMallocAsync":
                return WireError("allocated_bytes", f"{allocated} exceeds reserved_bytes {reserved}")
        elif allocated > total:
            return WireError("allocated_bytes", f"{allocated} exceeds total_bytes {total}")
        if peak is not None and peak < allocated:
            return WireError("peak_allocated_bytes", f"{peak} is below allocated_bytes {allocated}")
    if total == 0:
        return WireError("total_bytes", "must be the device capacity, not 0")
    if reserved is not None and reserved > total:
        return WireError("reserved_bytes", f"{reserved} exceeds total_bytes {total}")
    if used is not None and used > total:
        return WireError("nvml_used_bytes", f"{used} exceeds total_bytes {total}")
    foreign = get("foreign_used_bytes")
    if foreign is not None and foreign > total:
        return WireError("foreign_used_bytes", f"{foreign} exceeds total_bytes {total}")
    return None


def validate(obj: Any, *, now: float | None = None, max_future_s: float = 300.0) -> Sample:
    """Check one decoded sample and return it normalised (floats of whole bytes → int).

    ``now``: when given, timestamps more than ``max_future_s`` ahead of it are rejected
    (a clock that far off would corrupt every time-based number).
    A field that was not measured is absent or null in the result: read it with ``get``.
    Raises :class:`WireError` naming the first bad field; never returns a partial sample.
    Cost: a few µs for a canonical sample (the fast path), more only for odd ones.
    """
    if type(obj) is not dict:
        raise WireError("sample", f"must be a JSON object, got {type(obj).__name__}")
    if _plainly_valid(obj) and (now is None or obj["ts"] <= now + max_future_s):
        return obj  # type: ignore[return-value]
    return _validate_slow(obj, now, max_future_s)


def _validate_slow(obj: dict[str, Any], now: float | None, max_future_s: float) -> Sample:
    schema = obj.get("schema")
    if type(schema) is not int or schema not in SCHEMA_VERSIONS:
        raise WireError("schema", f"unknown schema {schema!r}; this collector speaks schemas "
                                  f"{', '.join(map(str, SCHEMA_VERSIONS))}")
    out: dict[str, Any] = {}
    for f in FIELD_TABLE:  # in table order: the first bad field is named, whatever the key order
        value = obj.get(f.name, _MISSING)
        if value is _MISSING:
            if schema in f.required:
                raise WireError(f.name, "is required")
        elif value is None and schema in f.nullable:
            out[f.name] = None  # not measured
        elif value is not None or schema in f.required:  # else: an explicit null optional is absent
            out[f.name] = _check(f.name, f.kind, value)
    if len(obj) > len(out):
        for name in obj:
            if name not in FIELD_BY_NAME:
                raise WireError(str(name)[:64], "unknown field")
    error = _consistent(out)
    if error is not None:
        raise error
    if now is not None and out["ts"] > now + max_future_s:
        raise WireError("ts", f"is {out['ts'] - now:.0f} s in the future; check the clock on host {out['host']!r}")
    return out  # type: ignore[return-value]


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


# ---------------------------------------------------------------- encoding

def encode(sample: Sample) -> bytes:
    """One sample as a JSON line (no newline)."""
    return orjson.dumps(sample)


def encode_lines(samples: Iterable[Sample]) -> bytes:
    """NDJSON body: one sample per line, newline-terminated."""
    return b"".join(orjson.dumps(s) + b"\n" for s in samples)


def decode_line(line: bytes | str) -> Any:
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise WireError("body", f"invalid JSON: {exc}") from None


def gunzip_limited(data: bytes, limit: int) -> bytes:
    """Compatibility alias of :func:`vramwatch.collector.body.gunzip_limited` (bounded inflate)."""
    from vramwatch.collector.body import gunzip_limited as inflate

    return inflate(data, limit)


def parse_body(data: bytes) -> list[Any]:
    """Compatibility alias of :func:`vramwatch.collector.body.parse_body` (array, object or NDJSON)."""
    from vramwatch.collector.body import parse_body as parse

    return parse(data)


# ---------------------------------------------------------------- trace files
# (and the descriptions derived from the table: their own modules, re-exported here so
# ``wire`` stays the one import for sample handling)
from vramwatch.tracefile import TraceWriter, iter_file, iter_samples, write_file  # noqa: E402
from vramwatch.wire_schema import fields_markdown, sample_json_schema  # noqa: E402

__all__ = [
    "FIELD_TABLE",
    "SCHEMA_VERSION",
    "SCHEMA_VERSIONS",
    "Field",
    "Sample",
    "TraceWriter",
    "WireError",
    "decode_line",
    "encode",
    "encode_lines",
    "fields_markdown",
    "gunzip_limited",
    "iter_file",
    "iter_samples",
    "parse_body",
    "sample_json_schema",
    "series_key",
    "validate",
    "write_file",
]
