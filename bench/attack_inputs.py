"""Attacks on the input surfaces beyond ingest: the front, discovery, ``watch``, snapshots, the
importers. Each class runs against a code tree (``--before DIR``: an older checkout, to show
what the bounds changed; and this one), each attacked process a fresh ``python -m vramwatch``
subprocess of that tree: its peak RSS is its VmHWM (servers) or its rusage (one-shot
commands); ``/healthz`` is polled every 20 ms on its own connection throughout. Hostile
servers: :mod:`bench.hostile`.

Used by ``python -m bench.attack_bench --inputs [--before DIR]``.
"""

from __future__ import annotations

import gzip
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
from hostile import Hostile, drip, flood, json_answer, silent

from bench.attack_bench import HealthPoller, peak_rss_mb

MiB = 2**20


class Proc:
    """``python -m vramwatch ARGS`` from the code tree ``code`` (its own ``vramwatch`` package
    first on the path), logging to ``log``."""

    def __init__(self, code: Path, args: list[str], log: Path) -> None:
        self.code, self.args, self.log = code, args, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.rss_mb = float("nan")

    def start(self) -> Proc:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
        env["PYTHONPATH"] = str(self.code)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "vramwatch", *self.args], cwd=self.code,
                                         stdout=log, stderr=log, env=env)
        return self

    def wait(self, url: str, timeout: float = 180.0) -> str:
        """``url`` once the server says its start-up is complete (not its ``/healthz``: under some
        of the attacks an unbounded server never answers it)."""
        deadline = time.monotonic() + timeout
        port = int(url.rsplit(":", 1)[1])
        while not ("Application startup complete" in self.log.read_text(errors="replace") and _accepts(port)):
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-2000:]
            if time.monotonic() > deadline:
                raise TimeoutError(self.log.read_text()[-2000:])
            time.sleep(0.1)
        return url

    def stop(self) -> None:
        assert self.proc is not None
        self.rss_mb = peak_rss_mb(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def run(self, timeout: float = 300.0) -> dict[str, Any]:
        """Run to the end: exit code, seconds, peak RSS (its VmHWM, written at exit by a wrapper:
        rusage would count the parent's pages copied before exec), the last line, a traceback."""
        started = time.monotonic()
        self.args = ["-c", _REPORT_PEAK, *self.args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
        env["PYTHONPATH"] = str(self.code)
        with open(self.log, "ab") as log:
            try:
                rc = subprocess.run([sys.executable, *self.args], cwd=self.code, stdout=log, stderr=log, env=env,
                                    timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = -9
        text = self.log.read_text(errors="replace")
        peak = [line for line in text.splitlines() if line.startswith("PEAK-KB ")]
        lines = [line for line in text.strip().splitlines() if line.strip() and not line.startswith("PEAK-KB ")]
        said = [line.replace(f"{self.log.parent}/", "") for line in lines
                if "error:" in line.lower() or line.startswith("skipped")] or lines[-1:]
        return {"rc": rc, "s": time.monotonic() - started, "rss_mb": int(peak[-1].split()[1]) / 1024 if peak
                else float("nan"), "traceback": "Traceback" in text, "last": (said[-1] if said else "")[:160]}


#: ``python -c`` wrapper: run ``vramwatch ARGS`` and print the process's VmHWM when it exits
_REPORT_PEAK = """import atexit, runpy, sys
def _peak():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            print('PEAK-KB', line.split()[1], file=sys.stderr, flush=True)
atexit.register(_peak)
sys.argv = ['vramwatch', *sys.argv[1:]]
runpy.run_module('vramwatch', run_name='__main__')
"""


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return True
    except OSError:
        return False


def _serve(code: Path, tmp: Path, name: str, args: list[str], attack: Callable[[str], dict[str, Any]]
           ) -> dict[str, Any]:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    started = time.monotonic()
    proc = Proc(code, [*args, "--port", str(port), "--log-level", "info"], tmp / f"{name}.log").start()
    try:
        url = proc.wait(f"http://127.0.0.1:{port}")
        startup_s = time.monotonic() - started
        with HealthPoller(url, timeout_s=120) as poller:
            time.sleep(0.3)
            out = attack(url)
            time.sleep(0.3)
        proc.stop()
    finally:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.proc.kill()
    return {**out, "rss_mb": proc.rss_mb, "startup_s": startup_s, "health_p99_ms": poller.summary()["p99_ms"],
            "health_max_ms": poller.summary()["max_ms"]}


def _timed_get(url: str, timeout: float = 120.0) -> dict[str, Any]:
    started = time.monotonic()
    try:
        code: Any = httpx.get(url, timeout=timeout).status_code
    except httpx.HTTPError as exc:
        code = type(exc).__name__
    return {"status": code, "answer_s": time.monotonic() - started}


# ---------------------------------------------------------------- the front

def front_endless_answer(code: Path, tmp: Path, size: int) -> dict[str, Any]:
    with Hostile(flood(limit=size)) as shard:
        out = _serve(code, tmp, "front-flood", ["serve", "--peers", shard.url],
                     lambda url: _timed_get(url + "/api/v1/runs"))
        return {**out, "read_mb": shard.sent / MiB}


def front_dripping_shard(code: Path, tmp: Path, seconds: float) -> dict[str, Any]:
    body = b'[{"run": "slow", "ranks": 1}]'
    body += b" " * max(0, int(seconds / 0.1) - len(body))
    with Hostile(drip(body, every_s=0.1)) as shard:
        return _serve(code, tmp, "front-drip", ["serve", "--peers", shard.url, "--peer-timeout", "2"],
                      lambda url: _timed_get(url + "/api/v1/runs"))


def front_dripping_discovery(code: Path, tmp: Path, seconds: float) -> dict[str, Any]:
    targets = b'{"status": "success", "data": {"activeTargets": []}}'
    with Hostile(drip(targets + b" " * int(seconds / 0.2), every_s=0.2)) as prom, Hostile(json_answer([])) as shard:
        def attack(url: str) -> dict[str, Any]:
            time.sleep(seconds / 2)  # the polls of /healthz meanwhile are the measure
            return _timed_get(url + "/api/v1/runs")

        return _serve(code, tmp, "front-discovery", ["serve", "--peers", shard.url, "--peers-prometheus", prom.url],
                      attack)


def front_many_peers(code: Path, tmp: Path, peers: int) -> dict[str, Any]:
    with Hostile(silent()) as hole:
        listing = tmp / "peers.txt"
        listing.write_text("".join(f"p{i}={hole.url}/p{i}\n" for i in range(peers)))
        return _serve(code, tmp, "front-many", ["serve", "--peers-file", str(listing), "--peer-timeout", "2"],
                      lambda url: _timed_get(url + "/api/v1/runs", timeout=90))


# ---------------------------------------------------------------- watch, snapshots, captures

def watch_endless_answer(code: Path, tmp: Path, size: int) -> dict[str, Any]:
    with Hostile(flood(limit=size)) as prom:
        def attack(url: str) -> dict[str, Any]:
            deadline, last, still = time.monotonic() + 90, -1, 0.0
            while prom.sent < size and time.monotonic() < deadline and still < 2.0:  # until the reading stops
                time.sleep(0.1)
                still = still + 0.1 if prom.sent == last else 0.0
                last = prom.sent
            time.sleep(2)
            return {"read_mb": prom.sent / MiB}

        return _serve(code, tmp, "watch", ["watch", "--prometheus", prom.url, "--interval", "5",
                                           "--db", str(tmp / "watch.db")], attack)


def snapshot_uploads(code: Path, tmp: Path, count: int, size: int) -> dict[str, Any]:
    import http.client
    import urllib.parse

    body = gzip.compress(os.urandom(size), 1)

    def attack(url: str) -> dict[str, Any]:
        def one(_: int) -> int:  # http.client sends the body without copying it
            parts = urllib.parse.urlsplit(url)
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=300)
            try:
                conn.request("POST", "/api/v1/snapshots?run=r&host=h&rank=0&step=1", body=body,
                             headers={"content-type": "application/octet-stream"})
                return conn.getresponse().status
            finally:
                conn.close()

        started = time.monotonic()
        with ThreadPoolExecutor(count) as pool:
            codes = sorted(set(pool.map(one, range(count))))
        return {"codes": codes, "answer_s": time.monotonic() - started}

    return _serve(code, tmp, "uploads", ["serve", "--db", str(tmp / "uploads.db")], attack)


def tiny_uploads(code: Path, tmp: Path, count: int) -> dict[str, Any]:
    body = gzip.compress(b"tiny")

    def attack(url: str) -> dict[str, Any]:
        times = []
        with httpx.Client(base_url=url, timeout=60) as client:
            for i in range(count):
                started = time.perf_counter()
                client.post("/api/v1/snapshots", params={"run": "r", "host": "h", "rank": 0, "step": i}, content=body)
                times.append((time.perf_counter() - started) * 1000)
        first, last = sorted(times[:100]), sorted(times[-100:])
        return {"first_ms": first[50], "last_ms": last[50]}

    return _serve(code, tmp, "tiny", ["serve", "--db", str(tmp / "tiny.db")], attack)


def capture_clicks(code: Path, tmp: Path, clicks: int) -> dict[str, Any]:
    base = {"schema": 1, "run": "r", "host": "h", "rank": 0, "phase": "train", "allocated_bytes": 1 << 30,
            "reserved_bytes": 2 << 30, "peak_allocated_bytes": 1 << 30, "inactive_split_bytes": 0,
            "alloc_retries": 0, "ooms": 0, "nvml_used_bytes": 3 << 30, "total_bytes": 80 << 30}

    def attack(url: str) -> dict[str, Any]:
        handed = 0
        now = time.time() - clicks
        with httpx.Client(base_url=url, timeout=30) as client:
            for step in range(clicks + 1):
                if step:
                    client.post("/api/v1/runs/r/capture", json={"rank": 0, "steps": 1})
                reply = client.post("/api/v1/samples", content=orjson.dumps({**base, "step": step, "ts": now + step}),
                                    headers={"content-type": "application/json"}).json()
                handed += len(reply.get("directives", []))
        return {"directives": handed}

    return _serve(code, tmp, "captures", ["serve", "--db", str(tmp / "captures.db")], attack)


# ---------------------------------------------------------------- files

def _gzip_one_long_line(path: Path, size: int) -> None:
    line = orjson.dumps({"schema": 1, "run": "r", "host": "h", "rank": 0, "step": 0, "ts": time.time(),
                         "phase": "train", "allocated_bytes": 1, "reserved_bytes": 1, "peak_allocated_bytes": 1,
                         "inactive_split_bytes": 0, "alloc_retries": 0, "ooms": 0, "nvml_used_bytes": 1,
                         "total_bytes": 2})
    with gzip.open(path, "wb", 9) as fh:
        fh.write(line + b"\n")
        chunk = b"x" * MiB
        for _ in range(size // MiB):
            fh.write(chunk)
        fh.write(b"\n" + line + b"\n")


def files(code: Path, tmp: Path, size: int) -> list[dict[str, Any]]:
    trace = tmp / "long.jsonl.gz"
    if not trace.exists():
        _gzip_one_long_line(trace, size)
    smi = tmp / "commas.csv"
    if not smi.exists():
        smi.write_bytes(b"timestamp, index, uuid, memory.used [MiB], memory.total [MiB]\n" + b"," * (size // 8) + b"\n")
    events = tmp / "events.out.tfevents.1.h"
    head = struct.pack("<Q", 2**60)
    from vramwatch.importers.tensorboard import masked_crc32c

    events.write_bytes(head + struct.pack("<I", masked_crc32c(head)) + b"\0" * 64)
    wandb = tmp / "wandb.csv"
    wandb.write_text(f"_timestamp,system.gpu.0.memoryAllocatedBytes,note\n1715679075,1000000000,\"{'n' * 200_000}\"\n")
    jobs = [("analyze: a .jsonl.gz of one long line", ["analyze", str(trace)],
             f"a {size / MiB:,.0f} MiB line in {trace.stat().st_size / MiB:.1f} MB of gzip"),
            ("analyze --from nvidia-smi: a line of commas", ["analyze", "--from", "nvidia-smi", str(smi)],
             f"{smi.stat().st_size / MiB:.0f} MB"),
            ("analyze --from tensorboard: a record length of 2^60",
             ["analyze", "--from", "tensorboard", "--device-memory", "80GiB", str(events)], "76 B"),
            ("import --from wandb: a 200 KB CSV field",
             ["import", "--from", "wandb", "--device-memory", "80GiB", str(wandb), "--db", str(tmp / "wandb.db")],
             "200 KB")]
    out = []
    for name, args, size_text in jobs:
        result = Proc(code, args, tmp / f"file-{len(out)}-{code.name}.log").run()
        out.append({"class": name, "input": size_text, **result})
    return out
