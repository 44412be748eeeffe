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

from vramwatch.errors import VramwatchError

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
#: named with them looks like another run. The ranges are Unicode 15's; tests/wire/test_wire.py
#: checks them against the running interpreter's unicodedata.
_INVISIBLE = (
    "\x00-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890-\u0891\u08e2\u180e"
    "\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb"
    "\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0001\U000e0020-\U000e007f"
)
_CONTROL_RE = re.compile(f"[{_INVISIBLE}]")


@dataclass(frozen=True)
class Metric:
    """The ``/metrics`` family of a field: its latest value per rank."""

    name: str
    help: str
    #: "gauge", or "counter" for a count that only grows within a process (exposed as ``name_total``)
    kind: str = "gauge"
    #: exposed for a rank whose latest process no longer runs too (counts, step and time), else only
    #: while it runs
    always: bool = False


#: the dashboard's charts a field may be drawn in: the rank chart (allocator levels against the
#: device), the device split (allocator / outside it / other processes), host memory and the memory
#: by category (parameters, gradients, optimizer state, activations, allocator cache, outside it)
CHARTS = ("rank", "device", "host", "categories")


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
    #: where the value comes from: "identity", "time", "allocator" (torch), "device" (NVML),
    #: "host" (the host poller), "step" (the training loop), "user" (extra), "marker" (flags)
    group: str = ""
    #: its family on ``/metrics``, if any
    metric: Metric | None = None
    #: the dashboard charts (:data:`CHARTS`) that fetch it, and its line's name where a chart draws
    #: one line per field (host memory)
    charts: tuple[str, ...] = ()
    label: str = ""
    #: carried by every phase marker (``/phases``: a checkpoint's own peak, levels and host peaks)
    phase_marker: bool = False
    #: sent only when its value changes (and on a process's first sample): a reader carries the
    #: latest value forward; an absent value is "unchanged", not "not measured"
    sparse: bool = False

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

_ID = {"group": "identity"}
_ALLOC = {"group": "allocator"}
_DEVICE = {"group": "device"}
_HOST = {"group": "host", **_OPTIONAL, "charts": ("host",)}
#: the model's memory by category (``vw.watch(model, optimizer)``): exact tensor bytes, sent when they change
#: (no /metrics family: the latest sample of a rank seldom carries them)
_MODEL = {"group": "model", **_OPTIONAL, "sparse": True}
_M = Metric

#: Every field, in the order samples are written.
FIELD_TABLE: tuple[Field, ...] = (
    Field("schema", "i", "", "Wire schema version: 1 or 2 (kept, so an export is what was sent).", required=_ALL,
          **_ID),
    Field("run", "s", "", "Run name: one training job.", required=_ALL, table="series", **_ID),
    Field("host", "s", "", "Host name of the rank.", required=_ALL, table="series", **_ID),
    Field("rank", "i", "", "Global rank.", required=_ALL, table="series", **_ID),
    Field("step", "i", "step", "Training step the sample belongs to.", required=_ALL, group="time",
          metric=_M("vramwatch_step", "Training step of the latest sample.", always=True)),
    Field("ts", "ts", "s", "Unix time of the reading.", required=_ALL, group="time", phase_marker=True,
          metric=_M("vramwatch_last_sample_timestamp_seconds", "Timestamp (rank's clock) of the latest sample.",
                    always=True)),
    Field("phase", "phase", "", "`train` for step boundaries, else the phase (checkpoint, eval, ...).",
          required=_ALL, group="time"),
    Field("seq", "i", "", "Number of a phase among same-named phases at one step (default 0): two checkpoints "
          "at one step are two samples.", group="time"),
    Field("allocated_bytes", "b", "bytes", "Bytes held by live tensors (torch allocated).", **_MEASURED,
          column="allocated", **_ALLOC, charts=("rank", "categories"), phase_marker=True,
          metric=_M("vramwatch_memory_allocated_bytes",
                    "Bytes held by live tensors (torch allocated_bytes) in the latest sample.")),
    Field("reserved_bytes", "b", "bytes", "Bytes reserved by the caching allocator.", **_MEASURED,
          column="reserved", **_ALLOC, charts=("rank", "device", "categories"), phase_marker=True,
          metric=_M("vramwatch_memory_reserved_bytes",
                    "Bytes reserved by the caching allocator in the latest sample.")),
    Field("peak_allocated_bytes", "b", "bytes",
          "Peak allocated since the previous sample (the phase's peak for a phase sample).", **_MEASURED,
          column="peak", **_ALLOC, charts=("rank", "categories"), phase_marker=True,
          metric=_M("vramwatch_memory_peak_allocated_bytes", "Peak allocated bytes since the previous sample.")),
    Field("inactive_split_bytes", "b", "bytes", "Free bytes inside split allocator segments.", **_MEASURED,
          column="inactive_split", **_ALLOC, charts=("rank",),
          metric=_M("vramwatch_inactive_split_bytes", "Free bytes inside split allocator segments (not releasable).")),
    Field("alloc_retries", "b", "count", "Allocator retries (cudaMalloc failed, caches flushed) so far.",
          **_MEASURED, **_ALLOC, charts=("rank",),
          metric=_M("vramwatch_alloc_retries",
                    "Allocator retries (cudaMalloc failed, caches flushed, retried) in this process.", "counter",
                    always=True)),
    Field("ooms", "b", "count", "Out-of-memory errors raised by the allocator so far.", **_MEASURED, **_ALLOC),
    Field("nvml_used_bytes", "b", "bytes", "Device-wide used bytes from NVML.", required=(1,), nullable=_ALL,
          column="nvml_used", **_DEVICE, charts=("rank", "device", "categories"), phase_marker=True,
          metric=_M("vramwatch_device_used_bytes",
                    "Device-wide used bytes reported by NVML (absent when NVML is unavailable).")),
    Field("total_bytes", "b", "bytes", "Device memory capacity (> 0).", required=_ALL, column="total", **_DEVICE,
          charts=("rank",), phase_marker=True,
          metric=_M("vramwatch_device_total_bytes", "Device memory capacity in bytes.")),
    Field("local_rank", "i", "", "Rank within the host.", table="series", **_ID),
    Field("world_size", "i", "", "Number of ranks in the run.", table="series", **_ID),
    Field("uuid", "s", "", "GPU UUID.", table="series", **_ID),
    Field("gpu", "i", "", "GPU index on the host.", table="series", **_ID),
    Field("pid", "i", "", "Process id of the rank.", table="series", **_ID),
    Field("process_used_bytes", "b", "bytes", "Bytes NVML attributes to this process.", **_OPTIONAL,
          column="process_used", **_DEVICE,
          metric=_M("vramwatch_process_used_bytes", "Bytes NVML attributes to the training process.")),
    Field("active_bytes", "b", "bytes", "Allocated plus blocks awaiting cross-stream frees.", **_OPTIONAL,
          column="active", **_ALLOC,
          metric=_M("vramwatch_memory_active_bytes",
                    "Active bytes (allocated plus blocks awaiting cross-stream frees).")),
    Field("step_time_s", "f", "s", "Wall time of the step.", **_OPTIONAL, column="step_time", group="step"),
    Field("tokens", "b", "count", "Tokens processed in the step.", **_OPTIONAL, group="step"),
    Field("incarnation", "s", "", "Process incarnation: a restarted rank gets a new one.", table="series", **_ID),
    Field("allocator", "allocator", "", "`native` (default) or `cudaMallocAsync`.", table="series", **_ALLOC),
    Field("extra", "extra", "", "Up to 64 user numbers (loss, lr, ...) by name.", group="user"),
    Field("host_rss_bytes", "b", "bytes", "Resident memory of the training process.", column="host_rss", **_HOST,
          label="trainer RSS", phase_marker=True,
          metric=_M("vramwatch_host_rss_bytes", "Resident host memory of the training process.")),
    Field("host_children_rss_bytes", "b", "bytes", "Resident memory of its children (DataLoader workers).",
          column="host_children_rss", **_HOST, label="children RSS (workers)", phase_marker=True,
          metric=_M("vramwatch_host_children_rss_bytes",
                    "Resident host memory of the training process's children (DataLoader workers).")),
    Field("host_available_bytes", "b", "bytes", "Memory available on the node.", column="host_available", **_HOST,
          label="node available", metric=_M("vramwatch_host_available_bytes", "MemAvailable of the node.")),
    Field("host_pinned_bytes", "b", "bytes", "Pinned (page-locked) host memory held by torch.",
          column="host_pinned", **_HOST, label="pinned",
          metric=_M("vramwatch_host_pinned_bytes", "Pinned host memory held by torch's host allocator.")),
    Field("foreign_used_bytes", "b", "bytes", "Device memory held by other processes on this GPU.", **_OPTIONAL,
          column="foreign_used", **_DEVICE, charts=("device", "categories"),
          metric=_M("vramwatch_foreign_used_bytes", "Device memory NVML lists for other processes on this GPU (a stale "
                    "notebook kernel, another job).")),
    Field("params_bytes", "b", "bytes", "Parameters and buffers of the watched model: every storage once (tied "
          "weights once).", column="params", **_MODEL, charts=("categories",), label="parameters"),
    Field("grads_bytes", "b", "bytes", "What the gradients take when present: parameters that require grad, in "
          "their gradient's dtype.", column="grads", **_MODEL, charts=("categories",), label="gradients"),
    Field("optimizer_bytes", "b", "bytes", "Every tensor in the watched optimizers' state (each storage once).",
          column="optimizer", **_MODEL, charts=("categories",), label="optimizer state"),
    Field("params_fp32_bytes", "b", "bytes", "The part of params_bytes held in float32 (what mixed precision "
          "would halve).", column="params_fp32", **_MODEL),
    Field("seq_len", "i", "tokens", "The step's longest input sequence (`vw.step(seq_len=...)`).", **_OPTIONAL,
          group="step"),
    Field("torch_version", "s", "", "torch's version on the rank.", **_OPTIONAL, group="runtime", sparse=True),
    Field("alloc_conf", "s", "", "The caching allocator's settings (PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF; "
          "`-` when unset).", **_OPTIONAL, group="runtime", sparse=True),
    Field("oom_marked", "flag", "", "true on the sample sent as the process hits an out-of-memory error.",
          group="marker"),
    Field("exit", "flag", "", "true on the last sample of a clean close().", column="exited", group="marker"),
    Field("phase_open", "flag", "", "true on the sample sent as a marked phase (`vw.phase`: checkpoint, eval) "
          "begins: the rank is in it, and may be silent, until its phase sample arrives.", group="marker"),
    Field("last_words_type", "s", "", "The process's last words: the uncaught exception's qualified type "
          "(torch.OutOfMemoryError) or the fatal signal (SIGSEGV), on the sample sent as it ends.", group="marker"),
    Field("last_words_message", "s", "", "The last words' message: its first line, redacted, at most 128 "
          "characters.", group="marker"),
    Field("last_words_phase", "s", "", "The training-loop phase the process was in as it ended.",
          group="marker"),
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


class WireError(VramwatchError, ValueError):
    """A sample or request body that cannot be true; ``field`` names the culprit."""

    status = 422

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def series_key(sample: Sample) -> tuple[str, str, int]:
    """A series is (run, host, rank): what the store, the engine, the dashboard, /metrics and
    analyze key on (the store adds the incarnation to tell restarts of one rank apart)."""
    return (sample["run"], sample["host"], sample["rank"])


def fields_of(*, group: str | None = None, chart: str | None = None, phase_marker: bool | None = None
              ) -> tuple[str, ...]:
    """Names of the fields of a ``group``, drawn in a ``chart`` or carried by phase markers, in table order."""
    return tuple(f.name for f in FIELD_TABLE
                 if (group is None or f.group == group) and (chart is None or chart in f.charts)
                 and (phase_marker is None or f.phase_marker == phase_marker))


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
