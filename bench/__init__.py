"""Benchmarks (``make bench`` → ``python -m bench``). Each module writes its own section of
docs/benchmarks.md through :func:`bench.report.write_section`."""
