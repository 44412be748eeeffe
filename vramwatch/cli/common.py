"""What every command shares: the usage error (exit 2, one line), argument parsers that refuse
non-finite numbers, token and database options, output files that appear only complete."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, NoReturn, TypeVar

from vramwatch import remote
from vramwatch.errors import EXIT_USAGE, VramwatchError

T = TypeVar("T")


class UsageError(VramwatchError):
    """Bad arguments or input: reported in one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {value}")
    return value


def finite(value: float, text: str) -> None:
    # float("nan") and float("inf") parse: a NaN compares false with every bound, inf passes "> 0"
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")


def _bounded(kind: type, ok: Callable[[float], bool], refusal: str) -> Callable[[str], float | int]:
    """An argparse type: ``kind(text)``, finite, and ``ok`` of it, else ``refusal`` naming the text."""
    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        finite(value, text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{refusal}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def positive(kind: type) -> Callable[[str], float | int]:
    return _bounded(kind, lambda value: value > 0, "must be positive")


def non_negative(kind: type) -> Callable[[str], float | int]:
    return _bounded(kind, lambda value: value >= 0, "must not be negative")


def existing_files(paths: Sequence[str]) -> list[Path]:
    out = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise UsageError(f"cannot read {p}: no such file")
        out.append(path)
    return out


#: a token file holds one line
MAX_SECRET_BYTES = 64 * 1024


def read_secret(flag: str, path: str) -> str:
    """The stripped text of a token file, else a UsageError naming ``flag`` (unreadable, not UTF-8,
    larger than :data:`MAX_SECRET_BYTES`: a token is a line, the file is never read past that)."""
    from vramwatch.bounded import LimitExceeded, read_capped

    try:
        with open(path, "rb") as fh:
            return read_capped(fh, MAX_SECRET_BYTES, f"{flag} {path}", flag).decode("utf-8").strip()
    except OSError as exc:
        raise UsageError(f"cannot read {flag} {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"cannot read {flag} {path}: not a UTF-8 text file") from None
    except LimitExceeded as exc:
        raise UsageError(f"cannot read {exc.where}: {exc.message}, not a token") from None


@contextlib.contextmanager
def output(path: str) -> Iterator[IO[bytes]]:
    """A binary file that appears at ``path`` only complete: written beside it under a temporary
    name and renamed when the block ends without an exception (else removed), so a failed or
    interrupted command never leaves a half-written file. A path that cannot be written (missing
    or read-only directory, a directory) is a UsageError naming it."""
    target = Path(path)
    try:
        if target.is_dir():
            raise IsADirectoryError(21, "Is a directory")
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None
    try:
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # what open() would have made, not mkstemp's 0600
        with os.fdopen(fd, "wb") as fh:
            yield fh
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_token(args: argparse.Namespace) -> str | None:
    if getattr(args, "token_file", None):
        token = read_secret("--token-file", args.token_file)
        if not token:
            raise UsageError(f"--token-file {args.token_file} is empty")
        return token
    raw = os.environ.get("VRAMWATCH_TOKEN")
    token = raw.strip() if raw else None
    if raw and token != raw:
        logging.getLogger("vramwatch").warning(
            "VRAMWATCH_TOKEN has leading or trailing whitespace; using it stripped")
    return token or None


def db_path(args: argparse.Namespace) -> str:
    from vramwatch.collector.store import default_db_path

    return str(args.db) if args.db else str(default_db_path())


def port_is_free(host: str, port: int) -> None:
    """UsageError (exit 2, one line) when ``host:port`` cannot be listened on: checked before a
    server opens its database or prints a URL, so a busy port says nothing misleading first.
    Port 0 (any free port) always passes. Cost: one bind and close."""
    import errno
    import socket

    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            why = "already in use (another collector or demo?)" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise UsageError(f"--port: cannot listen on {host}:{port}: {why}; pick another, or --port 0 "
                             "for any free one") from None


def db_parent_exists(path: str, create: bool) -> None:
    """UsageError when the database's directory does not exist (a typo in ``--db``) unless
    ``create``: then it is made. An existing directory is never touched."""
    parent = Path(path).expanduser().parent
    try:
        if parent.is_dir():
            return
    except OSError as exc:  # a name too long, a loop of links: what the path names cannot be looked at
        raise UsageError(f"--db: cannot use {str(parent)[:200]!r}: {exc.strerror}") from None
    if not create:
        raise UsageError(f"--db: directory {parent} does not exist (a typo? --create-db-dir makes it)")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--db: cannot create {parent}: {exc.strerror}") from None


def add_db(p: argparse.ArgumentParser, *, create: bool = False) -> None:
    p.add_argument("--db", metavar="PATH", help="SQLite database (default: $VRAMWATCH_DB or the user data dir)")
    if create:
        p.add_argument("--create-db-dir", action="store_true",
                       help="make the --db file's directory when it does not exist (else: an error)")


class Outage(Exception):
    """The collector or front could not be reached (a CLI exits 1; a 4xx is the caller's error: exit 2)."""


def cli_call(command: str, url: str | None, call: Callable[[str], T], what: str = "answer") -> T:
    """Run ``call(remote.base_url(url))`` for CLI ``command``: a bad URL, a 4xx, or an answer ``call``
    cannot read (not JSON, or JSON of the wrong shape: ``call`` should read everything it
    needs, so a malformed ``what`` is caught here) raises the CLI's UsageError (exit 2, one
    line); an outage prints one line and raises :class:`Outage`."""
    try:
        base = remote.base_url(url)
        remote.check_token()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        return call(base)
    except remote.RemoteError as exc:
        if exc.status is not None and 400 <= exc.status < 500:
            raise UsageError(exc.detail) from None
        print(f"vramwatch {command}: error: {exc.detail}", file=sys.stderr)
        raise Outage from None
    except remote.MALFORMED as exc:
        raise UsageError(f"{base}: not a valid {what} ({type(exc).__name__}: {exc})") from None
