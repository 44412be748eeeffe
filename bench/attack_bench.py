"""Attack benchmark: ``/healthz`` p99 and the collector's peak RSS while a hostile
or buggy client throws one of three things at it:

(a) 1,000 idle sockets (connect, send nothing; the header deadline closes them);
(b) the amplification body: ~65 KB of gzip that inflates to 64 MiB of ``{}`` lines;
(c) 300,000 distinct series (rotating run names), in batches of 5,000 samples;
    then ``/metrics``' size and time and the restart's rebuild time;
(d) a restart on 100,000 stored series of finished runs plus one running 4,096-rank run.

Each scenario gets a fresh ``vramwatch serve`` subprocess (peak RSS = its VmHWM). A thread
polls ``/healthz`` every 20 ms throughout on its own connection.

    python -m bench.attack_bench [--series 300000] [--idle 1000]

``--inputs`` runs the attacks on the other input surfaces instead (the front, discovery,
``watch``, snapshots, captures, the importers: :mod:`bench.attack_inputs`), against
``--before DIR`` (an older checkout of vramwatch) and this tree, one table side by side:

    python -m bench.attack_bench --inputs --before /tmp/vramwatch-before [--size-mb 512] [--peers 2000]
"""

from __future__ import annotations

import argparse
import gzip
import resource
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from collector_process import CollectorProcess, percentile

from bench.report import table, write_section

MiB = 2**20
NDJSON = {"content-type": "application/x-ndjson", "content-encoding": "gzip"}
BASE = {
    "schema": 1, "host": "h", "step": 1, "phase": "train", "allocated_bytes": 1 << 30,
    "reserved_bytes": 2 << 30, "peak_allocated_bytes": 1 << 30, "inactive_split_bytes": 0, "alloc_retries": 0,
    "ooms": 0, "nvml_used_bytes": 3 << 30, "total_bytes": 80 << 30,
}


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class HealthPoller:
    """``/healthz`` every ``interval_s`` on one keep-alive connection; latencies in ms (a
    failure or timeout counts as its timeout)."""

    def __init__(self, url: str, interval_s: float = 0.02, timeout_s: float = 10.0) -> None:
        self.url, self.interval_s, self.timeout_s = url, interval_s, timeout_s
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    ok = client.get("/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append((time.perf_counter() - t0) * 1000)
                self.failures += not ok
                self._stop.wait(self.interval_s)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        lat = self.latencies or [float("nan")]
        return {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99), "max_ms": max(lat),
                "polls": len(self.latencies), "failures": self.failures}


def idle_sockets(url_port: int, count: int, hold_s: float) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, count + 256)), hard))
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", url_port), timeout=10)
        s.setblocking(False)
        socks.append(s)
    time.sleep(hold_s)
    closed = 0
    for s in socks:
        try:
            closed += s.recv(1) in (b"", b"H")
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    return {"opened": count, "answered_408_or_closed": closed}


def amplification(url: str, repeats: int) -> dict[str, Any]:
    body = gzip.compress(b"{}\n" * (64 * 1024 * 1024 // 3), compresslevel=9)
    codes, seconds = [], []
    with httpx.Client(base_url=url, timeout=120) as client:
        for _ in range(repeats):
            t0 = time.perf_counter()
            codes.append(client.post("/api/v1/samples", content=body, headers=NDJSON).status_code)
            seconds.append(time.perf_counter() - t0)
    return {"body_bytes": len(body), "codes": sorted(set(codes)), "max_s": max(seconds)}


def many_series(url: str, series: int, batch: int = 5000) -> dict[str, Any]:
    now = time.time()
    codes: dict[int, int] = {}
    with httpx.Client(base_url=url, timeout=120) as client:
        for start in range(0, series, batch):
            lines = b"".join(orjson.dumps({**BASE, "run": f"rot-{i // 64}", "rank": i % 64, "ts": now}) + b"\n"
                             for i in range(start, min(series, start + batch)))
            code = client.post("/api/v1/samples", content=gzip.compress(lines, 1), headers=NDJSON).status_code
            codes[code] = codes.get(code, 0) + 1
        held = client.get("/healthz").json()["series"]
        t0 = time.perf_counter()
        metrics = client.get("/metrics", headers={"accept-encoding": "identity"})
        metrics_s = time.perf_counter() - t0
    return {"codes": codes, "series_held": held, "metrics_mb": len(metrics.content) / 2**20, "metrics_s": metrics_s}


def restart(tmp: str, quiet_series: int, running_series: int) -> dict[str, Any]:
    """Start-up on a database holding ``quiet_series`` series of finished runs (2 h old,
    5 samples each) and ``running_series`` of one running run (60 samples each)."""
    from vramwatch.collector.store import Store

    db = Path(tmp) / "restart.db"
    store = Store(db)
    now = time.time()
    for start in range(0, quiet_series, 20_000):
        store.insert([{**BASE, "run": f"old-{i // 64}", "rank": i % 64, "step": k, "ts": now - 7200 + k}
                      for i in range(start, min(quiet_series, start + 20_000)) for k in range(5)])
    store.insert([{**BASE, "run": "running", "rank": r, "step": k, "ts": now - 60 + k}
                  for r in range(running_series) for k in range(60)])
    store.close()
    t0 = time.perf_counter()
    with CollectorProcess(db) as srv:
        serving_s = time.perf_counter() - t0
        rss = peak_rss_mb(srv.pid)
        runs = httpx.get(srv.url + "/api/v1/runs", timeout=60).json()
    out = {"quiet_series": quiet_series, "running_series": running_series, "serving_s": serving_s,
           "peak_rss_mb": rss, "runs_listed": len(runs)}
    print(out, flush=True)
    return out


def scenario(name: str, fn: Any, tmp: str, *args: Any) -> dict[str, Any]:
    with CollectorProcess(Path(tmp) / f"{name}.db") as srv:
        with HealthPoller(srv.url) as poller:
            time.sleep(0.5)
            extra = fn(srv, *args)
            time.sleep(0.5)
        out = {"scenario": name, **poller.summary(), "peak_rss_mb": peak_rss_mb(srv.pid), **extra}
        srv.terminate(60)
    if name == "series":
        t0 = time.perf_counter()
        with CollectorProcess(Path(tmp) / f"{name}.db") as srv:
            out["restart_s"] = time.perf_counter() - t0
            out["restart_peak_rss_mb"] = peak_rss_mb(srv.pid)
    print(out, flush=True)
    return out


def _cell(r: dict[str, Any], outcome: str) -> str:
    health = "" if "health_max_ms" not in r else f"; /healthz max {r['health_max_ms']:,.0f} ms"
    return f"{r['rss_mb']:,.0f} MB{health}; {outcome}"


def _input_rows(code: Path, tmp: Path, size: int, peers: int) -> list[tuple[str, str]]:
    """(class, "peak RSS; /healthz max; outcome") of every input attack on the tree ``code``."""
    from bench import attack_inputs as a

    def answer(r: dict[str, Any]) -> str:
        return f"/runs {r['status']} in {r['answer_s']:.1f} s"

    rows = []
    r = a.front_endless_answer(code, tmp, size)
    rows.append((f"front: a shard streams {size / MiB:,.0f} MiB of JSON", _cell(r, f"{answer(r)}, "
                                                                             f"read {r['read_mb']:,.0f} MiB")))
    r = a.front_dripping_shard(code, tmp, 20)
    rows.append(("front: a shard drips its answer for 20 s (`--peer-timeout 2`)", _cell(r, answer(r))))
    r = a.front_dripping_discovery(code, tmp, 20)
    rows.append(("front: Prometheus drips its targets (30 s an answer)", _cell(r, f"serving {r['startup_s']:.0f} s "
                                                                               f"after start; {answer(r)}")))
    r = a.front_many_peers(code, tmp, peers)
    rows.append((f"front: {peers:,} peers that never answer", _cell(r, answer(r))))
    r = a.watch_endless_answer(code, tmp, size)
    rows.append((f"watch: Prometheus answers {size / MiB:,.0f} MiB", _cell(r, f"read {r['read_mb']:,.0f} MiB")))
    r = a.snapshot_uploads(code, tmp, 6, 60 * MiB)
    rows.append(("snapshots: 6 uploads of 60 MiB at once", _cell(r, f"{r['codes']} in {r['answer_s']:.1f} s")))
    r = a.tiny_uploads(code, tmp, 1000)
    rows.append(("snapshots: 1,000 tiny uploads", _cell(r, f"median save {r['first_ms']:.1f} ms first 100, "
                                                         f"{r['last_ms']:.1f} ms last 100")))
    r = a.capture_clicks(code, tmp, 30)
    rows.append(("captures: 30 requests for one rank, a step after each", _cell(r, f"{r['directives']} directives "
                                                                                  "handed out")))
    for r in a.files(code, tmp, size):
        said = "a traceback" if r["traceback"] else f"`{r['last']}`"
        rows.append((f"{r['class']} ({r['input']})", _cell(r, f"exit {r['rc']} in {r['s']:.1f} s: {said}")))
    return rows


def inputs_main(args: argparse.Namespace) -> None:
    size = args.size_mb * MiB
    with tempfile.TemporaryDirectory() as tmp:  # one folder per tree: logs and databases apart
        (Path(tmp) / "before").mkdir()
        (Path(tmp) / "after").mkdir()
        before = _input_rows(Path(args.before).resolve(), Path(tmp) / "before", size, args.peers) if args.before else []
        after = _input_rows(Path(__file__).resolve().parents[1], Path(tmp) / "after", size, args.peers)
    rows = [(name, before[i][1] if before else "—", cell) for i, (name, cell) in enumerate(after)]
    body = table(["attack", "before: peak RSS; /healthz max; outcome", "after"], rows)
    body += ("\n\nPeak RSS is the attacked process's (the front, the collector, or the CLI command); `/healthz` "
             "polled every 20 ms on its own connection. Defaults throughout: `--peer-timeout 2`, "
             "`--peer-max-mb 64`, `--peer-concurrency 64`, `--max-answer-mb 64`, `--max-concurrent-uploads 4`, "
             "`--capture-interval 60`, `--max-line-bytes 1MiB`, `--max-record-bytes 64MiB`. *Before* is the tree "
             "given as `--before`, without the bounded readers (docs/reliability.md, 'Input surfaces').")
    command = f"python -m bench.attack_bench --inputs --size-mb {args.size_mb} --peers {args.peers}"
    if args.before:
        command += f" --before {args.before}"
    write_section("Attacks beyond ingest", body, command)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--series", type=int, default=300_000)
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--inputs", action="store_true", help="the attacks on the other input surfaces")
    parser.add_argument("--before", metavar="DIR", help="with --inputs: an older checkout to compare with")
    parser.add_argument("--size-mb", type=int, default=512, help="with --inputs: size of the floods and long lines")
    parser.add_argument("--peers", type=int, default=2000, help="with --inputs: peers that never answer")
    args = parser.parse_args(argv)
    if args.inputs:
        inputs_main(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        a = scenario("idle", lambda srv: idle_sockets(srv.port, args.idle, 12.0), tmp)
        b = scenario("amplification", lambda srv: amplification(srv.url, 3), tmp)
        c = scenario("series", lambda srv: many_series(srv.url, args.series), tmp)
        d = restart(tmp, 100_000, 4096)
    rows = [
        (f"(a) {a['opened']:,} idle sockets held 12 s", f"{a['p99_ms']:.1f}", f"{a['max_ms']:.0f}", a["failures"],
         f"{a['peak_rss_mb']:.0f}", f"{a['answered_408_or_closed']:,} closed by the header deadline"),
        (f"(b) amplification body ({b['body_bytes'] / 1024:.0f} KB gzip → 64 MiB of `{{}}`) x3", f"{b['p99_ms']:.1f}",
         f"{b['max_ms']:.0f}", b["failures"], f"{b['peak_rss_mb']:.0f}",
         f"answered {b['codes']} in ≤ {b['max_s']:.2f} s"),
        (f"(c) {args.series:,} distinct series (rotating run names)", f"{c['p99_ms']:.1f}", f"{c['max_ms']:.0f}",
         c["failures"], f"{c['peak_rss_mb']:.0f}",
         f"held {c['series_held']:,} (cap); batches {c['codes']}; /metrics {c['metrics_mb']:.0f} MiB in "
         f"{c['metrics_s']:.1f} s; restart {c['restart_s']:.1f} s at {c['restart_peak_rss_mb']:.0f} MB"),
        (f"(d) restart on {d['quiet_series']:,} stored series of finished runs + {d['running_series']:,} "
         "running", "—", "—", "—", f"{d['peak_rss_mb']:.0f}",
         f"serving again {d['serving_s']:.1f} s after start; {d['runs_listed']:,} runs listed"),
    ]
    body = table(["attack", "/healthz p99 ms", "max ms", "failed polls", "collector peak RSS MB", "outcome"], rows)
    body += ("\n\nDefaults throughout (`--header-timeout 10`, `--max-connections 8192`, `--max-series 20000`, "
             "50,000 samples per request). `/healthz` polled every 20 ms on its own connection. Without the "
             "bounds: (a) `/healthz` timed out and the log grew by MiB/s of accept() tracebacks; "
             "(b) 4.5 GB RSS, 16 s, `/healthz` frozen; (c) 5 GB RSS, `/metrics` 560 MiB in 13.8 s, restart 57 s.")
    write_section("Attacks", body, f"python -m bench.attack_bench --series {args.series} --idle {args.idle}")


if __name__ == "__main__":
    main()
