"""What the evidence and side-channel bounds cost, before and after, in one run.

    .venv/bin/python -m bench.bounds_bench      # docs/benchmarks.md "## Evidence and side-channel bounds"
    .venv/bin/python -m bench.bounds_bench --no-write

"Before" is the unbudgeted path the product had, run here beside the new one on the same
bytes: the data-only C unpickler on a joined copy of the input, a reader pattern compiled as a
regular expression, a store open without the contents check. Hostile inputs run "before" in a
child process with a 2 GiB address-space limit and a time limit, so a crash or a runaway is
measured, not suffered. Rows:

* a real pair of 20,000-block snapshots (``bench/snapshot_diff_bench.py``'s): read and diffed;
  the walk's cost on the first read and on a later read (remembered files);
* each hostile pickle of ``tests/hostile_pickles.py``: outcome, time and peak RSS;
* a reader pattern ``(.|.)*Q`` on a 26-character name: the regex against the glob;
* the redaction: microseconds per command line;
* the database contents check: a command's read of a 200,000-sample run without and with it.
"""

from __future__ import annotations

import argparse
import gzip
import io
import pickle
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.report import table, write_section
from bench.snapshot_diff_bench import snapshot

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

MiB = 2**20
_CHILD = r"""
import gzip, io, resource, sys, time
from vramwatch.evidence import safe_pickle
data = open(sys.argv[2], "rb").read()
t0 = time.perf_counter()
try:
    if sys.argv[1] == "before":
        raw = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
        safe_pickle._DataOnlyUnpickler(io.BytesIO(bytes(raw))).load()
        outcome = "loaded"
    else:
        safe_pickle.load_snapshot(data)
        outcome = "loaded"
except MemoryError:
    outcome = "MemoryError"
except Exception as exc:
    outcome = "refused: " + str(exc).split("(snapshot budget: ")[-1].rstrip(")") if "budget" in str(exc) \
        else type(exc).__name__
print(f"{outcome}|{time.perf_counter() - t0:.2f}|{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}")
"""


def _child(which: str, path: Path, limit_s: float = 120) -> str:
    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, which, str(path)], capture_output=True, text=True,
                              timeout=limit_s, preexec_fn=limits, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return f"still running after {limit_s:.0f} s"
    if proc.returncode < 0:
        return f"killed by signal {-proc.returncode} (SIGSEGV: {-proc.returncode == 11})"
    if proc.returncode:
        return f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1][:80] if proc.stderr.strip() else ''}"
    outcome, secs, rss = proc.stdout.strip().split("|")
    return f"{outcome}; {float(secs):.2f} s; peak RSS {int(rss):,} MB"


def _timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def real_pair(rows: list[list[str]]) -> None:
    from vramwatch.evidence import safe_pickle
    from vramwatch.evidence.snapshot_diff import diff

    blobs = [pickle.dumps(snapshot(20_000, seed=s, leak_blocks=lb, cached_mib=c), protocol=4)
             for s, lb, c in ((1, 200, 512), (2, 1200, 4096))]
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, b in enumerate(blobs):
            p = Path(tmp) / f"{i}.pickle.gz"
            p.write_bytes(gzip.compress(b, 1))
            paths.append(p)

        def before() -> None:
            with safe_pickle.paused_gc():
                loaded = [safe_pickle._DataOnlyUnpickler(io.BytesIO(b"".join([gzip.decompress(p.read_bytes())])))
                          .load() for p in paths]
                diff(*loaded)

        def first() -> None:
            safe_pickle._VERIFIED.clear()
            with safe_pickle.paused_gc():
                diff(*[safe_pickle.read_snapshot(p) for p in paths])

        def walked() -> None:  # the opcode walk alone: the grammar's proof left out
            from vramwatch.evidence import pickle_grammar

            proves, pickle_grammar.proves = pickle_grammar.proves, lambda data, budget: False
            try:
                first()
            finally:
                pickle_grammar.proves = proves

        def later() -> None:
            with safe_pickle.paused_gc():
                diff(*[safe_pickle.read_snapshot(p) for p in paths])

        b, f, w = _timed(before), _timed(first), _timed(walked, 2)
        later()
        la = _timed(later)
        overhead = _reader_peak(paths[1])
    rows.append(["two 20,000-block snapshots (9 MiB of pickle) read and diffed", f"{b * 1000:,.0f} ms",
                 f"first read {f * 1000:,.0f} ms ({f / b:.2f}x: proven by the grammar; with the opcode walk alone "
                 f"{w * 1000:,.0f} ms, {w / b:.1f}x); a later read or an upload proven on arrival {la * 1000:,.0f} ms "
                 f"({la / b:.2f}x); the reader's own peak (inflate and proof) {overhead:.2f}x the inflated size"])


def _reader_peak(path: Path) -> float:
    """Peak Python memory of inflating and proving one file, over its inflated size."""
    import tracemalloc

    from vramwatch.evidence import safe_pickle

    tracemalloc.start()
    try:
        data = safe_pickle.inflate(path.open("rb"))
        safe_pickle.walk(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak / len(data)


def hostile(rows: list[list[str]]) -> None:
    import hostile_pickles as hp

    cases = {"a tuple nested 10^6 deep as a dict key": hp.deep_tuple_key(),
             "LONG_BINPUT at 2^26 (9 bytes)": hp.memo_index(),
             "a DUP bomb (64 M DUPs)": hp.dup_bomb(),
             "a block size of 2^1100": hp.huge_size(),
             "a MARK bomb (64 M MARKs)": hp.mark_bomb(64_000_000)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in cases.items():
            path = Path(tmp) / "h.pickle.gz"
            path.write_bytes(data)
            rows.append([f"{name}, {len(data):,} B on disk", _child("before", path), _child("after", path)])


def patterns(rows: list[list[str]]) -> None:
    from vramwatch.evidence.patterns import compile_glob

    name = "x" * 22
    t0 = time.perf_counter()
    re.compile("(.|.)*Q").search(name)
    before = time.perf_counter() - t0
    glob = compile_glob("(.|.)*Q")
    after = _timed(lambda: glob.search("x" * 200_000))
    rows.append(["reader pattern `(.|.)*Q`", f"regex on a 22-character name: {before:.2f} s holding the GIL",
                 f"glob on a 200,000-character name: {after * 1000:.2f} ms"])


def redaction(rows: list[list[str]]) -> None:
    from vramwatch.redact import redact_args, redact_text

    line = ("python -m torch.distributed.run --nproc-per-node 8 train.py --hf-token hf_abc --lr 3e-4 "
            "--data s3://bucket/x DATABASE_URL=postgres://u:pw@h/db --batch-size 16")
    n = 2000
    per_text = _timed(lambda: [redact_text(line) for _ in range(n)]) / n
    argv = line.split()
    per_args = _timed(lambda: [redact_args(argv) for _ in range(n)]) / n
    rows.append(["redaction of a 16-word command line", "(the old redaction missed URLs, headers, `-u`)",
                 f"{per_args * 1e6:.0f} µs as arguments, {per_text * 1e6:.0f} µs as text"])


def contents(rows: list[list[str]]) -> None:
    from vramwatch.collector.store import Store
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import make_sample

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.db"
        store = Store(path)
        for r in range(8):
            store.insert([make_sample(i, rank=r, ts=1000.0 + i) for i in range(25_000)])
        store.close()
        def read(check: bool) -> None:
            store = Store(path, readonly=True, check_contents=check)
            sum(1 for _ in store.iter_samples("run-a"))
            store.close()

        before, after = _timed(lambda: read(False), 2), _timed(lambda: read(True), 2)
    rows.append(["a command's read of a 200,000-sample run (open, every sample)", f"{before * 1000:,.0f} ms",
                 f"{after * 1000:,.0f} ms with the contents check ({after / before:.2f}x)"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    rows: list[list[str]] = []
    for part in (real_pair, patterns, redaction, contents, hostile):
        part(rows)
        print(" | ".join(rows[-1]), flush=True)
    body = table(["input", "before", "after"], rows) + (
        "\n\nSame run, same bytes; the hostile rows ran in a child process limited to 2 GiB of address space "
        "and 120 s. The cost of the budget is the proof on a snapshot's first read (remembered per file "
        "afterwards; the collector proves an upload while it arrives): torch's output is proven by the grammar "
        "at C speed, anything else walked opcode by opcode.")
    if not args.no_write:
        write_section("Evidence and side-channel bounds", body, "python -m bench.bounds_bench")
    else:
        print(body)


if __name__ == "__main__":
    main()
