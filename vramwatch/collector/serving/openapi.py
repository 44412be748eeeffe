"""The OpenAPI description of the ingest body, derived from the wire definition (clients
and API fuzzers see the real body)."""

from __future__ import annotations

from typing import Any


def sample_json_schema() -> dict[str, Any]:
    """JSON Schema of one sample, derived from the wire field table (for the OpenAPI document)."""
    from vramwatch import wire

    return wire.sample_json_schema()


#: The OpenAPI operation of ``POST /api/v1/samples`` (vramwatch.collector.ingest.routes.route: plain
#: ASGI, so it is described here rather than by FastAPI).
INGEST_OPERATION: dict[str, Any] = {
    "summary": "Ingest",
    "description": "Store a batch of samples, all or nothing. 200 with accepted/duplicates; 401 without the "
                   "token; 413 past a size or count limit; 415 for a content type or encoding not accepted; "
                   "422 naming each bad sample's index and field; 503 busy (Retry-After); 507 disk full.",
    "operationId": "ingest_api_v1_samples_post",
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
    "responses": {"200": {"description": "Stored", "content": {"application/json": {"schema": {"type": "object"}}}}},
}
