"""``vramwatch demo``: a collector and a simulated multi-rank run feeding it live.

The collector (real uvicorn + SQLite, :class:`~vramwatch.collector.server.BackgroundServer`)
starts on a free local port; then one :class:`~vramwatch.hook.Monitor` per rank, each with
its own :class:`~vramwatch.probe.simulated.SimulatedProbe`, is driven step by step through a
scenario (:mod:`vramwatch.simulation.demo_runs`, ``--scenario NAME``; ``--list`` names them). Samples
travel the real path — probe → hook → BatchSender → gzip NDJSON POST → collector — exactly as from
a training job, tokens per step included; nothing is written into the database directly. Runs
until Ctrl-C or ``duration`` seconds.

The job behaves as a real one: when a rank runs out of memory every rank's process dies (no clean
close) and the launcher resumes the job from its last checkpoint, every rank with a new incarnation.
What it resumes with is what the collector's advice says (``GET /api/v1/runs/{run}/advice``): the
batch to back off to, or the scenario's fix when the advice says fix. In the scenarios that follow
the procedure the job also raises (and backs off) whenever the advice's next step says so, and the
next step is printed each time it changes.
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
from vramwatch.simulation.demo_runs import BASE, DEFAULT, DemoScenario, scenario

#: every simulated rank is a Monitor (a delivery thread) in this one process: a typo of
#: --ranks 100000000 would exhaust memory before the first sample
MAX_RANKS = 1024
#: Steps between two readings of the advice (the procedure's scenarios act on it).
ADVICE_EVERY = 100


def check_arguments(ranks: int, steps_per_s: float, duration: float | None, scenario_name: str = DEFAULT) -> None:
    """ValueError naming the first argument :func:`run_demo` cannot run with."""
    if not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"ranks: must be 1..{MAX_RANKS} (one thread each in this process), got {ranks}")
    if steps_per_s <= 0:
        raise ValueError(f"steps_per_s: must be positive, got {steps_per_s}")
    if duration is not None and duration <= 0:
        raise ValueError(f"duration: must be positive, got {duration}")
    scenario(scenario_name)


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
    scenario_name: str = DEFAULT,
    sim_params: Mapping[str, Any] | None = None,
    print_fn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Serve a dashboard and feed it a simulated ``ranks``-rank run until Ctrl-C / ``duration``.

    Returns a summary: ``url``, ``db``, ``run``, ``steps`` (per rank, counting steps redone after
    a restart), ``samples`` (recorded by the hooks), ``delivered`` (accepted by the collector),
    ``restarts``, ``tokens_per_step`` (the batch at the end) and ``advice`` (the last next step read).
    """
    check_arguments(ranks, steps_per_s, duration, scenario_name)
    from vramwatch.collector.server import BackgroundServer  # the [server] extra

    say = print_fn or (lambda line: print(line, flush=True))
    workdir = Path(tempfile.mkdtemp(prefix="vramwatch-demo-"))
    db_path = str(db) if db else str(workdir / "demo.db")
    run = run or f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    server = BackgroundServer(db_path, host=host, port=port).start()
    job = _Job(server.url, run, ranks, scenario(scenario_name), dict(sim_params or {}), workdir / "spool", say)
    try:
        say(f"vramwatch demo: collector on {server.url}  (database {db_path})")
        say(f"dashboard: {server.url}/   run {run!r}, {ranks} simulated ranks at {steps_per_s:g} steps/s, "
            f"scenario {scenario_name}: {job.scenario.description}; Ctrl-C to stop")
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
        + (f"; {job.restarts} restart(s)" if job.restarts else ""))
    return {"url": server.url, "db": db_path, "run": run, "steps": job.steps, "samples": job.samples,
            "delivered": job.delivered, "restarts": job.restarts, "tokens_per_step": job.tokens,
            "advice": job.advice}


class _Job:
    """The simulated ranks: one Monitor + probe each; restarted together (new incarnations)."""

    def __init__(self, url: str, run: str, ranks: int, story: DemoScenario, sim_params: dict[str, Any],
                 spool_dir: Path, say: Callable[[str], None]) -> None:
        self.url, self.run, self.ranks, self.scenario, self.say = url, run, ranks, story, say
        self.params = {**BASE, "world_size": ranks, **story.params, **sim_params}
        self.tokens = int(self.params["tokens_per_step"])
        self.spool_dir = spool_dir
        self.monitors: list[Monitor] = []
        self.probes: list[Any] = []
        self.killed: set[int] = set()
        self.advice: dict[str, Any] | None = None
        self.step = self.steps = self.samples = self.delivered = self.restarts = 0

    def start(self, step: int) -> None:
        from vramwatch.probe.simulated import SimulatedProbe

        self.step = step
        params = {**self.params, "tokens_per_step": self.tokens}
        for rank in range(self.ranks):
            probe = SimulatedProbe("demo", rank=rank, local_rank=rank % 8, seed=self.restarts, **params)
            self.probes.append(probe)
            self.monitors.append(Monitor(self.url, run=self.run, host=f"demo-node-{rank // 8}", rank=rank,
                                         local_rank=rank % 8, world_size=self.ranks, probe=probe,
                                         flush_interval_s=0.5, spool_dir=self.spool_dir,
                                         # a simulated GPU has no allocator history to capture (and the
                                         # capture's CUDA check would import torch: seconds per start)
                                         snapshots=False))

    def stop(self, timeout: float, *, clean: bool = True) -> None:
        """End every rank's process: a clean close, or (``clean=False``) killed: delivered, no exit marker."""
        from vramwatch.delivery import lifecycle

        deadline = time.monotonic() + timeout
        for rank, monitor in enumerate(self.monitors):
            left = max(0.2, deadline - time.monotonic())
            if clean and rank not in self.killed:
                monitor.close(left)
            else:
                # killed: what was sent stays, no exit marker; its threads end as the process's would
                monitor.flush(left)
                monitor.sender.close(0.2)  # type: ignore[union-attr]
                if monitor.host is not None:
                    monitor.host.release()
                lifecycle.unregister(monitor)
            stats = monitor.stats()
            self.samples += stats["samples"]
            self.delivered += stats.get("delivered", 0)
        self.monitors, self.probes, self.killed = [], [], set()

    def advance(self) -> None:
        """One step on every living rank; then the scenario's events and the advice's next step."""
        step = self.step
        kill = self.scenario.kill
        for rank, monitor in enumerate(self.monitors):
            if rank in self.killed:
                continue
            monitor.step(step, tokens=self.probes[rank].tokens_per_step)
            for phase in self.probes[rank].phases_at(step):
                with monitor.phase(phase):
                    pass
            if kill is not None and kill == (rank, step) and not self.restarts:
                self.killed.add(rank)
                self.monitors[rank].flush(2.0)
                self.say(f"  rank {rank} was killed at step {step} (no exit, no OOM); the job goes on without it")
        self.step += 1
        self.steps += 1
        crashed = [rank for rank, p in enumerate(self.probes) if rank not in self.killed and p.ooms]
        if crashed:
            self._restart_after_oom(crashed[0], step)
        elif self.scenario.follows_advice and step % ADVICE_EVERY == 0 and step:
            self._follow(step)

    def _restart_after_oom(self, rank: int, step: int) -> None:
        """Like a real job: the OOM kills it; the launcher resumes every rank from the last checkpoint,
        with the batch or the fix the advice names."""
        every = int(self.params.get("ckpt_every") or 0)
        resume = (step - 1) // every * every if every else 0  # the last checkpoint saved before the OOM
        self.stop(timeout=5.0, clean=False)
        self.restarts += 1
        step_doc = self._read_advice()
        action = (step_doc or {}).get("action")
        if action == "fix" or (action is None and self.scenario.fix):
            self.params = {**self.params, **self.scenario.fix}
        elif action == "back_off" and step_doc and step_doc.get("tokens_per_step"):
            self.tokens = int(step_doc["tokens_per_step"])
        self.start(resume + 1)
        self.say(f"  rank {rank} ran out of memory at step {step}: the job resumes from its checkpoint at step "
                 f"{resume} at {self.tokens * self.ranks:,} global tokens per step ({self.tokens:,} per rank; new "
                 "incarnations)"
                 + (f"; advice: {step_doc['sentence']}" if step_doc else ""))

    def _follow(self, step: int) -> None:
        """The procedure: raise or back off when the advice's next step says so (from the last checkpoint)."""
        step_doc = self._read_advice()
        if not step_doc or step_doc["action"] not in ("raise", "back_off") or not step_doc.get("tokens_per_step"):
            return
        tokens = int(step_doc["tokens_per_step"])
        if tokens == self.tokens:
            return
        every = int(self.params.get("ckpt_every") or 0)
        resume = step // every * every if every else step
        self.stop(timeout=5.0)
        self.restarts += 1
        self.tokens = tokens
        self.start(resume + 1)
        self.say(f"  step {step}: {step_doc['action']} to {tokens * self.ranks:,} global tokens per step "
                 f"({tokens:,} per rank) as advised; resumed from the checkpoint at step {resume}")

    def _read_advice(self) -> dict[str, Any] | None:
        """The collector's next step for this run (None when it cannot answer now); printed when it changes."""
        from vramwatch import remote

        try:
            doc = remote.get_json(self.url, remote.run_path(self.run, "advice"), None, timeout=10.0)
        except remote.RemoteError:
            return None
        step_doc = doc.get("next")
        if step_doc and (self.advice is None or step_doc["sentence"] != self.advice["sentence"]):
            self.say(f"  advice: {step_doc['sentence']}")
        self.advice = step_doc
        return step_doc


def _drive(job: _Job, steps_per_s: float, duration: float | None, say: Callable[[str], None]) -> None:
    """Step every rank in lockstep at ``steps_per_s`` (absolute pacing: no drift)."""
    interval = 1.0 / steps_per_s
    started = next_tick = time.monotonic()
    next_report = started + 10.0
    while duration is None or time.monotonic() - started < duration:
        job.advance()
        now = time.monotonic()
        if now >= next_report:
            delivered = job.delivered + sum(m.stats().get("delivered", 0) for m in job.monitors)
            if not job.scenario.follows_advice:
                job._read_advice()  # printed when the next step changes
            say(f"  step {job.step}: {delivered} samples delivered, {job.tokens * job.ranks:,} global tokens per step "
                f"({job.tokens:,} per rank)")
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
    known = {"ranks", "duration", "port", "host", "db", "steps_per_s", "open_browser", "run", "scenario_name"}
    run_demo(**{k: v for k, v in options.items() if k in known and v is not None})
    return 0


__all__ = ["ADVICE_EVERY", "main", "run_demo"]
