"""Request bodies and heavy reads: what hostile ingest bodies and a burst of CPU-heavy reads cost
the collector, before and after, in one run.

    python -m bench.bodies_bench --before DIR      # docs/benchmarks.md "## Request bodies and heavy reads"
    python -m bench.bodies_bench --before DIR --no-write

``--before DIR``: an older checkout of vramwatch (``git archive <commit> | tar -x -C DIR``); each
row runs against it and against this tree, each in a fresh ``vramwatch serve`` subprocess (peak
RSS: its VmHWM) with ``/healthz`` polled every 20 ms on its own connection (:mod:`bench.attack_inputs`).

Bodies (plain, not gzip, 16 MiB: ``max_body_bytes``): a JSON array of 5.6 M ``{}``, of 8.4 M
``0``, one array item holding 8.4 M numbers, 50,000 valid samples as one array, NDJSON of 5.6 M
``{}``; and 1 MiB (``INLINE_BYTES``: decoded on the event loop) of ``{"a":1}`` items, an array
and NDJSON. Heavy reads: a run of 64 ranks x 2,000 steps and 8 more runs, then 24 concurrent
advice / figures / compare requests (distinct parameters: no cached answer).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.attack_bench import BASE, HealthPoller
from bench.attack_inputs import _serve
from bench.report import table, write_section

MiB = 2**20
BODY = 16 * MiB
JSON = {"content-type": "application/json"}


def _filled(item: bytes, opener: bytes = b"[", closer: bytes = b"]", sep: bytes = b",", size: int = BODY) -> bytes:
    count = (size - len(opener) - len(closer)) // (len(item) + len(sep))
    return opener + sep.join([item] * count) + closer


def _valid_array(count: int = 50_000) -> bytes:
    now = time.time()
    return orjson.dumps([{**BASE, "run": "v", "rank": i % 64, "step": i // 64, "ts": now - count // 64 + i // 64}
                         for i in range(count)])


BODIES = [
    ("JSON array of 5.6 M `{}`", lambda: _filled(b"{}")),
    ("JSON array of 8.4 M `0`", lambda: _filled(b"0")),
    ("JSON array of one item of 8.4 M numbers", lambda: b"[" + _filled(b"0", size=BODY - 2) + b"]"),
    ("JSON array of 50,000 valid samples", _valid_array),
    ("NDJSON of 5.6 M `{}`", lambda: _filled(b"{}", b"", b"", b"\n")),
    ("JSON array of 131,071 `{\"a\":1}` (1 MiB: within INLINE_BYTES)", lambda: _filled(b'{"a":1}', size=MiB)),
    ("NDJSON of 131,071 `{\"a\":1}` (1 MiB: within INLINE_BYTES)", lambda: _filled(b'{"a":1}', b"", b"", b"\n", MiB)),
]


def post_body(body: bytes) -> Any:
    def attack(url: str) -> dict[str, Any]:
        started = time.monotonic()
        r = httpx.post(url + "/api/v1/samples", content=body, headers=JSON, timeout=300)
        return {"status": r.status_code, "answer_s": time.monotonic() - started,
                "detail": str(r.json().get("detail", r.json().get("accepted", "")))[:90]}
    return attack


def _runs(url: str, ranks: int, steps: int, others: int) -> None:
    now = time.time()
    with httpx.Client(base_url=url, timeout=120) as client:
        for run, count in [("big", ranks), *((f"o{i}", 8) for i in range(others))]:
            for first in range(0, steps, 500):
                lines = b"".join(orjson.dumps({**BASE, "run": run, "rank": r, "step": k, "ts": now - steps + k,
                                               "allocated_bytes": (1 << 30) + k * 4096,
                                               "peak_allocated_bytes": (1 << 30) + k * 4096}) + b"\n"
                                 for r in range(count) for k in range(first, min(steps, first + 500)))
                assert client.post("/api/v1/samples", content=lines,
                                   headers={"content-type": "application/x-ndjson"}).status_code == 200


def heavy_burst(requests: int, ranks: int = 64, steps: int = 2000, others: int = 8) -> Any:
    paths = []
    for i in range(requests):
        kind = i % 3
        if kind == 0:
            paths.append(f"/api/v1/runs/big/advice?margin={0.05 + i / 1000:.3f}")
        elif kind == 1:
            paths.append(f"/api/v1/runs/o{i % others}/figures")
        else:
            paths.append(f"/api/v1/compare?a=big&b=o{i % others}")

    def attack(url: str) -> dict[str, Any]:
        _runs(url, ranks, steps, others)
        t0 = time.perf_counter()
        httpx.get(url + "/api/v1/runs/big/advice?margin=0.5", timeout=300)
        one_s = time.perf_counter() - t0

        def get(path: str) -> int:
            return httpx.get(url + path, timeout=300).status_code

        started = time.monotonic()
        with HealthPoller(url, timeout_s=120) as poller, ThreadPoolExecutor(requests) as pool:
            codes = list(pool.map(get, paths))
        burst = poller.summary()
        return {"status": {c: codes.count(c) for c in sorted(set(codes))}, "answer_s": time.monotonic() - started,
                "detail": f"during the burst /healthz p99 {burst['p99_ms']:,.0f} ms, max {burst['max_ms']:,.0f} ms; "
                          f"one advice alone {one_s:.2f} s"}
    return attack


def rows_for(code: Path, tmp: Path, requests: int) -> list[tuple[str, str]]:
    rows = []
    for i, (name, make) in enumerate(BODIES):
        body = make()
        r = _serve(code, tmp, f"body{i}", ["serve", "--db", str(tmp / f"body{i}.db")], post_body(body))
        rows.append((f"{name} ({len(body) / MiB:.1f} MiB)", r))
        print(name, {k: v for k, v in r.items() if k != "startup_s"}, flush=True)
    r = _serve(code, tmp, "heavy", ["serve", "--db", str(tmp / "heavy.db")], heavy_burst(requests))
    rows.append((f"{requests} concurrent advice / figures / compare reads (64 ranks x 2,000 steps)", r))
    print("heavy", r, flush=True)
    return rows


def _cell(r: dict[str, Any]) -> str:
    return (f"{r['rss_mb']:,.0f} MB; /healthz max {r['health_max_ms']:,.0f} ms; {r['status']} in "
            f"{r['answer_s']:.2f} s: {r['detail']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", metavar="DIR", help="an older checkout to compare with")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "before").mkdir()
        (Path(tmp) / "after").mkdir()
        before = rows_for(Path(args.before).resolve(), Path(tmp) / "before", args.requests) if args.before else []
        after = rows_for(Path(__file__).resolve().parents[1], Path(tmp) / "after", args.requests)
    rows = [(name, _cell(before[i][1]) if before else "—", _cell(r)) for i, (name, r) in enumerate(after)]
    body = table(["input", "before: peak RSS; /healthz max; answer", "after"], rows)
    body += ("\n\nPeak RSS is the collector's (VmHWM of a fresh `vramwatch serve` per row, defaults: "
             "`max_body_bytes` 16 MiB, 50,000 samples per request, 2 heavy-read slots, 10 s queue); `/healthz` "
             "polled every 20 ms on its own connection (the heavy-read row's first figure spans loading the runs, "
             "256,000 samples in batches of 32,000, too). *Before* is the tree given as `--before`.")
    if not args.no_write:
        command = "python -m bench.bodies_bench" + (f" --before {args.before}" if args.before else "")
        write_section("Request bodies and heavy reads", body, command)
    print(body)


if __name__ == "__main__":
    main()
