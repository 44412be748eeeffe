"""Hook cost on the training thread.

1. ``vw.step()`` with the simulated probe, delivering to a real collector (a ``vramwatch
   serve`` subprocess, as in production: it does not share this process's GIL):
   per-call time (median, p99) on the training thread. Measured alongside: the simulated
   probe's ``read()`` alone, and the hook with a constant probe (its own overhead: dict,
   timestamps, deque append), so the figure can be split into probe and hook.
2. The real torch probe: torch's own ``torch.cuda`` Python code with only its C++
   entry points replaced (``torch._C._cuda_memoryStats`` returns a fresh nested dict of the
   real shape, ``tests/fakes/cuda_memory_stats.json``; ``_cuda_resetPeakMemoryStats``;
   ``is_initialized``). Measured in the same run, interleaved: the *floor* (one
   ``memory_stats_as_nested_dict()`` plus reading the needed keys), the old way
   (``memory_stats()``: flatten + sort in Python), the probe's ``read()``, and ``vw.step()``
   with the torch probe delivering to the collector. Goal: ``vw.step()`` <= 1.5x the floor.
3. A real CPU training loop (MLP + AdamW, batch sized to ~20 ms per step) with the hook
   on vs off, in pairs of steps (random order) in one run so drift and noisy neighbours
   hit both alike.

    python -m bench.hook_bench [--calls 20000] [--steps 600]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.report import table, write_section
from vramwatch.hook import Monitor
from vramwatch.probe.simulated import SimulatedProbe


class ConstantProbe:
    """Returns one precomputed reading: isolates the hook's own cost from the probe's."""

    name = "constant"

    def __init__(self) -> None:
        self._reading = SimulatedProbe("healthy").read(0)

    def device_info(self) -> dict[str, Any]:
        return {"uuid": "GPU-constant", "gpu": 0, "total_bytes": self._reading["total_bytes"]}

    def read(self, step: int, phase: str = "train") -> dict[str, Any]:
        return self._reading

    def close(self) -> None:
        pass


def _percentiles(ns: list[int]) -> tuple[float, float]:
    ordered = sorted(ns)
    return statistics.median(ordered) / 1000, ordered[int(len(ordered) * 0.99)] / 1000


def time_calls(fn: Any, calls: int) -> tuple[float, float]:
    clock = time.perf_counter_ns
    samples = []
    for i in range(calls):
        t0 = clock()
        fn(i)
        samples.append(clock() - t0)
    return _percentiles(samples[calls // 10 :])  # drop warm-up


def step_cost(url: str, calls: int, spool: Path) -> dict[str, tuple[float, float]]:
    out = {}
    sim = SimulatedProbe("healthy")
    out["probe.read() alone (simulated)"] = time_calls(lambda i: sim.read(i), calls)
    for label, probe in (("vw.step(), simulated probe", SimulatedProbe("healthy")),
                         ("vw.step(), constant probe (hook only)", ConstantProbe())):
        vw = Monitor(url, run=f"bench-{label[:12]}", probe=probe, spool_dir=spool)
        out[label] = time_calls(vw.step, calls)
        assert vw.close(30), vw.stats()
        stats = vw.stats()
        # every call, and the exit marker a clean close sends
        assert stats["delivered"] == calls + 1 and stats["probe_errors"] == stats["hook_errors"] == 0, stats
    return out


def _fake_cuda() -> Any:
    """tests/fakes/fake_cuda.py: the scripted allocator behind torch's C++ entry points."""
    tests = str(Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:
        sys.path.append(tests)
    from fakes.fake_cuda import FakeCuda

    return FakeCuda()


def _floor_read(nested: Any) -> Any:
    """The limit: one nested-stats call and the keys a sample needs, nothing else."""

    def read(_i: int) -> int:
        stats = nested(0)
        allocated = stats["allocated_bytes"]["all"]
        return (allocated["current"] + allocated["peak"] + stats["reserved_bytes"]["all"]["current"]
                + stats["active_bytes"]["all"]["current"] + stats["inactive_split_bytes"]["all"]["current"]
                + stats["num_alloc_retries"] + stats["num_ooms"])

    return read


def _flat_read(flat: Any) -> Any:
    def read(_i: int) -> int:
        stats = flat(0)
        return (stats["allocated_bytes.all.current"] + stats["allocated_bytes.all.peak"]
                + stats["reserved_bytes.all.current"] + stats["active_bytes.all.current"]
                + stats["inactive_split_bytes.all.current"] + stats["num_alloc_retries"] + stats["num_ooms"])

    return read


def torch_probe_cost(url: str, calls: int, spool: Path, rounds: int = 5) -> dict[str, tuple[float, float]]:
    """µs per call through torch's real Python code; rows interleaved in ``rounds`` so drift hits all alike."""
    from vramwatch.probe.torch_cuda import TorchCudaProbe

    fake = _fake_cuda()
    with fake.patched() as cuda:
        fake.alloc(12 * 1024**3)
        probe = TorchCudaProbe(0, cuda=cuda, nvml=False)
        step_probe = TorchCudaProbe(0, cuda=cuda, nvml=False)
        vw = Monitor(url, run="bench-torch-probe", probe=step_probe, spool_dir=spool)
        rows: dict[str, Any] = {
            "floor: memory_stats_as_nested_dict() + needed keys": _floor_read(cuda.memory_stats_as_nested_dict),
            "old way: memory_stats() (flatten + sort) + needed keys": _flat_read(cuda.memory_stats),
            "TorchCudaProbe.read() (peak=reset)": probe.read,
            "vw.step(), torch probe": vw.step,
        }
        ns: dict[str, list[int]] = {label: [] for label in rows}
        clock = time.perf_counter_ns
        per_round = max(100, calls // rounds)
        step = 0
        for _ in range(rounds):
            for label, fn in rows.items():
                out = ns[label]
                for _i in range(per_round):
                    t0 = clock()
                    fn(step)
                    out.append(clock() - t0)
                    step += 1
        assert vw.close(30), vw.stats()
        stats = vw.stats()
        delivered = per_round * rounds + 1  # and the exit marker
        assert stats["probe_errors"] == stats["hook_errors"] == 0 and stats["delivered"] == delivered, stats
    return {label: _percentiles(values[len(values) // 10 :]) for label, values in ns.items()}


def training_overhead(url: str, steps: int, spool: Path) -> dict[str, float]:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core: less noise from the neighbours on a shared machine
    width, batch = 640, 80
    model = torch.nn.Sequential(torch.nn.Linear(width, width * 2), torch.nn.GELU(), torch.nn.Linear(width * 2, width),
                                torch.nn.GELU(), torch.nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch, width), torch.randn(batch, 1)

    def train_step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(5):
        train_step()
    # size the batch so one step takes ~20 ms on this machine today
    t0 = time.perf_counter()
    for _ in range(10):
        train_step()
    batch = max(8, round(batch * 0.020 / ((time.perf_counter() - t0) / 10)))
    x, y = torch.randn(batch, width), torch.randn(batch, 1)
    for _ in range(5):
        train_step()
    order = random.Random(0)
    vw = Monitor(url, run="bench-training", probe=SimulatedProbe("healthy"), spool_dir=spool)
    on: list[float] = []
    off: list[float] = []
    step = 0
    clock = time.perf_counter
    for _ in range(steps // 2):
        # one step with the hook and one without, in random order: neighbours and drift hit both alike
        for with_hook in order.sample((True, False), 2):
            t0 = clock()
            train_step()
            if with_hook:
                vw.step(step, tokens=batch)
                step += 1
            (on if with_hook else off).append(clock() - t0)
    assert vw.close(30)
    med_on, med_off = statistics.median(on), statistics.median(off)
    return {"steps_each": len(on), "median_on_ms": med_on * 1e3, "median_off_ms": med_off * 1e3,
            "mean_on_ms": statistics.fmean(on) * 1e3, "mean_off_ms": statistics.fmean(off) * 1e3,
            "slowdown_pct": (med_on / med_off - 1) * 100, "width": width, "batch": batch,
            # each hook-on step against the hook-off step of the same pair: slow drift cancels
            "paired_pct": statistics.median(a - b for a, b in zip(on, off, strict=False)) / med_off * 100}


def watch_cost(url: str, calls: int, spool: Path, rounds: int = 5) -> dict[str, Any]:
    """``vw.step()`` with ``vw.watch(model, optimizer)`` against the bare ``vw.step()`` (constant probe: the
    hook's own cost), interleaved in ``rounds``; mean and median per call (the mean holds the full recount
    every RECOUNT_EVERY steps), and one full recount of the model alone."""
    from vramwatch.probe.model_memory import RECOUNT_EVERY, count

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(128, 4, 256, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=12, enable_nested_tensor=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, 8, 128)).sum().backward()
    optimizer.step()
    tensors = len(list(model.parameters())) + len(list(model.buffers())) + sum(len(s) for s in optimizer.state.values())
    bare = Monitor(url, run="bench-watch-bare", probe=ConstantProbe(), spool_dir=spool)
    watched = Monitor(url, run="bench-watch", probe=ConstantProbe(), spool_dir=spool)
    watched.watch(model, optimizer)
    ns: dict[str, list[int]] = {"bare": [], "watched": []}
    # this thread's CPU time: on a shared machine wall time mostly measures the neighbours' load
    clock = time.thread_time_ns
    per_round = max(RECOUNT_EVERY * 2, calls // rounds)
    for _ in range(rounds):
        for label, vw in (("bare", bare), ("watched", watched)):
            out = ns[label]
            for i in range(per_round):
                t0 = clock()
                vw.step(i)
                out.append(clock() - t0)
    for vw in (bare, watched):
        assert vw.close(30) and vw.stats()["hook_errors"] == 0, vw.stats()
    t0 = time.thread_time()
    for _ in range(21):
        count([model], [optimizer])
    recount = (time.thread_time() - t0) / 21
    return {"tensors": tensors, "every": RECOUNT_EVERY, "calls": per_round * rounds, "recount_us": recount * 1e6,
            **{f"{k}_median_us": statistics.median(v) / 1000 for k, v in ns.items()},
            **{f"{k}_mean_us": statistics.fmean(v) / 1000 for k, v in ns.items()}}


def watch_section(w: dict[str, Any], step_ms: float | None) -> str:
    added = w["watched_mean_us"] - w["bare_mean_us"]
    limit = 0.01 * step_ms * 1000 if step_ms else None
    rows = [("vw.step(), constant probe (bare hook)", f"{w['bare_median_us']:.2f}", f"{w['bare_mean_us']:.2f}"),
            ("vw.step() with vw.watch(model, AdamW)", f"{w['watched_median_us']:.2f}", f"{w['watched_mean_us']:.2f}"),
            (f"one full recount ({w['tensors']} tensors)", f"{w['recount_us']:.1f}", "")]
    body = table(["per call, training thread (its CPU time)", "median µs", "mean µs"], rows)
    body += (f"\n\n{w['calls']:,} calls each, rows interleaved in 5 rounds, delivering to a real collector; "
             "the training "
             "thread's CPU time (`time.thread_time_ns`: the neighbours' load on a shared machine left out). The model: "
             f"a 12-layer TransformerEncoder (d=128) with AdamW state, {w['tensors']} tensors. Between recounts a step "
             f"costs a few `len()` (the optimizers' state and groups); the full count runs when they change and every "
             f"{w['every']} steps, so the mean carries it. **Added cost per step: {added:.2f} µs (mean)**")
    if limit:
        body += (f" against the bare CPU training step ({step_ms:.2f} ms median, wall time: the Hook section's MLP + "
                 f"AdamW loop, measured in the same run): **{added:.2f} / {limit:.1f} µs (1 % of the step) = "
                 f"{added / limit:.3f}**.")
    return body + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--steps", type=int, default=600, help="training steps (half with the hook)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--watch-only", action="store_true",
                        help="only the cost of vw.watch (memory by category) against the bare step")
    args = parser.parse_args(argv)
    if args.watch_only:
        return watch_main(args)
    from bench.ingest_bench import start_collector

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_collector(str(Path(tmp) / "bench.db"))
        try:
            costs = step_cost(url, args.calls, Path(tmp) / "spool")
            torch_costs = torch_probe_cost(url, args.calls, Path(tmp) / "spool")
            loop = training_overhead(url, args.steps, Path(tmp) / "spool")
        finally:
            proc.terminate()
            proc.wait(30)
    for label, (median, p99) in {**costs, **torch_costs}.items():
        print(f"{label}: median {median:.2f} us, p99 {p99:.2f} us")
    floor = torch_costs["floor: memory_stats_as_nested_dict() + needed keys"][0]
    step_torch = torch_costs["vw.step(), torch probe"][0]
    print(f"torch probe: vw.step() {step_torch:.2f} us / floor {floor:.2f} us = {step_torch / floor:.2f}x "
          "(goal <= 1.5x)")
    print(f"training loop: {loop}")
    rows = [(label, f"{median:.2f}", f"{p99:.2f}") for label, (median, p99) in costs.items()]
    body = table(["per call, training thread", "median µs", "p99 µs"], rows)
    body += (f"\n\n{args.calls} calls each, delivering to a real collector (`vramwatch serve` subprocess) "
             "while measured. Target: `vw.step()` median ≤ 15 µs with the simulated probe. The simulated probe's "
             "`read()` is most of it; the hook's own work (dict, timestamps, deque append) is the constant-probe row. "
             "On a GPU the probe is one `torch.cuda.memory_stats_as_nested_dict()` (see below and "
             "`bench/gpu_check`).\n\n")
    trows = [(label, f"{median:.2f}", f"{p99:.2f}", f"{median / floor:.2f}")
             for label, (median, p99) in torch_costs.items()]
    body += table(["torch probe, per call (torch's own Python code, C++ entry points replaced)", "median µs", "p99 µs",
                   "/ floor"], trows)
    body += (f"\n\n**Torch probe: `vw.step()` {step_torch:.2f} µs / floor {floor:.2f} µs = {step_torch / floor:.2f}** "
             "(goal ≤ 1.5). Floor = one `torch.cuda.memory_stats_as_nested_dict()` plus reading the keys a sample "
             "needs, measured in the same run, rows interleaved in 5 rounds. Only `torch._C._cuda_memoryStats` (a "
             "fresh nested dict of the real shape per call, `tests/fakes/cuda_memory_stats.json`), "
             "`torch._C._cuda_resetPeakMemoryStats` and `is_initialized` are replaced; `vw.step()` includes the "
             "`reset_peak_memory_stats()` call of the default `peak=\"reset\"`. On a real device the C++ call "
             "builds the same dicts; `bench/gpu_check` measures the same rows there.\n\n")
    w, b = loop["width"], loop["batch"]
    body += table(
        [f"CPU training loop (MLP {w}→{2 * w}→{w}→1, batch {b}, AdamW, 1 thread)", "hook off", "hook on"],
        [("median step, ms", f"{loop['median_off_ms']:.2f}", f"{loop['median_on_ms']:.2f}"),
         ("mean step, ms", f"{loop['mean_off_ms']:.2f}", f"{loop['mean_on_ms']:.2f}")])
    body += (f"\n\nSlowdown (median on / median off - 1): **{loop['slowdown_pct']:+.2f} %** over "
             f"{loop['steps_each']} steps each, in pairs (one on, one off, random order) in one run, batch sized "
             f"to ~20 ms per step at start; median of paired differences (on minus off, same pair): "
             f"**{loop['paired_pct']:+.2f} %**. "
             "Target ≤ 1 %. On this shared 2-core machine run-to-run noise is itself around ±1 %; the per-call "
             "figure above (µs against a ~20 ms step) is the stable measure of the hook's cost.")
    if not args.no_write:
        write_section("Hook", body, f"python -m bench.hook_bench --calls {args.calls} --steps {args.steps}")
    return {"costs": costs, "torch": torch_costs, "loop": loop}


def watch_main(args: argparse.Namespace) -> dict[str, Any]:
    from bench.ingest_bench import start_collector

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_collector(str(Path(tmp) / "bench.db"))
        try:
            w = watch_cost(url, args.calls, Path(tmp) / "spool")
            loop = training_overhead(url, min(args.steps, 200), Path(tmp) / "spool")
        finally:
            proc.terminate()
            proc.wait(30)
    print(w, loop["median_off_ms"])
    if not args.no_write:
        write_section("Hook: memory by category (vw.watch) against the bare step",
                      watch_section(w, loop["median_off_ms"]),
                      f"python -m bench.hook_bench --watch-only --calls {args.calls}")
    return {"watch": w, "loop": loop}


if __name__ == "__main__":
    main()
