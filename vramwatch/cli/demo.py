"""``vramwatch demo``: a collector and a simulated multi-rank run feeding it live.

The collector (real uvicorn + SQLite, :class:`~vramwatch.collector.server.BackgroundServer`)
starts on a free local port; then one :class:`~vramwatch.hook.Monitor` per rank, each with
its own :class:`~vramwatch.probe.simulated.SimulatedProbe` (scenario ``demo``: 8 x H200,
warm-up, plateau near 127-130 GB, checkpoint spikes, rank 0 ~2 GB higher, rank 5 leaking
from step 600), is driven step by step. Samples travel the real path — probe → hook →
BatchSender → gzip NDJSON POST → collector — exactly as from a training job; nothing is
written into the database directly. Runs until Ctrl-C or ``duration`` seconds.

When the leaking rank runs out of memory (after ~7 minutes at 10 steps/s) the job does
what a real one does: it dies and is resumed from its last checkpoint, every rank with a
new incarnation (the dashboard shows the restart); in this story the leak is fixed then.
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

#: every simulated rank is a Monitor (a delivery thread) in this one process: a typo of
#: --ranks 100000000 would exhaust memory before the first sample
MAX_RANKS = 1024


def check_arguments(ranks: int, steps_per_s: float, duration: float | None) -> None:
    """ValueError naming the first argument :func:`run_demo` cannot run with."""
    if not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"ranks: must be 1..{MAX_RANKS} (one thread each in this process), got {ranks}")
    if steps_per_s <= 0:
        raise ValueError(f"steps_per_s: must be positive, got {steps_per_s}")
    if duration is not None and duration <= 0:
        raise ValueError(f"duration: must be positive, got {duration}")


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

    Returns a summary: ``url``, ``db``, ``run``, ``steps`` (per rank, counting steps
    redone after a restart), ``samples`` (recorded by the hooks), ``delivered`` (accepted
    by the collector) and ``restarts``.
    """
    check_arguments(ranks, steps_per_s, duration)
    from vramwatch.collector.server import BackgroundServer  # the [server] extra

    say = print_fn or (lambda line: print(line, flush=True))
    workdir = Path(tempfile.mkdtemp(prefix="vramwatch-demo-"))
    db_path = str(db) if db else str(workdir / "demo.db")
    run = run or f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    server = BackgroundServer(db_path, host=host, port=port).start()
    job = _Job(server.url, run, ranks, scenario, dict(sim_params or {}), workdir / "spool")
    try:
        say(f"vramwatch demo: collector on {server.url}  (database {db_path})")
        say(f"dashboard: {server.url}/   run {run!r}, {ranks} simulated ranks at {steps_per_s:g} steps/s; "
            "Ctrl-C to stop")
        job.start(0)
        if open_browser:
            webbrowser.open(f"{server.url}/")
        _drive(job, steps_per_s, duration, say)
    except KeyboardInterrupt:
        pass
    finally:
        job.stop(timeout=10.0)
        server.stop()
        shutil.rmtree(workdir / "spool", ignore_errors=True)
    say(f"vramwatch demo: stopped after {job.steps} steps; {job.delivered} of {job.samples} samples delivered"
        + (f"; {job.restarts} restart(s) after OOM" if job.restarts else ""))
    return {"url": server.url, "db": db_path, "run": run, "steps": job.steps, "samples": job.samples,
            "delivered": job.delivered, "restarts": job.restarts}


class _OomWatch:
    """Wraps a probe to see its ``ooms`` counter (a real process would die at its first OOM)."""

    def __init__(self, probe: SimulatedProbe) -> None:
        self.inner = probe
        self.name = probe.name
        self.ooms = 0

    def device_info(self) -> dict[str, Any]:
        return self.inner.device_info()

    def read(self, step: int, phase: str = "train") -> dict[str, Any]:
        reading = self.inner.read(step, phase)
        self.ooms = reading.get("ooms", 0)
        return reading

    def phases_at(self, step: int) -> list[str]:
        return self.inner.phases_at(step)

    def close(self) -> None:
        self.inner.close()


class _Job:
    """The simulated ranks: one Monitor + probe each; restarted together after an OOM."""

    def __init__(self, url: str, run: str, ranks: int, scenario: str, sim_params: dict[str, Any],
                 spool_dir: Path) -> None:
        self.url, self.run, self.ranks, self.scenario = url, run, ranks, scenario
        self.sim_params = sim_params
        self.spool_dir = spool_dir
        self.monitors: list[Monitor] = []
        self.watches: list[_OomWatch] = []
        self.step = self.steps = self.samples = self.delivered = self.restarts = 0

    def start(self, step: int) -> None:
        self.step = step
        for rank in range(self.ranks):
            probe = _OomWatch(SimulatedProbe(self.scenario, rank=rank, local_rank=rank % 8, seed=self.restarts,
                                             **self.sim_params))
            self.watches.append(probe)
            self.monitors.append(Monitor(self.url, run=self.run, host=f"demo-node-{rank // 8}", rank=rank,
                                         local_rank=rank % 8, world_size=self.ranks, probe=probe,
                                         flush_interval_s=0.5, spool_dir=self.spool_dir))

    def stop(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for monitor in self.monitors:
            monitor.close(max(0.2, deadline - time.monotonic()))
            stats = monitor.stats()
            self.samples += stats["samples"]
            self.delivered += stats.get("delivered", 0)
        self.monitors, self.watches = [], []

    def advance(self) -> str | None:
        """One step on every rank; returns a message when the job had to restart."""
        step = self.step
        for monitor in self.monitors:
            monitor.step(step)
            for phase in monitor.probe.phases_at(step):  # type: ignore[union-attr]
                with monitor.phase(phase):
                    pass
        self.step += 1
        self.steps += 1
        crashed = [rank for rank, watch in enumerate(self.watches) if watch.ooms]
        if not crashed:
            return None
        # like a real job: the OOM kills it, the launcher resumes every rank (new incarnations)
        # from the last checkpoint; the simulated fix is that the leak is gone after the restart
        every = int(self.watches[0].inner.params.get("ckpt_every") or 0)
        resume = (step // every) * every if every else 0
        self.stop(timeout=5.0)
        self.restarts += 1
        self.sim_params = {**self.sim_params, "leak_rank": None, "leak_onset": None}
        self.start(resume)
        return (f"  rank {crashed[0]} ran out of memory at step {step}: the job restarts from step {resume} "
                "(new incarnations; the leak is fixed in this story)")


def _drive(job: _Job, steps_per_s: float, duration: float | None, say: Callable[[str], None]) -> None:
    """Step every rank in lockstep at ``steps_per_s`` (absolute pacing: no drift)."""
    interval = 1.0 / steps_per_s
    started = next_tick = time.monotonic()
    next_report = started + 10.0
    while duration is None or time.monotonic() - started < duration:
        message = job.advance()
        if message:
            say(message)
        now = time.monotonic()
        if now >= next_report:
            delivered = job.delivered + sum(m.stats().get("delivered", 0) for m in job.monitors)
            say(f"  step {job.step}: {delivered} samples delivered")
            next_report = now + 10.0
        next_tick += interval
        pause = next_tick - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        else:
            next_tick = time.monotonic()  # fell behind (slow machine): do not burst to catch up


def main(args: argparse.Namespace | Mapping[str, Any] | None = None) -> int:
    """Entry point for the CLI: an argparse namespace or a dict of :func:`run_demo` keywords."""
    options = dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args or {})
    known = {"ranks", "duration", "port", "host", "db", "steps_per_s", "open_browser", "run", "scenario"}
    run_demo(**{k: v for k, v in options.items() if k in known and v is not None})
    return 0


__all__ = ["main", "run_demo"]
