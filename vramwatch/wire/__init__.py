"""Wire format: the one definition of a vramwatch sample, its validation and its files.

A sample is one rank at one step (or one phase event), a flat JSON object. The hook builds
them, the collector validates and stores them, trace files hold them one per line (JSON
Lines, optionally gzipped), and ``vramwatch analyze`` reads them. Samples travel as plain
``dict`` objects: the hot paths (hook, ingest, analyze) never pay for object construction.

The package is the bottom layer: it imports nothing else of vramwatch.

| module | what |
|---|---|
| ``fields`` | :data:`FIELD_TABLE` (every field: kind, unit, schemas, store column, group, metric, charts), |
| | ``Sample``, ``WireError`` |
| ``structs`` | the acceptor: one msgspec Struct per schema, generated from the table, and the checks after it |
| ``validate`` | :func:`validate` (a dict), :func:`decode_line` (a JSON line), :func:`decode_samples` (a |
| | body's text), all through ``structs``; the error naming a refused sample's field |
| ``codec`` | samples to JSON lines |
| ``tracefile`` | trace files (``.jsonl``, ``.jsonl.gz``): read, stream, write |
| ``schema`` | the JSON Schema, ``docs/fields.md`` and ``dashboard/fields.js``, derived from the table |
"""

from vramwatch.wire.codec import encode, encode_lines
from vramwatch.wire.fields import (
    ALLOCATORS,
    CHARTS,
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
    Metric,
    Sample,
    WireError,
    fields_of,
    fully_measured,
    invisible_character,
    series_key,
)
from vramwatch.wire.schema import fields_js, fields_markdown, sample_json_schema
from vramwatch.wire.tracefile import TraceWriter, iter_file, iter_samples, write_file
from vramwatch.wire.validate import decode_line, decode_samples, validate

__all__ = [
    "ALLOCATORS",
    "CHARTS",
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
    "Metric",
    "Sample",
    "TraceWriter",
    "WireError",
    "decode_line",
    "decode_samples",
    "encode",
    "encode_lines",
    "fields_js",
    "fields_markdown",
    "fields_of",
    "fully_measured",
    "invisible_character",
    "iter_file",
    "iter_samples",
    "sample_json_schema",
    "series_key",
    "validate",
    "write_file",
]
