"""Where the shards are: a fixed list, a file re-read when it changes, or Prometheus targets.

A peer is a collector's base URL (``http://node-7:8765``, or with a path prefix behind a
proxy). Its shard name is ``host:port`` plus the path, unless the file gives ``name=url``.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


class PeerError(ValueError):
    """A peer list that cannot be used; the message names the entry."""


@dataclass(frozen=True)
class Peer:
    name: str
    url: str  # base URL without a trailing slash


def _is_http_url(text: str) -> bool:
    parts = urllib.parse.urlsplit(text)
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def parse_peer(text: str) -> Peer:
    text = text.strip()
    name = None
    if "=" in text and not text.startswith(("http://", "https://")):
        name, text = (part.strip() for part in text.split("=", 1))
    parts = urllib.parse.urlsplit(text)
    if not _is_http_url(text):
        raise PeerError(f"peers: {text!r} is not an http(s) URL")
    url = text.rstrip("/")
    return Peer(name or (parts.netloc + parts.path.rstrip("/")), url)


def parse_peers(items: list[str]) -> list[Peer]:
    peers = [parse_peer(item) for item in items if item.strip() and not item.strip().startswith("#")]
    names = [p.name for p in peers]
    if len(set(names)) != len(names):
        raise PeerError(f"peers: duplicate shard names in {names}")
    return peers


class PeerSource:
    """The current peer list. ``current()`` is cheap: a file is re-read only when its mtime
    changes; Prometheus targets at most every ``refresh_s``. A bad new file keeps the old list."""

    def __init__(self, *, static: list[Peer] | None = None, file: str | None = None,
                 prometheus: str | None = None, job: str = "vramwatch", refresh_s: float = 30.0) -> None:
        if prometheus is not None and not _is_http_url(prometheus):
            raise PeerError(f"--peers-prometheus: {prometheus!r} is not an http(s) URL")
        self._static = static or []
        self._file = Path(file) if file else None
        self._prometheus = prometheus.rstrip("/") if prometheus else None
        self._job = job
        self._refresh_s = refresh_s
        self._mtime: float | None = None
        self._from_file: list[Peer] = []
        self._from_prom: list[Peer] = []
        self._prom_at = float("-inf")
        self._lock = threading.Lock()
        if self._file is not None:
            self._reload_file(strict=True)

    def _reload_file(self, strict: bool = False) -> None:
        assert self._file is not None
        try:
            mtime = os.stat(self._file).st_mtime
            if mtime == self._mtime:
                return
            peers = parse_peers(self._file.read_text(encoding="utf-8").replace(",", "\n").splitlines())
        except (OSError, PeerError, UnicodeDecodeError) as exc:
            if strict:
                raise PeerError(f"--peers-file {self._file}: {exc}") from None
            return  # keep the last good list
        self._mtime, self._from_file = mtime, peers

    def _discover(self) -> None:
        try:
            reply = httpx.get(f"{self._prometheus}/api/v1/targets", params={"state": "active"}, timeout=5)
            peers = self._peers_of(reply.json()["data"]["activeTargets"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            # Prometheus away, or an answer of another shape (not a list of target objects: it
            # failed every front request): keep the last list
            return
        self._from_prom = sorted(set(peers), key=lambda p: p.name)

    def _peers_of(self, targets: list[dict[str, Any]]) -> list[Peer]:
        peers = []
        for target in targets:
            if target.get("labels", {}).get("job") != self._job:
                continue
            scrape = urllib.parse.urlsplit(target.get("scrapeUrl", ""))
            base = scrape.path.removesuffix("/metrics")
            peers.append(Peer(scrape.netloc + base, f"{scrape.scheme}://{scrape.netloc}{base}"))
        return peers

    def current(self) -> list[Peer]:
        with self._lock:
            if self._file is not None:
                self._reload_file()
            if self._prometheus and time.monotonic() - self._prom_at > self._refresh_s:
                self._prom_at = time.monotonic()
                self._discover()
            seen: dict[str, Peer] = {}
            for peer in [*self._static, *self._from_file, *self._from_prom]:
                seen.setdefault(peer.name, peer)
            return list(seen.values())
