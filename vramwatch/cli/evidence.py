"""``vramwatch capture``, ``vramwatch postmortem``, ``vramwatch last-words`` and ``vramwatch snapshots
diff`` (registered by :mod:`vramwatch.cli`)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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
    from vramwatch.collector.ingest.processes import ProcessBook
    from vramwatch.collector.snapshots.diffs import DiffCache, enrich_postmortem
    from vramwatch.collector.snapshots.directives import SnapshotStore
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
                              silent_after_s=args.silent_after, kept_suspected=store.suspected_records(args.run))
    finally:
        store.close()
    snapshots = SnapshotStore.beside(db)
    enrich_postmortem(pm, snapshots=snapshots, diffs=DiffCache(snapshots), processes=ProcessBook.beside(db))
    if args.json:
        sys.stdout.write(json.dumps(pm.to_dict(), default=_plain) + "\n")
    else:
        print(postmortem.render_text(pm))
    return 0


def cmd_last_words(args: argparse.Namespace) -> int:
    """What dead processes left beside the spool: list it, or (``--send``) post each as its
    process's last words and remove the files."""
    from vramwatch import remote
    from vramwatch.config import Config
    from vramwatch.delivery import spool_prefix
    from vramwatch.evidence.last_words import dead_processes
    from vramwatch.identity import resolve

    try:
        folder = Path(args.spool_dir) if args.spool_dir else Config.from_env().spool_root()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    records = dead_processes(folder, spool_prefix, host=resolve()["host"])
    said = [r.sample for r in records if r.sample is not None]
    if args.send and said:
        try:
            cli_call("last-words", args.url, lambda url: remote.post_json(url, "/api/v1/samples", said),
                     "ingest answer")
        except Outage:
            return 1
    if args.send:
        for record in records:
            record.remove()
    if args.json:
        sys.stdout.write(json.dumps({"spool_dir": str(folder), "sent": bool(args.send), "last_words": said,
                                     "refused": sum(r.refused for r in records)}) + "\n")
        return 0
    for s in said:
        print(f"{s['run']} rank {s['rank']} ({s['host']}, process {s['incarnation']}) at step {s['step']}: "
              f"{s['last_words_type']}: {s.get('last_words_message', '')} [phase {s['last_words_phase']}]"
              + (" — sent" if args.send else ""))
    if not said:
        print(f"no dead process left last words in {folder}")
    return 0


def _plain(value: Any) -> Any:
    return str(value)


_SNAPSHOT_ID = re.compile(r"[0-9a-f]{32}\Z")


@dataclass(frozen=True)
class _Loaded:
    name: str
    step: int | None
    snapshot: dict[str, Any]


def _load(arg: str, args: argparse.Namespace) -> _Loaded:
    """A snapshot file (plain or gzip pickle), or a snapshot id from ``--url`` or the database."""
    from vramwatch.evidence import safe_pickle

    limit = args.max_mib * 2**20
    if Path(arg).is_file() or not _SNAPSHOT_ID.match(arg):
        try:
            return _Loaded(arg, None, safe_pickle.read_snapshot(arg, max_bytes=limit))
        except FileNotFoundError:
            raise UsageError(f"cannot read {arg}: no such file (a snapshot id is 32 hex digits)") from None
        except OSError as exc:
            raise UsageError(f"cannot read {arg}: {exc.strerror}") from None
    if args.url:
        from vramwatch import remote

        raw = cli_call("snapshots diff", args.url, lambda url: remote.get_bytes(url, f"/api/v1/snapshots/{arg}",
                                                                               max_bytes=limit), "snapshot")
        return _Loaded(f"snapshot {arg}", None, safe_pickle.load_snapshot(raw, max_bytes=limit))
    from vramwatch.collector.snapshots.directives import SnapshotError, SnapshotStore

    try:
        info, path = SnapshotStore.beside(db_path(args)).open(arg)
    except SnapshotError as exc:
        raise UsageError(f"{exc} beside {db_path(args)}") from None
    return _Loaded(f"rank {info.rank} step {info.step}", info.step, safe_pickle.read_snapshot(path, max_bytes=limit))


def cmd_snapshots_diff(args: argparse.Namespace) -> int:
    from vramwatch.evidence.safe_pickle import UnsafePickle, paused_gc
    from vramwatch.evidence.snapshot_diff import SnapshotFormatError, diff, render_text

    try:
        with paused_gc():
            old, new = _load(args.old, args), _load(args.new, args)
            result = diff(old.snapshot, new.snapshot, skip=args.skip, top=args.top)
    except UnsafePickle as exc:
        raise UsageError(f"refusing to load a snapshot: {exc}") from None
    except (SnapshotFormatError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    except Outage:
        return 1
    if args.json:
        doc = result.to_dict()
        doc["old"], doc["new"] = ({"source": x.name, "step": x.step} for x in (old, new))
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        print(render_text(result, old_name=old.name, new_name=new.name))
    return 0


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
    p.add_argument("--silent-after", type=positive(float), default=None, metavar="SECONDS",
                   help="one silence window for every rank (default: each rank's own, from its step time, "
                        "as every view and the HookSilent alert)")
    p.set_defaults(func=cmd_postmortem)

    p = sub.add_parser("last-words", help="crash records dead processes left beside the spool; --send posts them")
    p.add_argument("--spool-dir", help="the hooks' spool folder (default: $VRAMWATCH_SPOOL_DIR or the cache dir)")
    p.add_argument("--send", action="store_true",
                   help="post each as its process's last words to the collector, then remove the files")
    p.add_argument("--url", help="collector URL for --send (default $VRAMWATCH_URL or http://127.0.0.1:8765)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.set_defaults(func=cmd_last_words)

    group = sub.add_parser("snapshots", help="allocator snapshots: what grew between two, by allocation site")
    ssub = group.add_subparsers(dest="snapshots_command", metavar="SUBCOMMAND", parser_class=type(group))
    ssub.required = True
    p = ssub.add_parser("diff", help="live memory per allocation site in two snapshots, sorted by growth")
    p.add_argument("old", help="a snapshot file (plain or gzip pickle) or a snapshot id (with --db / --url)")
    p.add_argument("new", help="the later snapshot")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--top", type=positive(int), default=None, metavar="N", help="only the N largest changes")
    p.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                   help="frames whose file name matches this glob anywhere (* and ?) are not a site (repeatable; "
                        "e.g. your framework: --skip site-packages/lightning/)")
    add_db(p)
    p.add_argument("--url", help="read snapshot ids from a collector or a federating front")
    p.add_argument("--max-mib", type=positive(int), default=512, metavar="MIB",
                   help="refuse a snapshot larger than this once inflated (default 512)")
    p.set_defaults(func=cmd_snapshots_diff)
