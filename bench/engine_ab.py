"""Per-sample cost of the trend engine against a git ref, in one process, interleaved.

    python -m bench.engine_ab                       # the working tree vs main, printed
    python -m bench.engine_ab --ref HEAD~3 --write  # and written to docs/benchmarks.md

The ref's ``vramwatch/engine/`` is read with ``git show`` into a temporary package loaded as
``vramwatch._engine_ref``, its imports of ``vramwatch.engine`` pointed at that package (the rest of
``vramwatch`` is the working tree's), so only the engine differs. Both engines fold the same
pre-validated samples, one engine per series as ``analyze`` and the collector hold them; rounds
alternate which goes first (a noisy neighbour hits both alike); CPU time of this process, median of
the rounds. Inputs: the 8-rank demo scenario (full schema-1 samples: what the hook sends) and the
device-used-only corpus (``bench/device_corpus.py``, tuning split: what ``watch`` and the importers
send).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.report import table, write_section
from vramwatch import wire
from vramwatch.engine import TrendEngine

ROOT = Path(__file__).resolve().parent.parent


def load_ref(ref: str, into: Path) -> ModuleType:
    """``vramwatch/engine`` at ``ref`` as the package ``vramwatch._engine_ref``."""
    names = subprocess.run(["git", "ls-tree", "--name-only", ref, "vramwatch/engine/"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    package = into / "_engine_ref"
    package.mkdir()
    for name in names:
        if name.endswith(".py"):
            source = subprocess.run(["git", "show", f"{ref}:{name}"], cwd=ROOT, check=True, capture_output=True).stdout
            # the engine imports itself absolutely: those imports must reach the ref's modules, not the tree's
            source = re.sub(rb"\bvramwatch\.engine\b", b"vramwatch._engine_ref", source)
            (package / Path(name).name).write_bytes(source)
    spec = importlib.util.spec_from_file_location("vramwatch._engine_ref", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def inputs(demo_steps: int, per_family: int) -> dict[str, list[dict[str, Any]]]:
    from bench.device_corpus import corpus
    from vramwatch.probe.simulated import simulate_trace

    demo = [wire.validate(s) for rank in range(8) for s in simulate_trace("demo", steps=demo_steps, rank=rank,
                                                                            seed=rank)]
    device = [s for trace in corpus("tune", per_family) for s in trace.samples]
    return {"demo, 8 ranks (full samples)": demo, "device corpus (device used only)": device}


def fold(engine_cls: Any, samples: list[dict[str, Any]]) -> float:
    engines: dict[Any, Any] = {}
    started = time.process_time()
    for s in samples:
        key = (s["run"], s["host"], s["rank"])
        engine = engines.get(key)
        if engine is None:
            engine = engines[key] = engine_cls()
        engine.update(s)
    return time.process_time() - started


def compare(ref_cls: Any, repeats: int, data: dict[str, list[dict[str, Any]]]) -> list[tuple[str, int, float, float]]:
    """(input, samples, ref µs/sample, working tree µs/sample), medians of interleaved rounds."""
    rows = []
    for label, samples in data.items():
        times: dict[str, list[float]] = {"ref": [], "new": []}
        for i in range(repeats):
            order = [("ref", ref_cls), ("new", TrendEngine)]
            for name, cls in order if i % 2 == 0 else reversed(order):
                times[name].append(fold(cls, samples))
        n = len(samples)
        rows.append((label, n, 1e6 * statistics.median(times["ref"]) / n, 1e6 * statistics.median(times["new"]) / n))
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_ab")
    parser.add_argument("--ref", default="main")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--demo-steps", type=int, default=20_000)
    parser.add_argument("--per-family", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ref = load_ref(args.ref, Path(tmp))
        rows = compare(ref.TrendEngine, args.repeats, inputs(args.demo_steps, args.per_family))
    body = (
        f"Per-sample cost of `TrendEngine.update` in the working tree against `{args.ref}`, one process, rounds "
        f"interleaved, CPU time, median of {args.repeats}. Limit: the ref's own cost (goal: within 5 %).\n\n"
        + table(("input", "samples", f"{args.ref} µs/sample", "now µs/sample", "measured / limit"),
                [(label, f"{n:,}", f"{old:.2f}", f"{new:.2f}", f"{new / old:.3f}") for label, n, old, new in rows])
    )
    print(body)
    if args.write:
        command = f"python -m bench.engine_ab --ref {args.ref}"
        write_section("Trend engine: per-sample cost against a ref", body, command)


if __name__ == "__main__":
    main(sys.argv[1:])
