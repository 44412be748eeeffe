"""Samples to and from JSON lines (orjson)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

from vramwatch.wire.fields import Sample, WireError


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
