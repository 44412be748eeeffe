"""``--from FORMAT`` for ``vramwatch import`` and ``vramwatch analyze``: arguments and commands.

``vramwatch.cli`` registers the arguments with :func:`add_arguments` and hands any
``--from`` other than ``jsonl`` to :func:`cmd_import` / :func:`cmd_analyze`. Errors are
:class:`UsageError` (one line, exit 2), as everywhere in the CLI.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from vramwatch.importers import (
    CHOICES,
    MAX_LINE_BYTES,
    MAX_RECORD_BYTES,
    NATIVE,
    ImportOptions,
    ImportStats,
    RowError,
    input_paths,
    iter_import,
    parse_size,
)
from vramwatch.wire import Sample

if TYPE_CHECKING:  # the engine and the store load only when an import runs
    from vramwatch.collector.store import Store, SuspectedReport
    from vramwatch.engine import TrendEngine

#: samples per store transaction (as the JSON Lines import)
BATCH = 5000


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rank(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return int(text)


def add_arguments(p: argparse.ArgumentParser, *, skip_default: bool = False) -> None:
    """``--from`` and what the other formats may need that their files do not say."""
    p.add_argument("--from", dest="source", choices=CHOICES, default=NATIVE, metavar="FORMAT",
                   help=f"input format: {', '.join(CHOICES)} (default {NATIVE}; docs/integrations.md)")
    p.add_argument("--skip-invalid", action="store_true", default=skip_default,
                   help="count and skip bad rows instead of stopping at the first"
                        + (" (analyze: the default; --strict stops)" if skip_default else ""))
    p.add_argument("--run", help="run name (default: from the file: its name, W&B's run, 'dcgm')")
    p.add_argument("--host", help="host name when the file does not say (default 'unknown')")
    p.add_argument("--rank", type=_rank, help="rank of a single-rank source (TensorBoard; default 0)")
    p.add_argument("--device-memory", type=_size, metavar="SIZE",
                   help="device capacity (e.g. 80GiB) for sources that do not log it (Megatron, Lightning)")
    p.add_argument("--keys", metavar="FILE", help="extra TensorBoard key table (TOML, see docs/integrations.md)")
    p.add_argument("--max-line-bytes", type=_size, default=MAX_LINE_BYTES, metavar="SIZE",
                   help="the longest line (JSON Lines, CSV row) read; a longer one is a bad row, never held "
                        "whole (default 1MiB)")
    p.add_argument("--max-record-bytes", type=_size, default=MAX_RECORD_BYTES, metavar="SIZE",
                   help="the largest TensorBoard record or Prometheus document read whole (default 64MiB)")


def options(args: argparse.Namespace) -> ImportOptions:
    # analyze skips bad rows by default unless --strict; import is all-or-nothing
    skip = args.skip_invalid and not getattr(args, "strict", False)
    return ImportOptions(run=args.run, host=args.host, rank=args.rank, total_bytes=args.device_memory,
                         skip_invalid=skip, keys_path=args.keys, max_line_bytes=args.max_line_bytes,
                         max_record_bytes=args.max_record_bytes)


class ImportSuspicions:
    """The OOMs the trend engine suspects in an import, as the collector's ingest would have: one
    engine per rank fed the samples as they go to the store (:meth:`judged`), so an imported
    device-only run (dcgm, nvidia-smi) is listed with them without a replay. Costs the engine's
    per-sample time (200,000 nvidia-smi rows: 20.9 s of CPU against 18.9 s without, 1.10x) and one
    engine per rank (about 2 KB), for at most ``max_ranks`` ranks, as many as a collector judges
    by default (``Settings.max_series``): a file naming more (each row a new GPU) is stored whole,
    the ranks past the cap judged when their run is replayed, and one line says so."""

    def __init__(self, max_ranks: int | None = None) -> None:
        from vramwatch.collector.settings import Settings  # not at the CLI's start: only when an import runs

        self._engines: dict[tuple[str, str, int], TrendEngine] = {}
        self.max_ranks = Settings.max_series if max_ranks is None else max_ranks
        self.unjudged = 0  # samples of the ranks past max_ranks
        self.found: list[SuspectedReport] = []

    def judged(self, samples: Iterable[Sample]) -> Iterator[Sample]:
        from vramwatch.engine import TrendEngine
        from vramwatch.runlife import SuspectedOom

        for sample in samples:
            key = (sample["run"], sample["host"], sample["rank"])
            engine = self._engines.get(key)
            if engine is None:
                if len(self._engines) >= self.max_ranks:
                    self.unjudged += 1
                    yield sample
                    continue
                engine = self._engines[key] = TrendEngine()
            for event in engine.update(sample):
                if event["type"] == "suspected_oom":
                    self.found.append((*key, SuspectedOom.of(event, sample["ts"])))
            yield sample

    def keep(self, store: Store) -> None:
        """Store what was suspected (a second import of the same file adds nothing); one line on
        stderr when ranks past the cap were not judged."""
        if self.found:
            store.keep_suspected(self.found)
        if self.unjudged:
            print(f"import: {self.unjudged} samples of ranks past the first {self.max_ranks:,} not judged for "
                  "suspected OOMs (their run's page or report judges them)", file=sys.stderr)


def report_skipped(stats: ImportStats, what: str) -> None:
    """One line on stderr when ``--skip-invalid`` skipped rows: how many, and the first."""
    if stats.skipped:
        print(f"{what}: skipped {stats.skipped} invalid rows of {stats.rows}; first: {stats.errors[0]}",
              file=sys.stderr)


def cmd_analyze(args: argparse.Namespace, usage_error: type[Exception]) -> dict:
    """The analyze document of imported files (the caller prints it); bad rows are skipped unless
    ``--strict``, counted in ``skipped_lines`` and named (the first 20) in ``bad_lines``."""
    from vramwatch.engine.analyze import analyze_samples

    stats = ImportStats()
    try:
        paths = input_paths(args.paths, args.source)
        doc = analyze_samples(iter_import(paths, args.source, options(args), stats))
    except FileNotFoundError as exc:
        raise usage_error(str(exc)) from None
    except RowError as exc:
        raise usage_error(f"{exc} (use --skip-invalid to skip bad rows)") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise usage_error(f"cannot read {args.source} input: {exc}") from None
    # the same keys as a JSON Lines analyze: the CLI reports them (vramwatch.cli)
    doc["skipped_lines"], doc["bad_lines"] = stats.skipped, stats.errors
    return doc


def cmd_import(args: argparse.Namespace, db_path: str, usage_error: type[Exception]) -> int:
    """Validate every row first (nothing is stored when one is bad), then store in batches."""
    from vramwatch.collector.store import Store, StoreError

    opts = options(args)
    try:
        paths = input_paths(args.paths, args.source)
        check = ImportStats()
        total = sum(1 for _ in iter_import(paths, args.source, opts, check))
        store = Store(db_path)
    except FileNotFoundError as exc:
        raise usage_error(str(exc)) from None
    except RowError as exc:
        raise usage_error(f"{exc} (nothing imported; use --skip-invalid to skip bad rows)") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise usage_error(f"cannot read {args.source} input: {exc}") from None
    except StoreError as exc:
        raise usage_error(str(exc)) from None
    suspicions = ImportSuspicions()
    try:
        accepted, duplicates = store.insert_stream(suspicions.judged(iter_import(paths, args.source, opts)), BATCH)
        suspicions.keep(store)
    except StoreError as exc:
        raise usage_error(str(exc)) from None
    finally:
        store.close()
    report_skipped(check, "import")
    print(f"imported {accepted} samples ({duplicates} already present) of {total} from {args.source} "
          f"into {store.path}", file=sys.stderr)
    return 0
