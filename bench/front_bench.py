"""Front page latency at 64 shards x 64 ranks, and the cost of one poll.

How the shards are simulated, cheaply: one real collector receives a 64-rank run through
the real ingest path; its real ``/api/v1/runs/{run}/ranks`` and ``/api/v1/runs`` answers are
captured once and served by a separate process under 64 path prefixes
(``http://127.0.0.1:PORT/shard/<i>``), each with its ranks renumbered, so the front sees 64
shards answering real documents of the real size (4,096 rank rows in all) while the
machine runs one small server instead of 64 collectors.

Limit, measured in the same run: the same 64 GETs issued concurrently by a bare httpx
client that only decodes the JSON (no merge, no response). Ratio = front / limit.

    python -m bench.front_bench
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from bench.report import table, write_section

SHARDS = 64
RANKS = 64
RUN = "bench"
POLLS = 20


def _capture_documents(tmp: Path) -> tuple[bytes, bytes]:
    from vramwatch.collector.server import BackgroundServer
    from vramwatch.probe.simulated import simulate_trace

    with BackgroundServer(str(tmp / "one.db")) as srv:
        t0 = time.time() - 400
        for rank in range(RANKS):
            body = b"".join(orjson.dumps(s) + b"\n" for s in simulate_trace(
                "healthy", steps=300, run=RUN, host=f"node-{rank // 8}", rank=rank, start_ts=t0))
            httpx.post(srv.url + "/api/v1/samples", content=body, headers={"Content-Type": "application/x-ndjson"},
                       timeout=60).raise_for_status()
        ranks = httpx.get(f"{srv.url}/api/v1/runs/{RUN}/ranks", timeout=60).content
        runs = httpx.get(f"{srv.url}/api/v1/runs", timeout=60).content
    return ranks, runs


def _serve_shards(port: int, ranks_path: str, runs_path: str) -> None:
    """The child process: 64 canned shards under /shard/<i>."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    base_rows = orjson.loads(Path(ranks_path).read_bytes())
    runs = Path(runs_path).read_bytes()
    docs = []
    for i in range(SHARDS):
        rows = [{**r, "rank": r["rank"] + RANKS * i, "host": f"s{i}-{r['host']}"} for r in base_rows]
        docs.append(orjson.dumps(rows))

    async def ranks(request):  # type: ignore[no-untyped-def]
        return Response(docs[int(request.path_params["i"])], media_type="application/json")

    async def runs_route(request):  # type: ignore[no-untyped-def]
        return Response(runs, media_type="application/json")

    async def health(request):  # type: ignore[no-untyped-def]
        return Response(b'{"status":"ok"}', media_type="application/json")

    app = Starlette(routes=[Route("/shard/{i:int}/api/v1/runs/" + RUN + "/ranks", ranks),
                            Route("/shard/{i:int}/api/v1/runs", runs_route),
                            Route("/shard/{i:int}/healthz", health)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def _bare(urls: list[str]) -> float:
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(url: str) -> object:
            return (await client.get(url)).json()

        times = []
        for _ in range(POLLS):
            t0 = time.perf_counter()
            await asyncio.gather(*(one(u) for u in urls))
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _poll(url: str, polls: int = POLLS) -> tuple[float, float, int]:
    times, size = [], 0
    with httpx.Client(timeout=60) as client:
        for _ in range(polls):
            t0 = time.perf_counter()
            reply = client.get(url, headers={"Accept-Encoding": "gzip"})
            times.append(time.perf_counter() - t0)
            size = len(reply.content)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.95) - 1], size


def run() -> None:
    from vramwatch.collector.server import bind_socket
    from vramwatch.front import FrontSettings, PeerSource, parse_peers
    from vramwatch.front.server import BackgroundFront

    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        ranks_doc, runs_doc = _capture_documents(tmp)
        (tmp / "ranks.json").write_bytes(ranks_doc)
        (tmp / "runs.json").write_bytes(runs_doc)
        probe = bind_socket("127.0.0.1", 0)
        port = probe.getsockname()[1]
        probe.close()
        child = subprocess.Popen([sys.executable, "-m", "bench.front_bench", "--serve", str(port),
                                  str(tmp / "ranks.json"), str(tmp / "runs.json")])
        try:
            base = f"http://127.0.0.1:{port}/shard"
            deadline = time.monotonic() + 30
            while True:
                try:
                    httpx.get(f"{base}/0/healthz", timeout=1).raise_for_status()
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            peers = parse_peers([f"{base}/{i}" for i in range(SHARDS)])
            limit = asyncio.run(_bare([f"{p.url}/api/v1/runs/{RUN}/ranks" for p in peers]))
            rows = []
            for ttl in (0.0, 1.0):
                settings = FrontSettings(peers=PeerSource(static=peers), timeout_s=10.0, cache_ttl_s=ttl)
                with BackgroundFront(settings) as front:
                    p50, p95, size = _poll(f"{front.url}/api/v1/runs/{RUN}/ranks")
                    r50, _r95, rsize = _poll(f"{front.url}/api/v1/runs")
                rows.append((f"{ttl:g} s", f"{p50 * 1000:.0f} ms", f"{p95 * 1000:.0f} ms",
                             f"{p50 / limit:.2f}", f"{size / 2**20:.1f} MiB", f"{r50 * 1000:.0f} ms",
                             f"{rsize / 1024:.1f} KiB"))
        finally:
            child.terminate()
            child.wait(10)
    body = (
        f"{SHARDS} shards x {RANKS} ranks = {SHARDS * RANKS} rank rows, real collector documents served by one "
        f"process under {SHARDS} path prefixes (see the module docstring). Limit: the same {SHARDS} GETs, "
        f"concurrent, bare httpx + JSON decode, median {limit * 1000:.0f} ms in this run.\n\n"
        + table(["front cache TTL", "/ranks p50", "/ranks p95", "p50 / limit", "/ranks bytes (gzip)",
                 "/runs p50", "/runs bytes"], rows)
        + "\n\nWith the 1 s cache, browser tabs polling every 2 s cost the shards one fan-out per second at most, "
          "whatever the number of tabs; the front's memory holds one document per shard and request."
    )
    print(body)
    write_section("Federating front (64 shards x 64 ranks)", body, "python -m bench.front_bench")


def main(argv: list[str]) -> None:
    if argv[:1] == ["--serve"]:
        _serve_shards(int(argv[1]), argv[2], argv[3])
    else:
        run()


if __name__ == "__main__":
    main(sys.argv[1:])
