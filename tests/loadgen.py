"""Simulated ranks through the real hook and delivery against a real collector: the load
generator of ``python -m bench.load`` (what runs and what is measured: that module's
docstring), shared with tests/collector/test_load.py."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from collector_process import CollectorProcess, FaultRelay, machine_busy_s, percentile, stored_samples

RANKS_PER_THREAD = 1  # default: each rank's sender owns its thread, as in a real job


def _rank_group(ranks: list[int], world: int, url: str, run: str, rate: float, duration: float,
                start_at: float, spool_dir: str, token: str | None, out_path: str,
                ranks_per_thread: int = RANKS_PER_THREAD) -> None:
    """One worker process: a monitor per rank, one driver thread stepping all of them, and one
    delivery thread per ``ranks_per_thread`` monitors (a :class:`SharedWorker` running each
    monitor's own processor, exporter and spool; 1: a thread per rank, as in a real job)."""
    import vramwatch
    from vramwatch.delivery import SharedWorker

    # The generator runs at lower priority: on a cluster the ranks do not share cores with
    # the collector; here they must, and should not starve it (or the latency canary).
    with contextlib.suppress(OSError):
        os.nice(10)

    monitors = []
    latencies: list[float] = []
    failures = [0]
    shared: list[Any] = []
    for i, rank in enumerate(ranks):
        # ranks of a real job start within about a second of each other (torchrun, SLURM), so
        # their senders' 1 s flush timers are spread over that second, not in lockstep
        time.sleep(1.0 / len(ranks))
        if ranks_per_thread > 1 and i % ranks_per_thread == 0:
            shared.append(SharedWorker())
        vw = vramwatch.init(url=url, run=run, rank=rank, world_size=world, host=f"node-{rank // 8:03d}",
                            local_rank=rank % 8, probe="simulated", spool_dir=spool_dir, token=token,
                            flush_interval_s=1.0, backoff_max_s=5.0,
                            delivery_worker=shared[-1] if ranks_per_thread > 1 else None)
        sender = vw.sender
        if sender is not None:  # time each export (one POST, more on a split) as the hook sees it
            export = sender.transport.export

            def timed(lines: Any, timeout: float | None = None, _export: Any = export) -> Any:
                t0 = time.perf_counter()
                result = _export(lines, timeout)
                latencies.append(time.perf_counter() - t0)
                failures[0] += result.failures
                return result

            sender.transport.export = timed  # type: ignore[method-assign]
        monitors.append(vw)
    step_costs: list[float] = []
    lateness: list[float] = []
    cpu0 = time.process_time()
    period = 1.0 / rate
    while time.time() < start_at:
        time.sleep(0.005)
    t0 = time.monotonic()
    ticks = round(duration * rate)
    for step in range(ticks):
        target = t0 + step * period
        delay = target - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            lateness.append(-delay)
        for vw in monitors:
            c0 = time.perf_counter()
            vw.step(step)
            step_costs.append(time.perf_counter() - c0)
    closed_at = time.monotonic()
    closers = [threading.Thread(target=vw.close, args=(60.0,)) for vw in monitors]
    for t in closers:
        t.start()
    for t in closers:
        t.join()
    stats = [vw.stats() for vw in monitors]
    keys = ("samples", "delivered", "accepted", "duplicates", "rejected", "spooled", "replayed",
            "send_failures", "dropped_overflow", "dropped_spool_full", "invalid", "worker_errors", "queued")
    totals = {k: sum(int(s.get(k) or 0) for s in stats) for k in keys}
    totals["spool_pending_bytes"] = sum(int(s.get("spool_pending_bytes") or 0) for s in stats)
    result = {
        "cpu_s": time.process_time() - cpu0,
        "ranks": len(ranks), "totals": totals, "latencies": latencies, "post_failures": failures[0],
        "step_cost_p50": percentile(step_costs, 50), "step_cost_p99": percentile(step_costs, 99),
        "late_ticks": len(lateness), "max_lateness_s": max(lateness, default=0.0),
        "close_s": time.monotonic() - closed_at,
        "last_errors": sorted({str(s.get("last_delivery_error")) for s in stats if s.get("last_delivery_error")})[:5],
    }
    Path(out_path).write_text(json.dumps(result))


def _canary(url: str, rate: float, duration: float, start_at: float, token: str | None, out_path: str) -> None:
    """One rank-sized POST (10 samples, gzip, keep-alive, the hook's own transport) every
    ``1 / rate`` s from an otherwise idle process: the ingest latency a rank sees when its
    own process is not starved of CPU (on a real cluster each rank has its own cores)."""
    from vramwatch.delivery import HttpExporter
    from vramwatch.probe.simulated import simulate_trace
    from vramwatch.wire import encode_lines

    transport = HttpExporter(url, token=token)
    latencies: list[float] = []
    failures = 0
    while time.time() < start_at:
        time.sleep(0.005)
    t0 = time.monotonic()
    cpu0 = time.process_time()
    for i in range(round(duration * rate)):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        now = time.time()
        batch = [{**sample, "ts": now} for sample in
                 simulate_trace("healthy", steps=10, run="canary", rank=0, start_ts=now)]
        for j, sample in enumerate(batch):
            sample["step"] = i * 10 + j
        body = encode_lines(batch)
        c0 = time.perf_counter()
        result = transport.export(body.splitlines(keepends=True))
        failures += result.failures
        latencies.append(time.perf_counter() - c0)
    transport.shutdown()
    Path(out_path).write_text(json.dumps({"latencies": latencies, "failures": failures, "rate": rate,
                                          "cpu_s": time.process_time() - cpu0}))


def _windows(canary: dict[str, Any], duration: float, parts: int = 6) -> list[float]:
    """The canary's p99 in ``parts`` equal windows of the run (ms): a start-up burst or a
    neighbour's spike shows as one window, a collector that cannot keep up as all of them."""
    lat = canary["latencies"]
    size = max(1, len(lat) // parts)
    return [round(1000 * percentile(lat[i:i + size], 99), 1) for i in range(0, size * parts, size)]


def _server_quantile(metrics_text: str, q: float) -> float:
    """Upper bucket bound of the ``q`` quantile of the collector's own ingest histogram."""
    buckets = []
    for line in metrics_text.splitlines():
        if line.startswith("vramwatch_ingest_request_duration_seconds_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if bound == "+Inf" else float(bound), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    total = buckets[-1][1]
    return next(bound for bound, n in buckets if n >= q * total)


def run_load(*, ranks: int, rate: float = 10.0, duration: float = 60.0, procs: int = 8,
             workdir: str | os.PathLike[str] | None = None, token: str | None = None,
             collector_args: tuple[str, ...] = (), measure_restart: bool = False,
             ranks_per_thread: int = 1) -> dict[str, Any]:
    """One load run against a fresh collector; returns the figures (see module docstring)."""
    owned = None
    if workdir is None:
        owned = tempfile.TemporaryDirectory(prefix="vw-load-")
        workdir = owned.name
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    db = str(work / "load.db")
    run = f"load-{ranks}"
    procs = max(1, min(procs, ranks))
    groups = [list(range(i, ranks, procs)) for i in range(procs)]
    ctx = mp.get_context("spawn")
    try:
        with CollectorProcess(db, token=token, args=collector_args) as collector, \
                CollectorProcess(str(work / "control.db"), token=token, args=collector_args) as control:
            rss_start = collector.rss_bytes()
            start_at = time.time() + 3.0 + 0.3 * procs  # every worker has built its monitors by then
            # the same canary against an idle collector on the same machine at the same time: the
            # latency this machine gives any collector now (other jobs), the limit for the one under load
            workers = [ctx.Process(target=_canary, args=(url, 10.0, duration, start_at, token,
                                                          str(work / f"{name}.json")))
                       for url, name in ((collector.url, "canary"), (control.url, "control"))]
            for w in workers:
                w.start()
            for i, group in enumerate(groups):
                p = ctx.Process(target=_rank_group, args=(
                    group, ranks, collector.url, run, rate, duration, start_at, str(work / "spool"), token,
                    str(work / f"result-{i}.json"), ranks_per_thread))
                p.start()
                workers.append(p)
            rss: list[int] = []
            stop = threading.Event()

            def sample_rss() -> None:
                while not stop.wait(1.0):
                    rss.append(collector.rss_bytes())

            sampler = threading.Thread(target=sample_rss, daemon=True)
            sampler.start()
            while time.time() < start_at:  # CPU is counted from the first step on
                time.sleep(0.005)
            load_start = os.getloadavg()
            busy_start = machine_busy_s()
            cpu_start = collector.cpu_seconds()
            for p in workers:
                p.join(duration + 300)
                if p.is_alive():
                    p.kill()
            stop.set()
            sampler.join()
            wall = time.time() - start_at
            load_end = os.getloadavg()
            cpu = collector.cpu_seconds() - cpu_start
            busy = machine_busy_s() - busy_start
            rss_end = collector.rss_bytes()
            with urllib.request.urlopen(collector.url + "/metrics", timeout=30) as response:
                metrics_text = response.read().decode()
            exit_code = collector.terminate()
        results = [json.loads((work / f"result-{i}.json").read_text()) for i in range(len(groups))]
        canary = json.loads((work / "canary.json").read_text())
        control_canary = json.loads((work / "control.json").read_text())
        restart_s = None
        if measure_restart:  # a restart replays every stored sample through the engines
            again = CollectorProcess(db, token=token, args=collector_args)
            t0 = time.monotonic()
            again.start(timeout=600)
            restart_s = time.monotonic() - t0
            again.terminate()
        produced = sum(r["totals"]["samples"] for r in results)
        stored = stored_samples(db, run)
        latencies = [x for r in results for x in r["latencies"]]
        totals = {k: sum(r["totals"][k] for r in results) for k in results[0]["totals"]}
        return {
            "ranks": ranks, "rate": rate, "duration": duration, "procs": procs, "ranks_per_thread": ranks_per_thread,
            "produced": produced, "stored": stored, "lost": produced - stored,
            "duplicates": totals["duplicates"], "posts": len(latencies),
            "post_failures": sum(r["post_failures"] for r in results),
            "p50_ms": 1000 * percentile(canary["latencies"], 50), "p99_ms": 1000 * percentile(canary["latencies"], 99),
            "max_ms": 1000 * max(canary["latencies"], default=float("nan")), "canary_failures": canary["failures"],
            "p99_windows_ms": _windows(canary, duration),
            "control_p50_ms": 1000 * percentile(control_canary["latencies"], 50),
            "control_p99_ms": 1000 * percentile(control_canary["latencies"], 99),
            "control_p99_windows_ms": _windows(control_canary, duration),
            "server_p99_ms": 1000 * _server_quantile(metrics_text, 0.99),
            "gen_p50_ms": 1000 * percentile(latencies, 50), "gen_p99_ms": 1000 * percentile(latencies, 99),
            "samples_per_s": produced / duration,
            "rss_start_mb": rss_start / 2**20, "rss_max_mb": max(rss, default=rss_end) / 2**20,
            "rss_end_mb": rss_end / 2**20,
            "rss_first_half_max_mb": max(rss[: len(rss) // 2], default=0) / 2**20,
            "collector_cpu_pct": 100 * cpu / max(wall, 1e-9),
            "step_cost_p50_us": 1e6 * statistics.median(r["step_cost_p50"] for r in results),
            "step_cost_p99_us": 1e6 * max(r["step_cost_p99"] for r in results),
            "late_ticks": sum(r["late_ticks"] for r in results),
            "max_lateness_ms": 1000 * max(r["max_lateness_s"] for r in results),
            "close_s": max(r["close_s"] for r in results),
            "totals": totals, "collector_exit": exit_code, "restart_s": restart_s,
            "generator_cores": sum(r["cpu_s"] for r in results) / max(wall, 1e-9),
            # CPU the machine spent on anything but this benchmark (other jobs on a shared box)
            "other_cores": max(0.0, busy - cpu - canary["cpu_s"] - control_canary["cpu_s"]
                               - sum(r["cpu_s"] for r in results)) / max(wall, 1e-9),
            "last_errors": sorted({e for r in results for e in r["last_errors"]})[:5],
            "loadavg_start": load_start, "loadavg_end": load_end,
        }
    finally:
        if owned is not None:
            owned.cleanup()


def _dir_bytes(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for entry in path.iterdir():
            with contextlib.suppress(OSError):
                total += entry.stat().st_size
    return total


def run_partition(*, ranks: int = 64, rate: float = 10.0, partition_s: float = 120.0, before_s: float = 10.0,
                  after_s: float = 45.0, procs: int = 4,
                  workdir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Ranks keep training while the collector is unreachable (packets black-holed by a
    relay, requests hang until the hook's timeout) for ``partition_s``; then the network
    heals. Measures the spool, how soon delivery resumes and the backlog drains, and loss."""
    owned = None
    if workdir is None:
        owned = tempfile.TemporaryDirectory(prefix="vw-partition-")
        workdir = owned.name
    work = Path(workdir)
    db = str(work / "partition.db")
    run = f"partition-{ranks}"
    spool = work / "spool"
    duration = before_s + partition_s + after_s
    groups = [list(range(i, ranks, procs)) for i in range(procs)]
    ctx = mp.get_context("spawn")
    try:
        with CollectorProcess(db) as collector:
            relay = FaultRelay(collector.port)
            start_at = time.time() + 3.0 + 0.3 * procs
            workers = []
            for i, group in enumerate(groups):
                p = ctx.Process(target=_rank_group, args=(group, ranks, relay.url, run, rate, duration, start_at,
                                                          str(spool), None, str(work / f"result-{i}.json")))
                p.start()
                workers.append(p)
            time.sleep(max(0.0, start_at + before_s - time.time()))
            relay.set("blackhole")
            cut_at = time.time()
            spool_peak = 0
            while time.time() < cut_at + partition_s:
                spool_peak = max(spool_peak, _dir_bytes(spool))
                time.sleep(1.0)
            relay.set("forward")
            healed_at = time.time()
            resumed_s = drained_s = None
            last = stored_samples(db, run)
            while time.time() < start_at + duration:
                count = stored_samples(db, run)
                elapsed = time.time() - start_at
                if resumed_s is None and count > last:
                    resumed_s = time.time() - healed_at
                # caught up: everything recorded up to 1.5 s ago (one flush interval + margin) is stored
                if drained_s is None and count >= ranks * rate * (elapsed - 1.5):
                    drained_s = time.time() - healed_at
                spool_peak = max(spool_peak, _dir_bytes(spool))
                time.sleep(0.5)
            for p in workers:
                p.join(300)
                if p.is_alive():
                    p.kill()
            relay.close()
        results = [json.loads((work / f"result-{i}.json").read_text()) for i in range(len(groups))]
        produced = sum(r["totals"]["samples"] for r in results)
        stored = stored_samples(db, run)
        totals = {k: sum(r["totals"][k] for r in results) for k in results[0]["totals"]}
        return {
            "ranks": ranks, "rate": rate, "partition_s": partition_s, "produced": produced, "stored": stored,
            "lost": produced - stored, "spooled": totals["spooled"], "replayed": totals["replayed"],
            "dropped": totals["dropped_overflow"] + totals["dropped_spool_full"],
            "spool_peak_mb": spool_peak / 2**20, "resumed_s": resumed_s, "drained_s": drained_s,
            "send_failures": totals["send_failures"],
            "step_cost_p99_us": 1e6 * max(r["step_cost_p99"] for r in results),
            "max_lateness_ms": 1000 * max(r["max_lateness_s"] for r in results),
        }
    finally:
        if owned is not None:
            owned.cleanup()


# ------------------------------------------------------------------ report
