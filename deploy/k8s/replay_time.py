"""How long a collector takes to start on a database, to size its Kubernetes startupProbe.

    python deploy/k8s/replay_time.py --db /path/to/copy-of/vramwatch.db  # your own database (a copy)
    python deploy/k8s/replay_time.py --samples 2000000                     # a synthetic one

``vramwatch serve`` replays the stored samples of every live run (one whose last sample is
newer than ``--finished-after``) through the trend engines before it listens, so start-up
time grows with the samples stored. This starts ``vramwatch serve`` on the database, times it
until ``GET /healthz`` answers 200 and prints the samples replayed, the seconds, the rate,
and the ``failureThreshold`` a startupProbe with ``periodSeconds: 10`` needs for that
database with the margin given (``--margin``, default 3x: a busy node is slower than this one).

The synthetic database holds one recent run (``--ranks`` ranks, a checkpoint every 1000
steps) written through the collector's own store; it is deleted afterwards. Cost: filling
~35k samples/s, replay as measured; one collector process.
Exit 0 with the figures; 2 when the database cannot be opened or the collector does not start.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

PERIOD_S = 10  # the shipped startupProbe's periodSeconds


def fill(db: str, samples: int, ranks: int) -> int:
    """One run of ``ranks`` ranks ending now, ~``samples`` samples in all; returns how many were stored."""
    from vramwatch.collector.store import Store
    from vramwatch.probe.simulated import simulate_trace

    steps = max(1, samples // ranks)
    start_ts = time.time() - steps - 60
    store = Store(db)
    try:
        stored = 0
        for rank in range(ranks):
            trace = simulate_trace("checkpoint", steps=steps, run="replay-time", host=f"node-{rank // 8:03d}",
                                   rank=rank, start_ts=start_ts, seed=rank, ckpt_every=1000)
            stored += store.insert_stream(trace, batch_size=20_000)[0]
    finally:
        store.close()
    return stored


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_start(db: str, finished_after_s: float, timeout_s: float) -> float:
    """Seconds from starting ``vramwatch serve`` on ``db`` to its first 200 on /healthz."""
    import httpx

    port = _free_port()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vramwatch", "serve", "--db", db, "--port", str(port), "--log-level", "warning",
         "--finished-after", str(finished_after_s)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        while time.perf_counter() - started < timeout_s and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    return time.perf_counter() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        err = proc.stderr.read().decode()[-1000:] if proc.poll() is not None else "timed out"
        raise RuntimeError(f"the collector did not answer /healthz: {err.strip()}")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def stored_samples(db: str) -> int:
    import sqlite3

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return int(conn.execute("SELECT count(*) FROM samples").fetchone()[0])


def probe_threshold(seconds: float, margin: float) -> int:
    """failureThreshold for periodSeconds=10 that covers ``seconds`` of start-up ``margin`` times over."""
    return max(3, math.ceil(seconds * margin / PERIOD_S))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--db", help="an existing database (use a copy: the collector may write to it)")
    source.add_argument("--samples", type=int, help="build a synthetic database with about this many samples")
    parser.add_argument("--ranks", type=int, default=64, help="ranks of the synthetic run (default 64)")
    parser.add_argument("--finished-after", type=float, default=3600, help="as given to serve (default 3600)")
    parser.add_argument("--margin", type=float, default=3.0, help="safety factor for the probe (default 3)")
    parser.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db
        if args.samples is not None:
            db = os.path.join(tmp, "replay.db")
            t0 = time.perf_counter()
            written = fill(db, args.samples, args.ranks)
            print(f"filled {written} samples in {time.perf_counter() - t0:.0f} s")
        try:
            count = stored_samples(db)
            seconds = time_start(db, args.finished_after, args.timeout)
        except Exception as exc:  # whatever stopped it: one line, exit 2
            print(f"error: {exc}".splitlines()[0], file=sys.stderr)
            return 2
    print(f"{count} samples stored; /healthz answered after {seconds:.1f} s ({count / seconds:,.0f} samples/s, "
          f"process start included)")
    print(f"startupProbe: periodSeconds: {PERIOD_S}, failureThreshold: {probe_threshold(seconds, args.margin)} "
          f"(covers {args.margin:g}x this start-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
