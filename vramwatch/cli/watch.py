"""``vramwatch watch``: verdicts for every GPU in Prometheus (dcgm-exporter), no code change.

The command line only; the polling itself is :mod:`vramwatch.collector.exporters.device_watch`, a collector
lifespan hook.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from vramwatch.cli.common import UsageError, db_path, read_token
from vramwatch.collector.exporters.device_watch import DEFAULT_RUN, WatchConfig, lifespan_hook


def add_parser(sub: Any, add_db: Callable[[argparse.ArgumentParser], None], port: Callable, positive: Callable) -> None:
    """Register ``vramwatch watch``."""
    p = sub.add_parser("watch", help="verdicts for every GPU in Prometheus (dcgm-exporter), no code change")
    p.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus base URL (http://prom:9090)")
    p.add_argument("--selector", default="", metavar="MATCHERS",
                   help='label matchers narrowing the dcgm series, e.g. \'Hostname=~"gpu-.*"\'')
    p.add_argument("--run", default=DEFAULT_RUN, help=f"run name the GPUs are shown under (default {DEFAULT_RUN})")
    p.add_argument("--interval", type=positive(float), default=15.0, metavar="SECONDS",
                   help="poll interval and query resolution (default 15: dcgm-exporter's default)")
    p.add_argument("--lookback", type=positive(float), default=3600.0, metavar="SECONDS",
                   help="history read at start (default 3600)")
    p.add_argument("--prometheus-timeout", type=positive(float), default=10.0, metavar="SECONDS",
                   help="a query's whole answer must arrive within this (default 10)")
    p.add_argument("--max-answer-mb", type=positive(float), default=64.0, metavar="MB",
                   help="the largest query answer read (inflated); narrow --selector past it (default 64)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8765, help="port (default 8765)")
    add_db(p)
    p.add_argument("--token-file", metavar="FILE", help="bearer token for ingest (else $VRAMWATCH_TOKEN), as serve")
    p.add_argument("--otlp-endpoint", metavar="URL", help="also push metrics over OTLP/HTTP (as serve)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_watch)


def cmd_watch(args: argparse.Namespace) -> int:
    from vramwatch.collector.server import serve
    from vramwatch.collector.serving.app import Settings
    from vramwatch.collector.store import StoreError

    try:
        config = WatchConfig(args.prometheus, args.selector, args.run, args.interval, args.lookback,
                             timeout_s=args.prometheus_timeout, max_answer_bytes=int(args.max_answer_mb * 2**20))
        hooks: list[Any] = [lifespan_hook(config)]
        if args.otlp_endpoint:
            from vramwatch.collector.exporters.otlp import lifespan_hook as otlp_hook

            hooks.append(otlp_hook(args.otlp_endpoint))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    settings = Settings(db_path=db_path(args), token=read_token(args), lifespan_hooks=tuple(hooks))
    try:
        serve(settings, host=args.host, port=args.port, log_level=args.log_level)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    return 0
