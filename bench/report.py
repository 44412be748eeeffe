"""Write one benchmark's results as a ``## Section`` of docs/benchmarks.md, replacing the
previous run's section and leaving the others alone."""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = (
    "# Benchmarks\n\n"
    "One section per benchmark, each with the command that produced its figures (`make bench` runs\n"
    "them all: `python -m bench`, or `python -m bench NAME ...`). Where a goal exists a figure reads\n"
    "*measured / limit = ratio*. Figures come from the development machine (2 cores, shared with\n"
    "other work, noisy): compare ratios measured side by side in one run, not absolute numbers\n"
    "across sections. Earlier runs are in this file's git history.\n"
)


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def write_section(title: str, body: str, command: str) -> None:
    text = DOC.read_text() if DOC.exists() else HEADER
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    section = f"## {title}\n\nCommand: `{command}` — {stamp}, {machine()}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _m: section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text.rstrip() + "\n")


def median_time(fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
