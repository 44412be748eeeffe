"""The OpenAPI description of the ingest body, derived from the wire definition (clients
and API fuzzers see the real body)."""

from __future__ import annotations

from typing import Any


def sample_json_schema() -> dict[str, Any]:
    """JSON Schema of one sample, derived from the wire field table (for the OpenAPI document)."""
    from vramwatch import wire

    return wire.sample_json_schema()


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
