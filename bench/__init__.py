"""Benchmarks (``make bench`` → ``python -m bench``). Each module writes its own section of
docs/benchmarks.md through :func:`bench.report.write_section`.

The benchmarks share the tests' simulated corpus, load generator and collector processes
(``tests/corpus.py``, ``tests/loadgen.py``, ``tests/collector_process.py``, the hostile servers of
``tests/hostile.py``): ``tests/`` is on the import
path of every benchmark."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
