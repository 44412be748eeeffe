"""Small builders shared by the foundation tests."""

from __future__ import annotations

import gzip
import time
from typing import Any

import orjson

GiB = 1024**3
H200_TOTAL = 143_771 * 2**20  # nvidia-smi: 143771 MiB


def make_sample(step: int = 0, **overrides: Any) -> dict[str, Any]:
    """A valid schema-1 sample of a plausible H200 rank at ``step``."""
    sample: dict[str, Any] = {
        "schema": 1,
        "run": "run-a",
        "host": "node-1",
        "rank": 0,
        "step": step,
        "ts": 1_760_000_000.0 + step,
        "phase": "train",
        "allocated_bytes": 100 * GiB + step * 1024,
        "reserved_bytes": 120 * GiB,
        "peak_allocated_bytes": 110 * GiB,
        "inactive_split_bytes": 2 * GiB,
        "alloc_retries": 0,
        "ooms": 0,
        "nvml_used_bytes": 125 * GiB,
        "total_bytes": H200_TOTAL,
    }
    sample.update(overrides)
    return sample


def ndjson(samples: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(s) + b"\n" for s in samples)


def gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def now() -> float:
    return time.time()


#: the ingest route requires a JSON content type (a browser's cross-site POST has none)
NDJSON_HEADERS = {"content-type": "application/x-ndjson"}
