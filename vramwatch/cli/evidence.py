"""``vramwatch capture`` and ``vramwatch postmortem`` (registered by :mod:`vramwatch.cli`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from vramwatch.cli.common import Outage, UsageError, cli_call, db_path


def cmd_capture(args: argparse.Namespace) -> int:
    from vramwatch import remote

    body: dict[str, Any] = {"steps": args.steps}
    if args.rank is not None:
        body["rank"] = args.rank

    def ask(url: str) -> str:
        answer = remote.post_json(url, remote.run_path(args.run, "capture"), body, timeout=10)
        return ", ".join(str(int(r)) for r in answer.get("ranks", []))

    try:
        ranks = cli_call("capture", args.url, ask, "capture answer")
    except Outage:
        return 1
    print(f"capture of {args.steps} steps requested from rank(s) {ranks} of {args.run!r}: each rank records "
          f"allocator history at its next ingest reply; snapshots appear under /api/v1/runs/<run>/snapshots")
    return 0


def _remote_postmortem(args: argparse.Namespace) -> int:
    from vramwatch import remote
    from vramwatch.evidence import postmortem

    path = remote.run_path(args.run, "postmortem")

    def ask(url: str) -> str:
        # read (and render) the whole answer before printing any of it
        doc = remote.get_json(url, path, {"silent_after_s": args.silent_after})
        text = postmortem.render_text(postmortem.from_dict(doc))
        return json.dumps(doc) + "\n" if args.json else text + "\n"

    try:
        out = cli_call("postmortem", args.url, ask, f"postmortem document for {args.run!r}")
    except Outage:
        return 1
    sys.stdout.write(out)
    return 0


def cmd_postmortem(args: argparse.Namespace) -> int:
    from vramwatch.evidence import postmortem

    if args.url:
        return _remote_postmortem(args)
    from vramwatch.collector.snapshots import SnapshotStore
    from vramwatch.collector.store import Store, StoreError

    db = db_path(args)
    try:
        store = Store(db, readonly=True)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    try:
        if args.run not in store.runs():
            raise UsageError(f"no run named {args.run!r} in {db}")
        pm = postmortem.build(args.run, lambda: store.iter_samples(args.run), now=time.time(),
                              silent_after_s=args.silent_after)
    finally:
        store.close()
    pm.snapshots = [i.to_dict() for i in SnapshotStore.beside(db).list(args.run)]
    if args.json:
        sys.stdout.write(json.dumps(pm.to_dict(), default=_plain) + "\n")
    else:
        print(postmortem.render_text(pm))
    return 0


def _plain(value: Any) -> Any:
    return str(value)


def register(sub: Any, add_db: Callable[[argparse.ArgumentParser], None], positive: Any) -> None:
    p = sub.add_parser("capture", help="ask a run's ranks for an allocator snapshot (through the collector)")
    p.add_argument("run")
    p.add_argument("--rank", type=int, default=None, help="one rank (default: every rank of the run)")
    p.add_argument("--steps", type=positive(int), default=5, help="steps of allocator history to record (default 5)")
    p.add_argument("--url", help="collector URL (default $VRAMWATCH_URL or http://127.0.0.1:8765)")
    p.set_defaults(func=cmd_capture)

    p = sub.add_parser("postmortem", help="which rank failed first, when and why; what the others held")
    p.add_argument("run")
    add_db(p)
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--url", help="ask a collector or a federating front instead of reading --db")
    p.add_argument("--silent-after", type=positive(float), default=300.0, metavar="SECONDS",
                   help="a rank silent this long counts as dead (default 300, as the HookSilent alert)")
    p.set_defaults(func=cmd_postmortem)
