"""Server CPU per small POST: the collector's HTTP layer on httptools vs h11, against the floor
of HTTP on this machine.

    python -m bench.http_bench [--posts 2000] [--rounds 5]

What runs
---------
* Two real ``vramwatch serve`` processes, ``--http httptools`` and ``--http h11`` (each its
  own database), and three trivial servers (an ASGI app that reads the body and answers a
  small JSON): bare uvicorn + httptools -- **the limit**, the cheapest HTTP this machine's
  Python serves --, and the same app behind the collector's guard on each protocol (the
  guard's own cost, apart from the collector's ingest).
* One client, one keep-alive connection per server, sends the hook's request (its headers,
  a 10-sample gzip NDJSON body built as ``bench.ingest_bench`` builds bodies, ~10 samples is
  one rank's batch at 10 steps/s) ``--posts`` times, one at a time.
* Rounds interleave the servers (the order rotates each round), so every server sees the
  same machine load; each collector gets new samples every round (a repeated sample would be
  a cheaper duplicate).

What is measured: CPU seconds of each server process (``/proc/<pid>/stat``) per POST.
Reported: each server's ms per POST over all rounds, and measured / limit with the limit (bare
uvicorn + httptools) measured in the same rounds; each round's ratios beside.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from collector_process import REPO, CollectorProcess, proc_cpu

from bench.ingest_bench import make_bodies
from bench.report import table, write_section

COMMAND = "python -m bench.http_bench"
SECTION = "HTTP layer: httptools vs h11 (server CPU per small POST)"
SAMPLES_PER_POST = 10
TRIVIAL = ("bare", "httptools", "h11")  # --serve-trivial: bare uvicorn+httptools, or the guard on one protocol


# ------------------------------------------------------------------ the trivial servers


async def _trivial_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, answers a small JSON (about the ingest route's answer)."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = b'{"accepted":10,"duplicates":0}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def serve_trivial(kind: str) -> None:
    """Run a trivial server on a free loopback port; print ``port N`` once it listens."""
    import uvicorn

    from vramwatch.collector.server import bind_socket, guarded_config
    from vramwatch.collector.serving.guard import ConnectionGuard
    from vramwatch.collector.settings import Settings

    options: dict[str, Any] = {"log_level": "warning", "access_log": False, "lifespan": "off"}
    if kind == "bare":
        config = uvicorn.Config(_trivial_app, http="httptools", **options)
    else:
        config = guarded_config(_trivial_app, ConnectionGuard(Settings(db_path="unused")), kind, **options)  # type: ignore[arg-type]
    sock = bind_socket("127.0.0.1", 0)
    print(f"port {sock.getsockname()[1]}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


class TrivialProcess:
    """``python -m bench.http_bench --serve-trivial KIND`` as a child process."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.http_bench", "--serve-trivial", kind],
                                     stdout=subprocess.PIPE, cwd=str(REPO))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("port "):
            self.proc.kill()
            raise RuntimeError(f"trivial server {kind} did not start: {line!r}")
        self.port = int(line.split()[1])

    def cpu_seconds(self) -> float:
        return proc_cpu(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ------------------------------------------------------------------ the client


def hook_request(body: bytes) -> bytes:
    """The request the hook's exporter sends (vramwatch/delivery/exporters.py), as bytes."""
    return (b"POST /api/v1/samples HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept-Encoding: identity\r\n"
            b"Content-Type: application/x-ndjson\r\nContent-Encoding: gzip\r\nUser-Agent: vramwatch-hook\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


class KeepAliveClient:
    """One keep-alive connection: send a request, read its answer (Content-Length framed)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def post(self, request: bytes) -> int:
        self.sock.sendall(request)
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self._recv()
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            rest += self._recv()
        self.buffer = rest[length:]
        return int(head.split(b" ", 2)[1])

    def _recv(self) -> bytes:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


def cpu_per_post(server: Any, requests: list[bytes]) -> float:
    """Server CPU ms per POST over ``requests`` on one new keep-alive connection (each must be
    answered 200); a new one each time, so no server's keep-alive timeout runs out between rounds."""
    client = KeepAliveClient(server.port)
    try:
        cpu0 = server.cpu_seconds()
        for request in requests:
            status = client.post(request)
            if status != 200:
                raise RuntimeError(f"{getattr(server, 'kind', 'collector')}: answered {status}")
        return (server.cpu_seconds() - cpu0) * 1000 / len(requests)
    finally:
        client.close()


# ------------------------------------------------------------------ the run


def run(posts: int, rounds: int, ranks: int) -> dict[str, Any]:
    """Per-round CPU ms per POST of each server; rounds interleave them (rotating order)."""
    bodies = make_bodies((rounds + 1) * posts * SAMPLES_PER_POST, ranks, SAMPLES_PER_POST)
    requests = [hook_request(b) for b in bodies]
    warm, rounds_requests = requests[:posts // 10], [requests[posts * (r + 1):posts * (r + 2)] for r in range(rounds)]
    servers: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for proto in ("httptools", "h11"):
                servers[f"collector {proto}"] = CollectorProcess(Path(tmp) / f"{proto}.db",
                                                                 args=("--http", proto)).start()
            for kind in TRIVIAL:
                servers[f"trivial {kind}"] = TrivialProcess(kind)
            for srv in servers.values():  # warm: schema, caches, first series
                cpu_per_post(srv, warm)
            per_round: list[dict[str, float]] = []
            names = list(servers)
            for r in range(rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                per_round.append({name: cpu_per_post(servers[name], rounds_requests[r]) for name in order})
                print(f"round {r + 1}: " + ", ".join(f"{n} {ms:.3f}" for n, ms in per_round[-1].items()), flush=True)
        finally:
            for srv in servers.values():
                if isinstance(srv, TrivialProcess):
                    srv.stop()
                else:
                    srv.terminate(15)
    return {"rounds": per_round, "body_bytes": statistics.median(len(b) for b in bodies)}


def summarize(res: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each server's ms per POST pooled over the rounds (all its CPU over all its POSTs: the
    interleaved rounds gave every server the same machine, and pooling shrinks the 10 ms tick's
    share) and measured / limit from those pooled figures."""
    pooled = {name: statistics.fmean(r[name] for r in res["rounds"]) for name in res["rounds"][0]}
    return {name: {"ms": ms, "ratio": ms / pooled["trivial bare"]} for name, ms in pooled.items()}


def write_report(res: dict[str, Any], args: argparse.Namespace, load: tuple[float, float, float]) -> None:
    s = summarize(res)
    labels = {
        "collector httptools": "`vramwatch serve` (default: `--http httptools`)",
        "collector h11": "`vramwatch serve --http h11`",
        "trivial httptools": "trivial app behind the guard, httptools",
        "trivial h11": "trivial app behind the guard, h11",
        "trivial bare": "**limit**: trivial app, bare uvicorn + httptools",
    }
    rows = [(labels[n], f"{s[n]['ms']:.3f}", f"{s[n]['ratio']:.2f}") for n in labels]
    saved = s["collector h11"]["ms"] - s["collector httptools"]["ms"]
    ht, h11 = s["collector httptools"], s["collector h11"]
    body = table(["server", "CPU ms per POST (all rounds)", "measured / limit"], rows)
    body += (
        f"\n\n**collector, httptools: measured / limit = {ht['ms']:.3f} / {s['trivial bare']['ms']:.3f} ms = "
        f"{ht['ratio']:.2f}; h11: {h11['ms']:.3f} / {s['trivial bare']['ms']:.3f} ms = {h11['ratio']:.2f}.** "
        f"The collector on httptools uses {ht['ms'] / h11['ms']:.2f} of its CPU on h11 per small POST: "
        f"{saved:.3f} ms saved per POST, at 4,096 ranks posting once a second {4096 * saved / 1000:.2f} of a core. "
        f"The guard's own cost (trivial app behind it, httptools, against bare): "
        f"{s['trivial httptools']['ratio']:.2f}.\n\n"
        f"Each POST: the hook's request with a {SAMPLES_PER_POST}-sample gzip NDJSON body (median "
        f"{res['body_bytes']:.0f} bytes), one keep-alive connection per server, {args.posts:,} POSTs per server per "
        f"round, {args.rounds} rounds interleaving the five servers (rotating order). Server CPU from "
        "`/proc/<pid>/stat` (10 ms ticks: about ±6 % of the limit's CPU in one round, hence figures pooled over "
        "the rounds); each round's measured / limit of the collector (httptools / h11): "
        + ", ".join(f"{r['collector httptools'] / r['trivial bare']:.2f} / {r['collector h11'] / r['trivial bare']:.2f}"
                    for r in res["rounds"])
        + f". Load average (1/5/15 min) at the start: {' / '.join(f'{x:.1f}' for x in load)} on {os.cpu_count()} "
        "cores shared with other jobs: read the ratios, not the absolute figures.")
    write_section(SECTION, body, f"{COMMAND} --posts {args.posts} --rounds {args.rounds}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--posts", type=int, default=2000, help="POSTs per server per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds, pooled (default 7)")
    parser.add_argument("--ranks", type=int, default=64, help="ranks the samples come from (default 64)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--serve-trivial", choices=TRIVIAL, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.serve_trivial:
        serve_trivial(args.serve_trivial)
        return
    load = os.getloadavg()
    res = run(args.posts, args.rounds, args.ranks)
    for name, fig in summarize(res).items():
        print(f"{name}: {fig['ms']:.3f} ms/POST, measured/limit {fig['ratio']:.2f} (all rounds)")
    if not args.no_write:
        write_report(res, args, load)


if __name__ == "__main__":
    main()
