"""``vramwatch demo``: a collector and a simulated multi-rank run feeding it live.

The collector (real uvicorn + SQLite, :class:`~vramwatch.collector.server.BackgroundServer`)
starts on a free local port; then one :class:`~vramwatch.hook.Monitor` per rank, each with
its own :class:`~vramwatch.probe.simulated.SimulatedProbe` (scenario ``demo``: 8 x H200,
warm-up, plateau near 127-130 GB, checkpoint spikes, rank 0 ~2 GB higher, rank 5 leaking
from step 600), is driven step by step. Samples travel the real path — probe → hook →
BatchSender → gzip NDJSON POST → collector — exactly as from a training job; nothing is
written into the database directly. Runs until Ctrl-C or ``duration`` seconds.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import webbrowser
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from vramwatch.hook import Monitor
from vramwatch.probe.simulated import SimulatedProbe


def run_demo(
    *,
    ranks: int = 8,
    duration: float | None = None,
    port: int = 0,
    host: str = "127.0.0.1",
    db: str | None = None,
    steps_per_s: float = 10.0,
    open_browser: bool = False,
    run: str | None = None,
    scenario: str = "demo",
    sim_params: Mapping[str, Any] | None = None,
    print_fn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Serve a dashboard and feed it a simulated ``ranks``-rank run until Ctrl-C / ``duration``.

    Returns a summary: ``url``, ``db``, ``run``, ``steps`` (per rank), ``samples``
    (recorded by the hooks) and ``delivered`` (accepted by the collector).
    """
    if ranks < 1:
        raise ValueError(f"ranks: must be at least 1, got {ranks}")
    if steps_per_s <= 0:
        raise ValueError(f"steps_per_s: must be positive, got {steps_per_s}")
    if duration is not None and duration <= 0:
        raise ValueError(f"duration: must be positive, got {duration}")
    from vramwatch.collector.server import BackgroundServer  # the [server] extra

    say = print_fn or (lambda line: print(line, flush=True))
    workdir = Path(tempfile.mkdtemp(prefix="vramwatch-demo-"))
    db_path = str(db) if db else str(workdir / "demo.db")
    run = run or f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    server = BackgroundServer(db_path, host=host, port=port).start()
    monitors: list[Monitor] = []
    steps = 0
    try:
        say(f"vramwatch demo: collector on {server.url}  (database {db_path})")
        say(f"dashboard: {server.url}/   run {run!r}, {ranks} simulated ranks at {steps_per_s:g} steps/s; "
            "Ctrl-C to stop")
        for rank in range(ranks):
            probe = SimulatedProbe(scenario, rank=rank, local_rank=rank % 8, **dict(sim_params or {}))
            monitors.append(Monitor(server.url, run=run, host=f"demo-node-{rank // 8}", rank=rank,
                                    local_rank=rank % 8, world_size=ranks, probe=probe, flush_interval_s=0.5,
                                    spool_dir=workdir / "spool"))
        if open_browser:
            webbrowser.open(f"{server.url}/")
        steps = _drive(monitors, steps_per_s, duration, say)
    except KeyboardInterrupt:
        pass
    finally:
        samples = delivered = 0
        deadline = time.monotonic() + 10.0
        for monitor in monitors:
            monitor.close(max(0.2, deadline - time.monotonic()))
            stats = monitor.stats()
            samples += stats["samples"]
            delivered += stats.get("delivered", 0)
        server.stop()
        shutil.rmtree(workdir / "spool", ignore_errors=True)
    say(f"vramwatch demo: stopped after {steps} steps per rank; {delivered} of {samples} samples delivered")
    return {"url": server.url, "db": db_path, "run": run, "steps": steps, "samples": samples,
            "delivered": delivered}


def _drive(monitors: list[Monitor], steps_per_s: float, duration: float | None,
           say: Callable[[str], None]) -> int:
    """Step every rank in lockstep at ``steps_per_s`` (absolute pacing: no drift)."""
    interval = 1.0 / steps_per_s
    started = next_tick = time.monotonic()
    next_report = started + 10.0
    step = 0
    while duration is None or time.monotonic() - started < duration:
        for monitor in monitors:
            monitor.step(step)
            for phase in monitor.probe.phases_at(step):  # type: ignore[union-attr]
                with monitor.phase(phase):
                    pass
        step += 1
        now = time.monotonic()
        if now >= next_report:
            delivered = sum(m.stats().get("delivered", 0) for m in monitors)
            say(f"  step {step}: {delivered} samples delivered")
            next_report = now + 10.0
        next_tick += interval
        pause = next_tick - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        else:
            next_tick = time.monotonic()  # fell behind (slow machine): do not burst to catch up
    return step


def main(args: argparse.Namespace | Mapping[str, Any] | None = None) -> int:
    """Entry point for the CLI: an argparse namespace or a dict of :func:`run_demo` keywords."""
    options = dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args or {})
    known = {"ranks", "duration", "port", "host", "db", "steps_per_s", "open_browser", "run", "scenario"}
    run_demo(**{k: v for k, v in options.items() if k in known and v is not None})
    return 0


__all__ = ["main", "run_demo"]
