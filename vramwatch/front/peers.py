"""Where the shards are: a fixed list, a file re-read when it changes, or Prometheus targets.

A peer is a collector's base URL (``http://node-7:8765``, or with a path prefix behind a
proxy). Its shard name is ``host:port`` plus the path, unless the file gives ``name=url``.

Credentials go only where the operator pointed: a peer named on the command line or in the
peers file gets the peer token; a peer discovered from Prometheus gets it only when its host
matches an ``--peer-allow`` pattern, and its base URL is ``scheme://host:port`` whatever path
the target's ``scrapeUrl`` lists (a scrape URL is Prometheus's to choose, not an API root).

Bounds: :meth:`PeerSource.current` never touches the network and holds its lock only for a
``stat`` (and, when the file changed, a read of at most :data:`MAX_PEERS_FILE_BYTES`);
discovery runs in the front's background (:meth:`PeerSource.discover`), one bounded request
(``--peer-timeout``-independent deadline :data:`DISCOVERY_DEADLINE_S`, answer at most
:data:`MAX_TARGETS_BYTES`), at most :data:`MAX_DISCOVERED` peers kept.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import os
import threading
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from vramwatch.bounded import FetchError, HttpLimits, LimitExceeded, fetch, read_capped
from vramwatch.errors import VramwatchError

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("vramwatch.front")

MAX_PEERS_FILE_BYTES = 1 << 20
MAX_TARGETS_BYTES = 16 * 2**20
DISCOVERY_DEADLINE_S = 5.0
MAX_DISCOVERED = 10_000


class PeerError(VramwatchError, ValueError):
    """A peer list that cannot be used; the message names the entry."""


@dataclass(frozen=True)
class Peer:
    name: str
    url: str  # base URL without a trailing slash
    #: the peer token may be sent to it: named by the operator, or discovered and allowed
    credentials: bool = True


def _is_http_url(text: str) -> bool:
    try:
        parts = urllib.parse.urlsplit(text)
        _ = parts.port  # raises for a port that is not a number
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def parse_peer(text: str) -> Peer:
    text = text.strip()
    name = None
    if "=" in text and not text.startswith(("http://", "https://")):
        name, text = (part.strip() for part in text.split("=", 1))
    if not _is_http_url(text):
        raise PeerError(f"peers: {text!r} is not an http(s) URL")
    parts = urllib.parse.urlsplit(text)
    url = text.rstrip("/")
    return Peer(name or (parts.netloc + parts.path.rstrip("/")), url)


def parse_peers(items: list[str]) -> list[Peer]:
    peers = [parse_peer(item) for item in items if item.strip() and not item.strip().startswith("#")]
    names = [p.name for p in peers]
    if len(set(names)) != len(names):
        raise PeerError(f"peers: duplicate shard names in {names}")
    return peers


def host_allowed(netloc: str, host: str, patterns: Sequence[str]) -> bool:
    """Whether a discovered peer's ``host`` (or ``host:port``) matches an ``--peer-allow`` pattern
    (shell-style, case-insensitive: ``*.gpu.internal``, ``10.0.3.*``, ``node-7:8765``)."""
    host, netloc = host.lower(), netloc.lower()
    return any(fnmatch.fnmatchcase(host, p.lower()) or fnmatch.fnmatchcase(netloc, p.lower()) for p in patterns)


class PeerSource:
    """The current peer list. ``current()`` is cheap and never waits on the network: a file is
    re-read only when its mtime changes; Prometheus targets are refreshed by :meth:`discover`,
    which the front runs in its background every ``refresh_s``. A bad new file or answer keeps
    the old list."""

    def __init__(self, *, static: list[Peer] | None = None, file: str | None = None,
                 prometheus: str | None = None, job: str = "vramwatch", refresh_s: float = 30.0,
                 allow: Sequence[str] = ()) -> None:
        if prometheus is not None and not _is_http_url(prometheus):
            raise PeerError(f"--peers-prometheus: {prometheus!r} is not an http(s) URL")
        self._static = static or []
        self._file = Path(file) if file else None
        self.prometheus = prometheus.rstrip("/") if prometheus else None
        self._job = job
        self.refresh_s = refresh_s
        self.allow = tuple(allow)
        self._mtime: float | None = None
        self._from_file: list[Peer] = []
        self._from_prom: list[Peer] = []
        self._lock = threading.Lock()  # the file's re-read only: never held across the network
        if self._file is not None:
            self._reload_file(strict=True)

    @property
    def reads_files(self) -> bool:
        """Whether :meth:`current` may read a file (then call it off the event loop)."""
        return self._file is not None

    def _reload_file(self, strict: bool = False) -> None:
        assert self._file is not None
        try:
            mtime = os.stat(self._file).st_mtime
            if mtime == self._mtime:
                return
            with open(self._file, "rb") as fh:
                text = read_capped(fh, MAX_PEERS_FILE_BYTES, str(self._file), "peers file").decode("utf-8")
            peers = parse_peers(text.replace(",", "\n").splitlines())
        except (OSError, PeerError, UnicodeDecodeError, LimitExceeded) as exc:
            if strict:
                raise PeerError(f"--peers-file {self._file}: {exc}") from None
            return  # keep the last good list
        self._mtime, self._from_file = mtime, peers

    async def discover(self, client: httpx.AsyncClient) -> bool:
        """One refresh of the Prometheus targets (bounded: :data:`DISCOVERY_DEADLINE_S`,
        :data:`MAX_TARGETS_BYTES`); the JSON is decoded off the event loop. Returns whether
        the list was replaced (False: Prometheus away or an answer of another shape, the last
        list kept)."""
        if self.prometheus is None:
            return False
        limits = HttpLimits(DISCOVERY_DEADLINE_S, MAX_TARGETS_BYTES, "discovery deadline", "discovery answer limit")
        try:
            reply = await fetch(client, "GET", f"{self.prometheus}/api/v1/targets", limits,
                                params={"state": "active"})
            if reply.status != 200:
                raise FetchError(f"{self.prometheus} answered {reply.status}")
            targets = await asyncio.to_thread(lambda: orjson.loads(reply.body)["data"]["activeTargets"])
            peers = self._peers_of(targets)
        except (FetchError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("peer discovery from %s failed: %s (keeping %d peers)", self.prometheus,
                        str(exc)[:300], len(self._from_prom))
            return False
        self._from_prom = sorted(set(peers), key=lambda p: p.name)
        return True

    async def keep_discovering(self, client: httpx.AsyncClient) -> None:
        """:meth:`discover` every ``refresh_s`` until cancelled (the front's lifespan runs it)."""
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.discover(client)

    def _peers_of(self, targets: list[dict[str, Any]]) -> list[Peer]:
        peers: dict[str, Peer] = {}
        for target in targets:
            if not isinstance(target, dict) or (target.get("labels") or {}).get("job") != self._job:
                continue
            scrape = str(target.get("scrapeUrl", ""))
            if not _is_http_url(scrape):
                continue
            parts = urllib.parse.urlsplit(scrape)
            base = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"  # never a path, never userinfo
            netloc = base.split("://", 1)[1]
            peers[netloc] = Peer(netloc, base, host_allowed(netloc, parts.hostname or "", self.allow))
            if len(peers) >= MAX_DISCOVERED:
                log.warning("peer discovery: more than %d targets; the rest are ignored", MAX_DISCOVERED)
                break
        return list(peers.values())

    def current(self) -> list[Peer]:
        if self._file is not None:
            with self._lock:
                self._reload_file()
        seen: dict[str, Peer] = {}
        for peer in [*self._static, *self._from_file, *self._from_prom]:
            seen.setdefault(peer.name, peer)
        return list(seen.values())
