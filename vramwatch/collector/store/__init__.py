"""SQLite store: every sample, on disk, idempotent. All SQL of vramwatch lives in this package.

* ``schema.py``: tables derived from ``wire.FIELD_TABLE``, versioned migrations;
* ``core.py``: :class:`Store` (open, lock, insert, retention, checkpoints, close);
* ``errors.py``: ``StoreError`` and its kinds;
* ``reads.py``: series, runs, export/replay, chart columns, phase markers;
* ``aggregates.py``: bucketed reads behind the heatmap and the chart envelope, a run's
  per-process records;
* ``suspected.py``: the OOMs suspected from device memory, kept as the run-life fold keeps them.
"""

from vramwatch.collector.store.core import (
    WAL_AUTOCHECKPOINT_PAGES,
    WAL_SIZE_LIMIT_BYTES,
    InsertResult,
    RetentionResult,
    Store,
    default_db_path,
    thread_reader,
)
from vramwatch.collector.store.errors import (
    RunFullError,
    StoreBusyError,
    StoreCloseError,
    StoreError,
    StoreLockedError,
    StoreReadError,
)
from vramwatch.collector.store.reads import SeriesRow
from vramwatch.collector.store.schema import (
    FIELD_COLUMNS,
    MIGRATIONS,
    SAMPLE_COLUMNS,
    SCHEMA_VERSION,
    SERIES_OPTIONAL,
    TRAIN_PHASE_ID,
)
from vramwatch.collector.store.suspected import SuspectedReport

__all__ = [
    "FIELD_COLUMNS", "MIGRATIONS", "SAMPLE_COLUMNS", "SCHEMA_VERSION", "SERIES_OPTIONAL", "TRAIN_PHASE_ID",
    "WAL_AUTOCHECKPOINT_PAGES", "WAL_SIZE_LIMIT_BYTES", "InsertResult", "RetentionResult", "RunFullError",
    "SeriesRow", "Store", "StoreBusyError", "StoreCloseError", "StoreError", "StoreLockedError", "StoreReadError",
    "SuspectedReport", "default_db_path", "thread_reader",
]
