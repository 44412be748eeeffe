"""Wire format: the one definition of a vramwatch sample, its validation and its files.

A sample is one rank at one step (or one phase event), a flat JSON object. The hook builds
them, the collector validates and stores them, trace files hold them one per line (JSON
Lines, optionally gzipped), and ``vramwatch analyze`` reads them. Samples travel as plain
``dict`` objects: the hot paths (hook, ingest, analyze) never pay for object construction.

The package is the bottom layer: it imports nothing else of vramwatch.

| module | what |
|---|---|
| ``fields`` | :data:`FIELD_TABLE` (every field: kind, unit, schemas, store column), ``Sample``, ``WireError`` |
| ``validate`` | :func:`validate`: one decoded sample, fast path for canonical samples, slow path naming the field |
| ``decode`` | one C pass (msgspec Structs generated from the table) for trace lines and request bodies |
| ``codec`` | samples to JSON lines and back |
| ``tracefile`` | trace files (``.jsonl``, ``.jsonl.gz``): read, stream, write |
| ``schema`` | the JSON Schema and ``docs/fields.md``, derived from the table |
"""

from vramwatch.wire.codec import decode_line, encode, encode_lines
from vramwatch.wire.fields import (
    ALLOCATORS,
    FIELD_BY_NAME,
    FIELD_TABLE,
    FIELDS,
    FULL_MEASUREMENTS,
    LEVEL_FIELDS,
    MAX_EXTRA_KEYS,
    MAX_INT,
    MAX_NAME,
    MIN_TS,
    PHASE_PATTERN,
    PHASE_RE,
    REQUIRED_NAMES,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    TRAIN_PHASE,
    Field,
    Sample,
    WireError,
    fully_measured,
    invisible_character,
    series_key,
)
from vramwatch.wire.schema import fields_markdown, sample_json_schema
from vramwatch.wire.tracefile import TraceWriter, iter_file, iter_samples, write_file
from vramwatch.wire.validate import validate

__all__ = [
    "ALLOCATORS",
    "FIELDS",
    "FIELD_BY_NAME",
    "FIELD_TABLE",
    "FULL_MEASUREMENTS",
    "LEVEL_FIELDS",
    "MAX_EXTRA_KEYS",
    "MAX_INT",
    "MAX_NAME",
    "MIN_TS",
    "PHASE_PATTERN",
    "PHASE_RE",
    "REQUIRED_NAMES",
    "SCHEMA_VERSION",
    "SCHEMA_VERSIONS",
    "TRAIN_PHASE",
    "Field",
    "Sample",
    "TraceWriter",
    "WireError",
    "decode_line",
    "encode",
    "encode_lines",
    "fields_markdown",
    "fully_measured",
    "invisible_character",
    "iter_file",
    "iter_samples",
    "sample_json_schema",
    "series_key",
    "validate",
    "write_file",
]
