"""The OpenAPI description of the ingest body, derived from the wire definition (clients
and API fuzzers see the real body)."""

from __future__ import annotations

from typing import Any


def sample_json_schema() -> dict[str, Any]:
    """JSON Schema of one schema-1 sample. Cross-field rules (allocated <= reserved <=
    total, ...) are enforced by validation and described there."""
    from vramwatch import wire

    derived = getattr(wire, "sample_json_schema", None)  # the field table's own, where wire has it
    if derived is not None:
        return derived()
    count = {"type": "integer", "minimum": 0, "maximum": wire.MAX_INT}
    kinds: dict[str, dict[str, Any]] = {
        "i": count,
        "b": count,
        "b?": {"anyOf": [count, {"type": "null"}]},
        "s": {"type": "string", "minLength": 1, "maxLength": wire.MAX_NAME},
        "ts": {"type": "number", "minimum": wire.MIN_TS},
        "f": {"type": "number", "minimum": 0},
        "phase": {"type": "string", "pattern": wire.PHASE_RE.pattern.removesuffix(r"\Z").join("^$")},
        "allocator": {"type": "string", "enum": list(wire.ALLOCATORS)},
        "extra": {"type": "object", "maxProperties": wire.MAX_EXTRA_KEYS,
                  "additionalProperties": {"type": "number"}},
    }
    properties = {name: dict(kinds[kind]) for name, kind in wire.FIELDS.items()}
    properties["schema"] = {"type": "integer", "enum": [wire.SCHEMA_VERSION]}
    return {"type": "object", "properties": properties, "required": list(wire.REQUIRED_NAMES),
            "additionalProperties": False}


INGEST_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "Samples as a JSON array (at most 4 MiB inflated), one JSON object, or NDJSON; "
                       "optionally gzip (Content-Encoding: gzip). All or nothing: one invalid sample "
                       "rejects the batch (422).",
        "content": {
            "application/json": {"schema": {"anyOf": [
                {"$ref": "#/components/schemas/Sample"},
                {"type": "array", "items": {"$ref": "#/components/schemas/Sample"}},
            ]}},
            "application/x-ndjson": {"schema": {"type": "string"}},
        },
    },
}
