"""Concurrent, time-bounded, briefly cached GETs to every shard.

Guarantees: one request to N shards costs at most ``timeout_s`` of wall time whatever the
shards do (each GET has that deadline; they run concurrently on one connection pool); an
identical request within ``cache_ttl_s`` is answered from the cache, so many browser tabs
polling the front cost the shards one request per TTL; a shard that does not answer is
served from its last good answer (``stale``), never blanking the page. Memory: one cached
document per (shard, path, query) still within its TTL plus one last-good document per
(shard, path, query), bounded by ``max_cached``.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from vramwatch.front.merge import ShardAnswer
from vramwatch.front.peers import Peer
from vramwatch.remote import detail_text

#: the largest document read from a shard (a 4,096-rank /ranks page is a few MB)
MAX_PEER_BYTES = 64 * 2**20


def _detail(reply: httpx.Response) -> str:
    """A shard's error message as one line that still names the field (:func:`detail_text`)."""
    try:
        detail = reply.json().get("detail", reply.text)
    except (ValueError, AttributeError):
        detail = reply.text
    return detail_text(detail)


class Fanout:
    def __init__(self, *, token: str | None = None, timeout_s: float = 2.0, cache_ttl_s: float = 1.0,
                 max_cached: int = 4096, registry: CollectorRegistry | None = None) -> None:
        self.timeout_s = timeout_s
        self.cache_ttl_s = cache_ttl_s
        self.max_cached = max_cached
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout_s,
                                         limits=httpx.Limits(max_connections=256, max_keepalive_connections=128))
        self._fresh: OrderedDict[tuple[str, str, str], tuple[float, ShardAnswer]] = OrderedDict()
        self._last_good: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self._inflight: dict[tuple[str, str, str], asyncio.Future[ShardAnswer]] = {}
        registry = registry or CollectorRegistry()
        self.requests = Counter("vramwatch_front_peer_requests", "Cross-shard requests by outcome",
                                ["shard", "outcome"], registry=registry)
        self.latency = Histogram("vramwatch_front_peer_request_duration_seconds", "Cross-shard request latency",
                                 ["shard"], registry=registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
        self.registry = registry

    async def close(self) -> None:
        await self._client.aclose()

    @staticmethod
    def _key(peer: Peer, path: str, params: dict[str, Any]) -> tuple[str, str, str]:
        return (peer.url, path, "&".join(f"{k}={params[k]}" for k in sorted(params)))

    def _remember(self, store: OrderedDict, key: tuple[str, str, str], value: Any) -> None:
        store[key] = value
        store.move_to_end(key)
        while len(store) > self.max_cached:
            store.popitem(last=False)

    async def _fetch(self, peer: Peer, path: str, params: dict[str, Any], timeout_s: float | None = None
                     ) -> ShardAnswer:
        key = self._key(peer, path, params)
        started = time.perf_counter()
        try:
            timeout = self.timeout_s if timeout_s is None else timeout_s
            reply = await self._client.get(peer.url + path, params=params, timeout=timeout)
            if 400 <= reply.status_code < 500:  # the request was refused, the shard is fine: no stale answer
                status = reply.status_code
                answer = ShardAnswer(peer.name, None, _detail(reply)[:300], status=status)
                self.requests.labels(peer.name, "not_found" if status == 404 else "refused").inc()
                if status == 404:  # "no such run here" is the common answer of most shards: cached
                    self._remember(self._fresh, key, (time.monotonic(), answer))
                return answer
            reply.raise_for_status()
            if len(reply.content) > MAX_PEER_BYTES:
                raise ValueError(f"answer larger than {MAX_PEER_BYTES} bytes")
            data = reply.json()
        except (httpx.HTTPError, ValueError) as exc:
            self.requests.labels(peer.name, "error").inc()
            last = self._last_good.get(key)
            return ShardAnswer(peer.name, last, f"{type(exc).__name__}: {exc}"[:200], stale=last is not None)
        finally:
            self.latency.labels(peer.name).observe(time.perf_counter() - started)
        self.requests.labels(peer.name, "ok").inc()
        answer = ShardAnswer(peer.name, data)
        self._remember(self._fresh, key, (time.monotonic(), answer))
        self._remember(self._last_good, key, data)
        return answer

    async def get_one(self, peer: Peer, path: str, params: dict[str, Any] | None = None, *,
                      timeout_s: float | None = None) -> ShardAnswer:
        """One shard's answer (cached ``cache_ttl_s``); ``timeout_s`` overrides the front's for
        requests a shard may take long to answer the first time (a snapshot diff)."""
        params = params or {}
        key = self._key(peer, path, params)
        cached = self._fresh.get(key)
        if cached is not None and time.monotonic() - cached[0] <= self.cache_ttl_s:
            self.requests.labels(peer.name, "cached").inc()
            return cached[1]
        pending = self._inflight.get(key)
        if pending is not None:  # the same request is already on its way: share it
            return await asyncio.shield(pending)
        task = asyncio.ensure_future(self._fetch(peer, path, params, timeout_s))
        self._inflight[key] = task
        try:
            return await task
        finally:
            self._inflight.pop(key, None)

    async def get_all(self, peers: Sequence[Peer], path: str, params: dict[str, Any] | None = None, *,
                      timeout_s: float | None = None) -> list[ShardAnswer]:
        return list(await asyncio.gather(*(self.get_one(p, path, params, timeout_s=timeout_s) for p in peers)))

    async def post_one(self, peer: Peer, path: str, body: Any) -> tuple[int, Any]:
        """POST a JSON body to one shard (never cached): (status, decoded reply); status 0 when the
        shard did not answer within ``timeout_s`` (the reply is then the error text)."""
        started = time.perf_counter()
        try:
            reply = await self._client.post(peer.url + path, json=body)
            data = reply.json() if len(reply.content) <= MAX_PEER_BYTES else None
        except (httpx.HTTPError, ValueError) as exc:
            self.requests.labels(peer.name, "error").inc()
            return 0, f"{type(exc).__name__}: {exc}"[:200]
        finally:
            self.latency.labels(peer.name).observe(time.perf_counter() - started)
        self.requests.labels(peer.name, "ok" if reply.status_code < 400 else "refused").inc()
        return reply.status_code, data

    async def open_stream(self, peer: Peer, path: str) -> httpx.Response | None:
        """A 200 reply of one shard opened for streaming (the caller closes it), else None.
        Each read is bounded by ``timeout_s``; the body is never held whole in memory."""
        try:
            reply = await self._client.send(self._client.build_request("GET", peer.url + path), stream=True)
        except httpx.HTTPError:
            self.requests.labels(peer.name, "error").inc()
            return None
        if reply.status_code != 200:
            await reply.aclose()
            self.requests.labels(peer.name, "not_found" if reply.status_code == 404 else "refused").inc()
            return None
        self.requests.labels(peer.name, "ok").inc()
        return reply

    def unreachable(self, answers: Sequence[ShardAnswer]) -> list[str]:
        return [a.shard for a in answers if a.error and not a.refused]
