"""``vramwatch`` command line. Bad arguments or input: one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vramwatch.cli.common import (
    Outage,
    Parser,
    UsageError,
    add_db,
    cli_call,
    db_parent_exists,
    db_path,
    existing_files,
    non_negative,
    output,
    port,
    port_is_free,
    positive,
    read_secret,
    read_token,
)
from vramwatch.errors import VramwatchError

# ---------------------------------------------------------------- commands

def cmd_front(args: argparse.Namespace) -> int:
    """``serve --peers``: the federating front over node-local collectors (stores nothing).
    A front that holds a peer token asks its readers for the token too (its shards require
    read credentials, or it would need none): with a peer token and no token of its own it
    refuses to start."""
    from vramwatch.front import FrontSettings, PeerSource, parse_peers
    from vramwatch.front.server import serve_front

    source = PeerSource(static=parse_peers(args.peers.split(",")) if args.peers else None,
                        file=args.peers_file, prometheus=args.peers_prometheus, job=args.peers_job,
                        allow=args.peer_allow or ())
    if not source.current() and not args.peers_prometheus:
        raise UsageError("--peers: no peer given")
    token = read_token(args)
    peer_token = (read_secret("--peer-token-file", args.peer_token_file) or None) if args.peer_token_file else token
    if peer_token and args.peers_prometheus and not args.peer_allow:
        logging.getLogger("vramwatch").warning(
            "peers discovered from %s get no token: name the hosts that may with --peer-allow", args.peers_prometheus)
    try:
        settings = FrontSettings(
            peers=source, token=token if (args.auth_read or peer_token) else None, peer_token=peer_token,
            timeout_s=args.peer_timeout, bind_host=args.host,
            allowed_hosts=tuple(args.allowed_host) if args.allowed_host else None,
            header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
            max_connections=args.max_connections, max_peer_bytes=int(args.peer_max_mb * 2**20),
            max_concurrent_peers=args.peer_concurrency)
    except ValueError as exc:
        raise UsageError(f"--peer-token-file: {exc}" if args.peer_token_file else str(exc)) from None
    print(f"vramwatch front: http://{args.host}:{args.port}/  shards={len(source.current())}", file=sys.stderr)
    try:
        serve_front(settings, host=args.host, port=args.port, log_level=args.log_level)
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.peers or args.peers_file or args.peers_prometheus:
        if args.otlp_endpoint:
            raise UsageError("--otlp-endpoint: a federating front holds no ranks; set it on each collector")
        return cmd_front(args)
    from vramwatch.collector.server import serve
    from vramwatch.collector.serving.app import Settings
    from vramwatch.collector.serving.guard import http_protocol

    token = read_token(args)
    hooks = ()
    if args.otlp_endpoint:  # push per-rank metrics over OTLP/HTTP (vramwatch/collector/exporters/otlp.py)
        from vramwatch.collector.exporters.otlp import lifespan_hook

        try:
            hooks = (lifespan_hook(args.otlp_endpoint, args.otlp_interval),)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if args.db:  # the arguments first, then what they name on this machine
        db_parent_exists(args.db, args.create_db_dir)
    port_is_free(args.host, args.port)  # before anything is opened or printed
    try:  # every setting a flag reaches is range-checked once, by Settings: its refusal names the field
        settings = Settings(db_path=db_path(args), token=token, auth_read=args.auth_read, lifespan_hooks=hooks,
                            finished_after_s=args.finished_after, silent_after_s=args.silent_after,
                            max_samples_per_run=args.max_samples_per_run or None,
                            retention_days=args.retention_days or None,
                            min_free_bytes=int(args.min_free_mb * 1024 * 1024),
                            max_series=args.max_series, max_ranks_per_run=args.max_ranks_per_run,
                            max_connections=args.max_connections, header_timeout_s=args.header_timeout,
                            body_timeout_s=args.body_timeout, shutdown_timeout_s=args.shutdown_timeout,
                            allowed_hosts=tuple(args.allowed_host) if args.allowed_host else None,
                            max_snapshots=args.max_snapshots, max_snapshots_bytes=int(args.snapshots_max_mb * 2**20),
                            max_concurrent_uploads=args.max_concurrent_uploads,
                            capture_interval_s=args.capture_interval)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.auth_read and not token:
        raise UsageError("--auth-read needs a token (VRAMWATCH_TOKEN or --token-file)")
    if args.host in ("0.0.0.0", "::") and not token:
        logging.getLogger("vramwatch").warning(
            "listening on %s without a token: anyone on the network can write samples. "
            "Set VRAMWATCH_TOKEN or --token-file.", args.host)
    try:
        http_protocol(args.http)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        serve(settings, host=args.host, port=args.port, log_level=args.log_level, http=args.http)
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from vramwatch.cli.demo import check_arguments, run_demo
    from vramwatch.simulation.demo_runs import DEFAULT, listing

    if args.list:
        sys.stdout.write(listing())
        return 0
    name = args.scenario or DEFAULT
    try:
        check_arguments(args.ranks, args.steps_per_s, args.duration, name)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.db:
        db_parent_exists(args.db, args.create_db_dir)
    port_is_free(args.host, args.port)
    if args.db:  # opened as the collector will open it (its checks, its contents'): one line, not a traceback
        from vramwatch.collector.store import Store, StoreError

        try:
            Store(args.db).close()
        except StoreError as exc:
            raise UsageError(str(exc)) from None
    run_demo(ranks=args.ranks, duration=args.duration, port=args.port, db=args.db,
             steps_per_s=args.steps_per_s, host=args.host, scenario_name=name)
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    import orjson

    from vramwatch.engine.analyze import analyze_paths, format_table

    if args.source != "jsonl":  # other tools' files (vramwatch/importers)
        from vramwatch.cli.importers import cmd_analyze as analyze_imported

        doc = analyze_imported(args, UsageError)
    else:
        paths = existing_files(args.paths)
        try:
            doc = analyze_paths([str(p) for p in paths], strict=args.strict, max_line_bytes=args.max_line_bytes)
        except (OSError, EOFError) as exc:
            raise UsageError(f"cannot read trace: {exc}") from None
    if doc["skipped_lines"] and not doc["series"]:
        first = doc["bad_lines"][0] if doc["bad_lines"] else "?"
        raise UsageError(f"no valid sample in {doc['skipped_lines']:,} lines; the first bad one: {first}")
    if doc["skipped_lines"]:
        print(f"skipped {doc['skipped_lines']} bad lines (--strict stops at the first): "
              + "; ".join(doc["bad_lines"][:3]), file=sys.stderr)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
    else:
        sys.stdout.write(format_table(doc) + "\n")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from vramwatch.collector.store import Store
    from vramwatch.wire import WireError

    if args.source != "jsonl":  # other tools' files (vramwatch/importers)
        from vramwatch.cli.importers import cmd_import as import_other

        return import_other(args, db_path(args), UsageError)
    from vramwatch.cli.importers import ImportSuspicions, report_skipped
    from vramwatch.importers import ImportStats

    paths = existing_files(args.paths)
    check = ImportStats(skip_invalid=True)
    on_bad = check.bad if args.skip_invalid else None  # counts and names the first few bad lines
    try:
        # pass 1: validate everything, so bad input changes nothing (unless --skip-invalid)
        total = sum(1 for _ in _trace_samples(paths, on_bad, args.max_line_bytes))
        check.rows = total + check.skipped
        store = Store(db_path(args))
    except WireError as exc:
        raise UsageError(f"{exc} (nothing imported; use --skip-invalid to skip bad rows)") from None
    suspicions = ImportSuspicions()
    try:
        accepted, duplicates = store.insert_stream(suspicions.judged(_trace_samples(
            paths, (lambda e: None) if on_bad else None, args.max_line_bytes)))
        suspicions.keep(store)
    finally:
        store.close()
    report_skipped(check, "import")
    print(f"imported {accepted} samples ({duplicates} already present) of {total} into {store.path}",
          file=sys.stderr)
    return 0


def _trace_samples(paths: Sequence[Path], on_bad: Any, max_line_bytes: int) -> Iterator[Any]:
    """Every sample of the trace files (``wire.iter_samples``); a file that cannot be read at all
    (truncated gzip, a directory) is a UsageError naming it."""
    from vramwatch.wire import iter_samples

    for path in paths:
        try:
            yield from iter_samples(path, on_bad, max_line_bytes)
        except (OSError, EOFError) as exc:
            raise UsageError(f"cannot read {path}: {exc}") from None


def cmd_export(args: argparse.Namespace) -> int:
    from vramwatch.collector.store import Store
    from vramwatch.wire import encode

    store = Store(db_path(args), readonly=True)
    try:
        if args.run not in store.runs():
            raise UsageError(f"no run named {args.run!r} in {store.path}")
        with output(args.out) if args.out else contextlib.nullcontext(sys.stdout.buffer) as out:
            count = 0
            for sample in store.iter_samples(args.run):
                out.write(encode(sample) + b"\n")
                count += 1
            out.flush()
    finally:
        store.close()
    print(f"exported {count} samples of run {args.run!r}", file=sys.stderr)
    return 0


def _remote_report(args: argparse.Namespace) -> str | None:
    from vramwatch.report import render_report, report_data_remote

    try:
        data = cli_call("report", args.url, lambda url: report_data_remote(url, args.run),
                               f"document for the report of {args.run!r}")
    except Outage:
        return None
    return render_report(data)


def cmd_report(args: argparse.Namespace) -> int:
    from vramwatch.collector.store import Store
    from vramwatch.report import build_report

    if args.url:
        page = _remote_report(args)
        if page is None:
            return 1
        return _write_report(args.out, page)
    db = db_path(args)
    store = Store(db, readonly=True)
    try:
        known = store.runs()
    finally:
        store.close()
    if args.run not in known:
        raise UsageError(f"no run named {args.run!r} in {db}")
    return _write_report(args.out, build_report(db, args.run))


def _write_report(out: str, page: str) -> int:
    with output(out) as fh:
        fh.write(page.encode("utf-8"))
    print(f"wrote {out} ({len(page) // 1024} KiB)", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- parser

def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the collector (HTTP ingest, API, dashboard, /metrics)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8765, help="port (default 8765)")
    add_db(p, create=True)
    p.add_argument("--token-file", metavar="FILE", help="bearer token for ingest (else $VRAMWATCH_TOKEN)")
    p.add_argument("--auth-read", action="store_true", help="require the token for the dashboard and read API too")
    p.add_argument("--finished-after", type=positive(float), default=3600.0, metavar="SECONDS",
                   help="runs silent this long leave /metrics (default 3600)")
    p.add_argument("--silent-after", type=positive(float), default=None, metavar="SECONDS",
                   help="one silence window for every rank (default: each rank's own, ten of its step times, "
                        "30 s to 30 min, at least 1.5x its longest checkpoint)")
    p.add_argument("--max-samples-per-run", type=non_negative(int), default=100_000_000, metavar="N",
                   help="refuse (422) batches that would take a run past N stored samples; 0: no cap "
                        "(default 100000000, about 8 GB)")
    p.add_argument("--retention-days", type=non_negative(float), default=0.0, metavar="DAYS",
                   help="delete samples older than DAYS (checked every minute); 0: keep all (default)")
    p.add_argument("--min-free-mb", type=non_negative(float), default=256.0, metavar="MB",
                   help="refuse ingest (507: hooks spool and retry) while the database's disk has less "
                        "free space (default 256)")
    p.add_argument("--max-series", type=positive(int), default=20_000, metavar="N",
                   help="live series (run, host, rank) held at once; past it batches get 422 (default 20000)")
    p.add_argument("--max-ranks-per-run", type=positive(int), default=16_384, metavar="N",
                   help="series of one run; past it batches get 422 (default 16384)")
    p.add_argument("--max-connections", type=positive(int), default=8192, metavar="N",
                   help="open connections; past it new ones get 503, /healthz still answers (default 8192)")
    p.add_argument("--header-timeout", type=positive(float), default=10.0, metavar="SECONDS",
                   help="a request's headers must arrive within this (default 10)")
    p.add_argument("--body-timeout", type=positive(float), default=10.0, metavar="SECONDS",
                   help="a request's body must arrive within this after its headers (default 10)")
    p.add_argument("--http", choices=["auto", "httptools", "h11"], default="auto",
                   help="HTTP parser: httptools (C, the default when installed) or h11 (pure Python: about "
                        "twice httptools' CPU for the HTTP layer of a request); auto: httptools when installed")
    p.add_argument("--shutdown-timeout", type=positive(float), default=10.0, metavar="SECONDS",
                   help="on SIGTERM, wait this long for running requests (default 10)")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="a Host header name to serve (repeat; default: loopback names on a loopback bind, "
                        "any name otherwise); other names get 421; IP literals (probes, scrapes by pod IP) "
                        "always pass")
    p.add_argument("--max-snapshots", type=positive(int), default=10_000, metavar="N",
                   help="allocator snapshots kept (oldest evicted first; default 10000)")
    p.add_argument("--snapshots-max-mb", type=positive(float), default=2048.0, metavar="MB",
                   help="disk the snapshots may use, uploads in progress counted (default 2048)")
    p.add_argument("--max-concurrent-uploads", type=positive(int), default=4, metavar="N",
                   help="snapshot uploads received at once; others wait, then 503 (default 4)")
    p.add_argument("--capture-interval", type=non_negative(float), default=60.0, metavar="SECONDS",
                   help="a rank takes a person's capture request at most this often; 429 otherwise (default 60)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--otlp-endpoint", metavar="URL",
                   help="push per-rank memory and verdict metrics to this OTLP/HTTP endpoint (e.g. http://otel:4318)")
    p.add_argument("--otlp-interval", type=positive(float), default=15.0, metavar="SECONDS",
                   help="seconds between OTLP pushes (default 15)")
    front = p.add_argument_group("federating front (stores nothing; see docs/deploy.md)")
    front.add_argument("--peers", metavar="URL[,URL...]", help="serve one dashboard/API over these collectors")
    front.add_argument("--peers-file", metavar="FILE", help="peer URLs (one per line, name=URL allowed); "
                       "re-read when it changes")
    front.add_argument("--peers-prometheus", metavar="URL", help="discover peers from this Prometheus's targets")
    front.add_argument("--peers-job", default="vramwatch", help="the scrape job of the collectors (default vramwatch)")
    front.add_argument("--peer-token-file", metavar="FILE", help="token sent to the peers (default: the front's token)")
    front.add_argument("--peer-timeout", type=positive(float), default=2.0, metavar="SECONDS",
                       help="a shard that does not answer within this (in all, not per read) is shown as "
                            "unreachable (default 2)")
    front.add_argument("--peer-allow", action="append", metavar="PATTERN",
                       help="discovered peers whose host (or host:port) matches get the peer token (repeat; shell "
                            "patterns, e.g. '*.gpu.internal'); others get none")
    front.add_argument("--peer-max-mb", type=positive(float), default=64.0, metavar="MB",
                       help="the largest answer read from a shard (default 64)")
    front.add_argument("--peer-concurrency", type=positive(int), default=64, metavar="N",
                       help="shard requests at once; the rest wait within --peer-timeout (default 64)")
    p.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    from vramwatch.__about__ import __version__
    from vramwatch.cli.importers import add_arguments as add_import_arguments

    parser = Parser(prog="vramwatch", description="Live GPU-memory telemetry for deep-learning training.")
    parser.add_argument("--version", action="version", version=f"vramwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    _add_serve(sub)

    p = sub.add_parser("demo", help="collector + a simulated 8-rank run through the real hook")
    p.add_argument("--ranks", type=positive(int), default=8, help="simulated ranks (default 8)")
    p.add_argument("--duration", type=positive(float), default=None, metavar="SECONDS",
                   help="stop after this long (default: until Ctrl-C)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=0, help="port (default: a free one)")
    p.add_argument("--steps-per-s", type=positive(float), default=10.0, help="simulated steps per second")
    p.add_argument("--scenario", metavar="NAME",
                   help="the story the simulated job tells (--list names them and the default)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    add_db(p, create=True)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("analyze", help="trend verdicts per rank from trace files (.jsonl, .jsonl.gz)")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout (stable contract)")
    p.add_argument("--strict", action="store_true", help="stop at the first bad line (exit 2) instead of skipping it")
    add_import_arguments(p, skip_default=True)
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("import", help="load trace files (or other tools' files: --from) into the database")
    p.add_argument("paths", nargs="+", metavar="PATH")
    add_db(p)
    add_import_arguments(p)
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("export", help="write a run's samples as JSON Lines, exactly as ingested")
    p.add_argument("run")
    add_db(p)
    p.add_argument("--out", metavar="FILE", help="output file (default stdout)")
    p.set_defaults(func=cmd_export)

    from vramwatch.cli.watch import add_parser as add_watch_parser

    add_watch_parser(sub, add_db, port, positive)

    p = sub.add_parser("report", help="self-contained static HTML report of a run")
    p.add_argument("run")
    add_db(p)
    p.add_argument("--out", metavar="FILE", required=True, help="output .html file")
    p.add_argument("--url", help="build it from a collector's or a federating front's API instead of --db")
    p.set_defaults(func=cmd_report)

    from vramwatch.cli.decisions import register as register_decisions
    from vramwatch.cli.evidence import register as register_evidence

    register_decisions(sub, add_db)
    register_evidence(sub, add_db, positive)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except VramwatchError as exc:  # the one mapping: its line names the input or setting, its exit code
        print(f"vramwatch {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
