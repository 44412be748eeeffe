"""Small builders shared by the foundation tests."""

from __future__ import annotations

import gzip
import sqlite3
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import orjson

T = TypeVar("T")

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


#: a bearer token for collectors started with one
TOKEN = "tok-3f9a1c0e7b2d4c58a1e6"


def stored(db: str, run: str | None = None) -> int:
    """Samples in a collector's database file (of one run, when given)."""
    with sqlite3.connect(db) as conn:
        if run is None:
            return conn.execute("SELECT count(*) FROM samples").fetchone()[0]
        return conn.execute(
            "SELECT count(*) FROM samples JOIN series ON series.id = samples.series WHERE run = ?", (run,)
        ).fetchone()[0]


def fresh(n: int, start: int = 0, **kw: Any) -> list[dict[str, Any]]:
    """``n`` samples of steps ``start``... with timestamps of the last 100 s."""
    t = time.time()
    return [make_sample(i, ts=t - 100 + i * 0.01, **kw) for i in range(start, start + n)]


def post(client: httpx.Client, samples: list[dict[str, Any]], headers: dict[str, str] | None = None,
         **kw: Any) -> httpx.Response:
    """POST samples as NDJSON to the collector ``client`` talks to."""
    return client.post("/api/v1/samples", content=ndjson(samples), headers={**NDJSON_HEADERS, **(headers or {})}, **kw)


def wait_until(check: Callable[[], T], timeout: float = 10.0, what: str = "the expected state") -> T:
    """Call ``check`` until it returns a truthy value (returned) or ``timeout`` passes: a test waits
    for the state it checks, never for a fixed delay. Polls every 20 ms."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout:g} s (last: {got!r})")
        time.sleep(0.02)


def ending_at(trace: list[dict[str, Any]], end: float) -> list[dict[str, Any]]:
    """The trace shifted in time so its latest sample is at ``end``: the ranks of one job end
    together, each within its silence window of ``end`` (a rank judged stopped has its state
    families withdrawn, and a rank whose peers went on past its window was killed alone)."""
    shift = end - max(s["ts"] for s in trace)
    return [{**s, "ts": s["ts"] + shift} for s in trace]
