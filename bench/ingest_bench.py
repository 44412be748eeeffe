"""Ingest throughput: samples/s through ``POST /api/v1/samples`` (gzip NDJSON, batches of
1000) into SQLite, with the live engines running, and on-disk bytes per stored sample.

The collector runs as a real ``vramwatch serve`` subprocess; the client posts pre-encoded
bodies so the figure is the collector's, not the client's.

    python -m bench.ingest_bench [--samples 200000] [--ranks 64]
"""

from __future__ import annotations

import argparse
import gzip
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.report import table, write_section
from vramwatch.probe.simulated import simulate_trace
from vramwatch.wire import encode_lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_collector(db: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vramwatch", "serve", "--port", str(port), "--db", db, "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("collector did not start: " + proc.stderr.read().decode()[-2000:])


def make_bodies(total: int, ranks: int, batch: int) -> list[bytes]:
    per_rank = total // ranks
    traces = [list(simulate_trace("healthy", steps=per_rank, run="bench", host=f"node-{r // 8}", rank=r, seed=r))
              for r in range(ranks)]
    # interleave ranks like a live job: step-major
    samples = [s for step_samples in zip(*traces, strict=False) for s in step_samples]
    return [gzip.compress(encode_lines(samples[i:i + batch]), 1) for i in range(0, len(samples), batch)]


def run(total: int, ranks: int, batch: int, concurrency: int) -> dict[str, float]:
    bodies = make_bodies(total, ranks, batch)
    n_samples = sum(1 for b in bodies for _ in gzip.decompress(b).splitlines())
    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "bench.db")
        proc, url = start_collector(db)
        try:
            headers = {"content-encoding": "gzip", "content-type": "application/x-ndjson"}
            latencies: list[float] = []
            with httpx.Client(base_url=url, timeout=60) as client:
                def send(body: bytes) -> None:
                    t0 = time.perf_counter()
                    r = client.post("/api/v1/samples", content=body, headers=headers)
                    latencies.append(time.perf_counter() - t0)
                    r.raise_for_status()

                send(bodies[0])  # warm connection and schema
                t0 = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    list(pool.map(send, bodies[1:]))
                elapsed = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(30)
        with sqlite3.connect(db) as conn:
            stored = conn.execute("SELECT count(*) FROM samples").fetchone()[0]
            conn.execute("VACUUM")
        size = Path(db).stat().st_size
    sent = n_samples - len(gzip.decompress(bodies[0]).splitlines())
    return {
        "samples": stored,
        "samples_per_s": sent / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": sorted(latencies)[int(0.99 * (len(latencies) - 1))] * 1000,
        "bytes_per_sample": size / stored,
    }


class _NoEngine:
    """An engine that judges nothing: what live state costs without its engine."""

    def update(self, sample: dict) -> list:
        return []


def _chained(bodies: list[bytes], engine_factory: object,
             decode: Callable[[bytes], list] | None = None) -> dict[str, float]:
    """The route's stages run one batch after the other as the handler runs them (so each
    stage pays for the caches the others leave cold), CPU seconds summed per stage; garbage
    collections are timed apart (``gc.callbacks``) and taken out of the stage they fell in.
    ``decode``: inflated body -> samples (default: the route's one-pass decoder of a whole text)."""
    import gc

    from vramwatch.collector.ingest.body import iter_inflated
    from vramwatch.collector.state.live import LiveState
    from vramwatch.collector.store import Store
    from vramwatch.wire import decode_samples

    decode = decode or (lambda raw: decode_samples(raw, now=time.time()))  # type: ignore[misc]
    clock = time.process_time
    spent = dict.fromkeys(("gunzip", "decode", "insert", "live", "gc"), 0.0)
    gc_started = [0.0]

    def on_gc(phase: str, _info: dict) -> None:
        if phase == "start":
            gc_started[0] = clock()
        else:
            spent["gc"] += clock() - gc_started[0]

    with tempfile.TemporaryDirectory() as tmp:
        store, live = Store(os.path.join(tmp, "chained.db")), LiveState(engine_factory)  # type: ignore[arg-type]
        gc.callbacks.append(on_gc)
        try:
            for body in bodies:
                gc0, t0 = spent["gc"], clock()
                raw = b"".join(iter_inflated(body, 1 << 28))
                t1 = clock()
                samples = decode(raw)
                t2 = clock()
                gc1 = spent["gc"]
                result = store.insert(samples)
                t3 = clock()
                gc2 = spent["gc"]
                live.ingest(samples, accepted=result.accepted_by_series)
                t4 = clock()
                spent["gunzip"] += t1 - t0
                spent["decode"] += t2 - t1 - (gc1 - gc0)
                spent["insert"] += t3 - t2 - (gc2 - gc1)
                spent["live"] += t4 - t3 - (spent["gc"] - gc2)
        finally:
            gc.callbacks.remove(on_gc)
            store.close()
    return spent


def stage_costs(total: int, ranks: int, batch: int) -> list[tuple[str, float]]:
    """CPU time per 1000 samples of each stage of ``POST /api/v1/samples``, in-process (no
    HTTP), chained per batch as the handler runs them (:func:`_chained`), best of 2; the
    engines' shares are the differences between runs with no engine, the trend engine and
    the collector's decision engine. Rows named ``(alternative) ...`` are not on the route
    and not summed."""
    from vramwatch.collector.ingest.body import parse_body
    from vramwatch.decisions.online import DecisionEngine
    from vramwatch.engine import TrendEngine
    from vramwatch.wire import validate

    bodies = make_bodies(min(total, 64_000), ranks, batch)
    n = sum(gzip.decompress(b).count(b"\n") for b in bodies)
    per_k = 1000 / (n / 1000)
    runs = {}
    for name, factory in (("none", _NoEngine), ("trend", TrendEngine), ("decision", DecisionEngine)):
        tries = [_chained(bodies, factory) for _ in range(2)]
        runs[name] = {k: min(t[k] for t in tries) for k in tries[0]}
    full = runs["decision"]
    checked = min(_chained(bodies, DecisionEngine, lambda raw: [validate(x) for x in parse_body(raw)])["decode"]
                  for _ in range(2)) * per_k
    return [
        ("gunzip", full["gunzip"] * per_k),
        ("decode + validate in one pass (`wire.decode_samples`)", full["decode"] * per_k),
        ("SQLite insert (`Store.insert`)", full["insert"] * per_k),
        ("live state, engines excluded", runs["none"]["live"] * per_k),
        ("trend engine (`TrendEngine.update`)", (runs["trend"]["live"] - runs["none"]["live"]) * per_k),
        ("decisions on top of it (`DecisionEngine.update` minus its trend engine)",
         (full["live"] - runs["trend"]["live"]) * per_k),
        ("garbage collection (all stages)", full["gc"] * per_k),
        ("(alternative) JSON parse + validate (`parse_body` + `wire.validate`, a refused block's path), chained "
         "the same way", checked),
    ]


def http_floor(bodies: list[bytes]) -> float:
    """Server CPU ms per POST of ``bodies`` sent to bare uvicorn + httptools with an app that
    reads the body and answers (``bench.http_bench``'s limit server): what HTTP alone costs."""
    from bench.http_bench import TrivialProcess, cpu_per_post, hook_request

    server = TrivialProcess("bare")
    try:
        return cpu_per_post(server, [hook_request(b) for b in bodies])
    finally:
        server.stop()


def server_cpu_vs_limit(total: int, ranks: int, batch: int) -> dict[str, float]:
    """The whole HTTP ingest path against the machine's limit, in CPU time (robust on a
    shared machine where wall-clock throughput moves 2x between runs).

    Measured: CPU seconds of the ``vramwatch serve`` process per 1000 samples while one
    client posts the gzip NDJSON batches (and the wall time of each POST). Limit:
    :func:`store_limit`'s (orjson decode of the same NDJSON plus one bare ``executemany`` of
    the same rows into the store's own table), in the same run. Ratio = limit / measured
    (1.0: ingest costs no more than decoding and inserting)."""
    from collector_process import CollectorProcess

    bodies = make_bodies(min(total, 64_000), ranks, batch)
    headers = {"content-type": "application/x-ndjson", "content-encoding": "gzip"}
    latencies = []
    with tempfile.TemporaryDirectory() as tmp, CollectorProcess(os.path.join(tmp, "cpu.db")) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        client.post("/api/v1/samples", content=bodies[0], headers=headers).raise_for_status()
        cpu0 = srv.cpu_seconds()
        for body in bodies[1:]:
            t0 = time.perf_counter()
            client.post("/api/v1/samples", content=body, headers=headers).raise_for_status()
            latencies.append(time.perf_counter() - t0)
        sent = sum(gzip.decompress(b).count(b"\n") for b in bodies[1:])
        server_ms = (srv.cpu_seconds() - cpu0) * 1000 / (sent / 1000)
    _insert_ms, limit_ms = store_limit(total, ranks, batch)
    latencies.sort()
    return {"server_ms": server_ms, "limit_ms": limit_ms, "ratio": limit_ms / server_ms,
            "http_ms": http_floor(bodies[1:]) / (sent / len(bodies[1:]) / 1000),
            "p50_ms": 1000 * latencies[len(latencies) // 2],
            "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))], "batches": len(latencies)}


#: why the goal is out of reach, from the stages measured inside the serving process
CEILING_NOTE = (
    "Why 0.7 is out of reach as the limit is defined: timed inside the serving process (thread CPU around "
    "each stage of the handler, 64 batches, 2026-12-01 20:30 UTC, server CPU 19.8 ms per 1000 samples), the "
    "SQLite insert alone took 7.7 ms, more than the whole limit (orjson decode plus a bare executemany of "
    "the same rows into the same table: 5.9 to 7.6 ms in these runs); inflate + decode + validate 5.9 ms, "
    "the engines and live state 4.5, the capacity check 0.4, the handler 0.9, HTTP 0.2 to 0.3. With decode "
    "and the engines free, the ratio would be about 0.6; the engines judge every sample in Python by design "
    "(docs/engine.md).")


def write_cpu_section(res: dict[str, float], stages: list[tuple[str, float]], args: argparse.Namespace) -> None:
    load = " / ".join(f"{x:.1f}" for x in res["loadavg"])
    body = table(["", "CPU ms / 1000 samples", "samples per CPU-second"], [
        ("collector process, whole HTTP path (server CPU)", f"{res['server_ms']:.2f}",
         f"{1e6 / res['server_ms']:,.0f}"),
        ("limit: orjson decode + one executemany of the same rows", f"{res['limit_ms']:.2f}",
         f"{1e6 / res['limit_ms']:,.0f}"),
    ])
    body += (f"\n\n**measured / limit = {1e6 / res['server_ms']:,.0f} / {1e6 / res['limit_ms']:,.0f} samples per "
             f"CPU-second = {res['ratio']:.2f}** (goal ≥ 0.7). Per batch of {args.batch} samples "
             f"({res['batches']:.0f} POSTs, one client connection): p50 {res['p50_ms']:.1f} ms, "
             f"**p99 {res['p99_ms']:.1f} ms** (goal < 100 ms). The median of {len(res['rounds'])} rounds, each "
             "measured against its own limit; all rounds' ratio (p99): "
             + ", ".join(f"{ratio:.2f} ({p99:.0f} ms)" for ratio, p99 in res["rounds"])
             + f". Load average (1/5/15 min) at the start: {load} on {os.cpu_count()} cores shared with other "
             "jobs: read the ratio, not the absolute figures.")
    summed = [(name, ms) for name, ms in stages if not name.startswith("(alternative)")]
    http = res["http_ms"]
    rest = res["server_ms"] - sum(ms for _, ms in summed) - http
    rows = [(name, f"{ms:.2f}", f"{ms / res['server_ms']:.0%}") for name, ms in summed]
    rows.append(("HTTP: uvicorn + httptools, transport, socket I/O (the same POSTs to a bare app that reads the "
                 "body and answers, same round)", f"{http:.2f}", f"{http / res['server_ms']:.0%}"))
    rows.append(("the rest: front door, handler, metrics, WAL checkpoints, and what the stages cost more in the "
                 "server than chained in-process (server CPU minus the rows above)", f"{rest:.2f}",
                 f"{rest / res['server_ms']:.0%}"))
    rows += [(name, f"{ms:.2f}", "") for name, ms in stages if name.startswith("(alternative)")]
    body += ("\n\nWhere the collector's CPU goes (stages timed in-process on the same data in the same run, "
             "chained per batch as the handler runs them, best of 2):\n\n"
             + table(["stage", "CPU ms / 1000 samples", "share"], rows))
    body += ("\n\n" + CEILING_NOTE)
    write_section("Ingest against its limit (CPU)", body,
                  f"python -m bench.ingest_bench --samples {args.samples} --ranks {args.ranks}")


def store_limit(total: int, ranks: int, batch: int) -> tuple[float, float]:
    """CPU ms per 1000 samples of the store's insert and of its limit on the same data: one
    orjson decode of the NDJSON plus one bare ``executemany`` of the same rows into a table of
    the same shape (the store's own, emptied), measured side by side."""
    import orjson

    from vramwatch.collector.ingest.body import gunzip_limited, parse_body
    from vramwatch.collector.store import Store
    from vramwatch.collector.store.schema import insert_sql

    raws = [gunzip_limited(b, 1 << 28) for b in make_bodies(min(total, 64_000), ranks, batch)]
    items = [parse_body(r) for r in raws]
    n = sum(len(b) for b in items)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(os.path.join(tmp, "limit.db"))
        names = store._present(items[0])
        rows = [store._rows(b, names)[0] for b in items]
        sql = insert_sql(names)
        t0 = time.process_time()
        for b in items:
            store.insert(b)
        insert_ms = (time.process_time() - t0) * 1000 / (n / 1000)
        store._conn.execute("DELETE FROM samples")
        t0 = time.process_time()
        for raw, batch_rows in zip(raws, rows, strict=True):
            orjson.loads(b"[" + raw.rstrip().replace(b"\n", b",") + b"]")
            store._conn.execute("BEGIN")
            store._conn.executemany(sql, batch_rows)
            store._conn.execute("COMMIT")
        limit_ms = (time.process_time() - t0) * 1000 / (n / 1000)
        store.close()
    return insert_ms, limit_ms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of (server CPU, limit); the median round by ratio is reported")
    parser.add_argument("--cpu-only", action="store_true",
                        help="only the CPU-against-the-limit section (skips the wall-clock runs of '## Ingest')")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    rounds = sorted((server_cpu_vs_limit(args.samples, args.ranks, args.batch) for _ in range(args.rounds)),
                    key=lambda r: r["ratio"])
    cpu = rounds[len(rounds) // 2]  # the median round: each round's figure and limit are measured together
    cpu["loadavg"] = load  # type: ignore[assignment]
    cpu["rounds"] = [(r["ratio"], r["p99_ms"]) for r in rounds]  # type: ignore[assignment]
    print(f"CPU against the limit: {cpu}")
    stages = stage_costs(args.samples, args.ranks, args.batch)
    print(stages)
    write_cpu_section(cpu, stages, args)
    if args.cpu_only:
        return
    rows = []
    for concurrency in (1, 2):
        res = run(args.samples, args.ranks, args.batch, concurrency)
        print(f"concurrency={concurrency}: {res}")
        rows.append((concurrency, f"{res['samples']:,}", f"{res['samples_per_s']:,.0f}",
                     f"{res['p50_ms']:.1f}", f"{res['p99_ms']:.1f}", f"{res['bytes_per_sample']:.1f}"))
    body = table(["client connections", "samples stored", "samples/s", "p50 ms/batch", "p99 ms/batch",
                  "DB bytes/sample (after VACUUM)"], rows)
    body += (f"\n\nBatches of {args.batch} samples, gzip NDJSON, {args.ranks} simulated ranks (`healthy` scenario), "
             "collector as a `vramwatch serve` subprocess with live trend engines running on every sample. "
             "Targets: ≥ 100k samples/s sustained, ≤ 100 bytes per stored sample.")
    body += "\n\nWhere the time goes (CPU ms per 1000 samples, in-process, same data):\n\n"
    body += table(["stage", "ms / 1000 samples"], [(name, f"{ms:.2f}") for name, ms in stages])
    total_ms = sum(ms for name, ms in stages if not name.startswith("(alternative)"))
    body += (f"\n\nThe stages add up to {total_ms:.1f} ms per 1000 samples ({1000 / total_ms * 1000:,.0f} samples/s "
             "of pure CPU); the collector process's CPU beyond them (HTTP, handler, WAL checkpoints) is in "
             "\"Ingest against its limit (CPU)\"; the wall-clock figures share 2 cores with the client.")
    insert_ms, limit_ms = store_limit(args.samples, args.ranks, args.batch)
    body += ("\n\nStore side against its limit (orjson decode of the same NDJSON plus one bare `executemany` of the "
             "same rows into the store's own table, same run):\n\n"
             + table(["", "ms / 1000 samples"], [("decode + validate + `Store.insert`",
                                                  f"{stages[1][1] + insert_ms:.2f}"),
                                                 ("limit", f"{limit_ms:.2f}"),
                                                 ("limit / measured", f"{limit_ms / (stages[1][1] + insert_ms):.2f}")]))
    write_section("Ingest", body, f"python -m bench.ingest_bench --samples {args.samples} --ranks {args.ranks}")


if __name__ == "__main__":
    main()
