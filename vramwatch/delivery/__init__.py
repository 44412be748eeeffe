"""Delivery of samples from the training process, along OpenTelemetry's seam.

* :class:`~vramwatch.delivery.processor.BatchProcessor`: bounded deque, worker thread,
  ``force_flush``/``shutdown``, per-instance fork handling, one exit registry
  (:mod:`vramwatch.delivery.lifecycle`) shared with the hook;
* exporters (:mod:`vramwatch.delivery.exporters`): :class:`HttpExporter` (gzip NDJSON POST,
  413 split, 422 handling, bounded replies, collector hints), :class:`FileExporter` (JSONL
  traces), :class:`InMemoryExporter` (tests);
* :class:`~vramwatch.delivery.spool.SpoolingExporter`: disk spool + oldest-first replay with
  backoff, bounded per rank across restarts;
* typed results (:mod:`vramwatch.delivery.results`): nothing matches message text.

``BatchSender`` is the processor with its spooling stack (what the hook runs).
"""

from vramwatch.delivery.exporters import (
    INGEST_PATH,
    MAX_REPLY_BYTES,
    Exporter,
    FileExporter,
    HttpExporter,
    InMemoryExporter,
)
from vramwatch.delivery.processor import BatchProcessor, BatchSender, SharedWorker
from vramwatch.delivery.results import Directive, ExportFailure, ExportOutcome, ExportResult
from vramwatch.delivery.spool import Backoff, Spool, SpoolingExporter, leftover_spools, spool_prefix

__all__ = [
    "INGEST_PATH",
    "MAX_REPLY_BYTES",
    "Backoff",
    "BatchProcessor",
    "BatchSender",
    "Directive",
    "ExportFailure",
    "ExportOutcome",
    "ExportResult",
    "Exporter",
    "FileExporter",
    "HttpExporter",
    "InMemoryExporter",
    "SharedWorker",
    "Spool",
    "SpoolingExporter",
    "leftover_spools",
    "spool_prefix",
]
