"""Samples to JSON lines (orjson); reading them back is :mod:`vramwatch.wire.validate`'s."""

from __future__ import annotations

from collections.abc import Iterable

import orjson

from vramwatch.wire.fields import Sample


def encode(sample: Sample) -> bytes:
    """One sample as a JSON line (no newline)."""
    return orjson.dumps(sample)


def encode_lines(samples: Iterable[Sample]) -> bytes:
    """NDJSON body: one sample per line, newline-terminated."""
    return b"".join(orjson.dumps(s) + b"\n" for s in samples)
