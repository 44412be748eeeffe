"""Descriptions derived from :data:`vramwatch.wire.FIELD_TABLE`: the JSON Schema of a sample
(for the collector's OpenAPI document), the markdown field table of ``docs/fields.md`` and the
dashboard's field lists (``dashboard/fields.js``).

Regenerate the generated files with :data:`REGENERATE` and :data:`REGENERATE_JS`.
"""

from __future__ import annotations

import json
from typing import Any

from vramwatch.wire.fields import (
    _ALL,
    ALLOCATORS,
    CHARTS,
    FIELD_BY_NAME,
    FIELD_TABLE,
    LEVEL_FIELDS,
    MAX_EXTRA_KEYS,
    MAX_INT,
    MAX_NAME,
    MIN_TS,
    PHASE_PATTERN,
    REQUIRED_NAMES,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    Field,
)

#: the shell command that rewrites docs/fields.md
REGENERATE = 'python -c "from vramwatch import wire; print(wire.fields_markdown(), end=\'\')" > docs/fields.md'
#: the shell command that rewrites dashboard/fields.js
REGENERATE_JS = 'python -c "from vramwatch import wire; print(wire.fields_js(), end=\'\')" > dashboard/fields.js'


def _json_property(f: Field, version: int | None) -> dict[str, Any]:
    count = {"type": "integer", "minimum": 0, "maximum": MAX_INT}
    prop: dict[str, Any] = {
        "i": count, "b": count,
        "s": {"type": "string", "minLength": 1, "maxLength": MAX_NAME},
        "ts": {"type": "number", "minimum": MIN_TS},
        "f": {"type": "number", "minimum": 0},
        "phase": {"type": "string", "pattern": f"^{PHASE_PATTERN}$"},
        "allocator": {"type": "string", "enum": list(ALLOCATORS)},
        "flag": {"type": "boolean"},
        "extra": {"type": "object", "maxProperties": MAX_EXTRA_KEYS, "additionalProperties": {"type": "number"}},
    }[f.kind]
    prop = {**prop, "description": f.description + (f" Unit: {f.unit}." if f.unit else "")}
    nullable = f.nullable if version is None else (version,) if version in f.nullable else ()
    if nullable or (version is None and not f.required):
        prop = {"anyOf": [{k: v for k, v in prop.items() if k != "description"}, {"type": "null"}],
                "description": prop["description"]}
    return prop


def sample_json_schema() -> dict[str, Any]:
    """JSON Schema (2020-12, as OpenAPI 3.1 uses) of one sample in any accepted schema version.

    Derived from :data:`FIELD_TABLE`. Cross-field rules (allocated <= reserved <= total, ...)
    are enforced by :func:`validate` and described there; a schema-1 sample must carry every
    field schema 1 requires, non-null except ``nvml_used_bytes``.
    """
    properties = {f.name: _json_property(f, None) for f in FIELD_TABLE}
    properties["schema"] = {"type": "integer", "enum": list(SCHEMA_VERSIONS),
                            "description": FIELD_BY_NAME["schema"].description}
    v1 = [f for f in FIELD_TABLE if 1 in f.required]
    return {
        "type": "object",
        "properties": properties,
        "required": list(REQUIRED_NAMES),
        "additionalProperties": False,
        # at least one memory level
        "anyOf": [{"required": [name], "properties": {name: {"type": "integer"}}} for name in LEVEL_FIELDS],
        "if": {"properties": {"schema": {"const": 1}}},
        "then": {"required": [f.name for f in v1],
                 "properties": {f.name: _json_property(f, 1) for f in v1 if f.name != "schema"}},
    }


def fields_markdown() -> str:
    """The field table of ``docs/fields.md`` (regenerate with :data:`REGENERATE`)."""
    def versions(v: tuple[int, ...]) -> str:
        return "all" if set(_ALL) <= set(v) else ", ".join(map(str, v)) if v else "—"

    lines = [
        "# Sample fields",
        "",
        "<!-- generated from FIELD_TABLE in vramwatch/wire/fields.py; regenerate with"
        f" `{REGENERATE}` (tests/wire/test_wire.py fails when this file is stale) -->",
        "",
        f"Schemas accepted: {', '.join(map(str, SCHEMA_VERSIONS))} (this version writes {SCHEMA_VERSION}). "
        "*Required in* lists the schema versions that require the field; *null in* those where null means "
        "\"not measured\" (stored as NULL, never 0). A *sparse* field is sent only when its value changes (and "
        "on a process's first sample): readers carry its latest value forward. Schema 2 needs at least one of "
        f"{' or '.join(f'`{n}`' for n in LEVEL_FIELDS)} plus `total_bytes`.",
        "",
        "| field | type | unit | required in | null in | stored as | description |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in FIELD_TABLE:
        stored = f"`{f.table}.{f.column}`" if f.column else "—"
        lines.append(f"| `{f.name}` | {f.json_type} | {f.unit or '—'} | {versions(f.required)} | "
                     f"{versions(f.nullable)} | {stored} | {f.description}{' *Sparse.*' if f.sparse else ''} |")
    return "\n".join(lines) + "\n"


def fields_js() -> str:
    """The dashboard's ``fields.js`` module: the fields each chart fetches and the names of the
    lines drawn one per field (regenerate with :data:`REGENERATE_JS`)."""
    charts = {chart: [f.name for f in FIELD_TABLE if chart in f.charts] for chart in CHARTS}
    labels = {f.name: f.label for f in FIELD_TABLE if f.label}

    def js(value: object) -> str:
        return json.dumps(value, ensure_ascii=False)

    lines = [
        "/* Generated from FIELD_TABLE in vramwatch/wire/fields.py; regenerate with",
        f" * `{REGENERATE_JS}`",
        " * (tests/wire/test_wire.py fails when this file is stale). */",
        "",
        "/** Sample fields each chart fetches (besides ts), in the table's order. */",
        "export const CHART_FIELDS = {",
        *(f"  {chart}: {js(names)}," for chart, names in charts.items()),
        "};",
        "",
        "/** Fields sent only when they change: a chart carries the latest value forward. */",
        f"export const SPARSE_FIELDS = {js([f.name for f in FIELD_TABLE if f.sparse])};",
        "",
        "/** The name of a field's line where a chart draws one line per field. */",
        "export const FIELD_LABELS = {",
        *(f"  {name}: {js(label)}," for name, label in labels.items()),
        "};",
    ]
    return "\n".join(lines) + "\n"
