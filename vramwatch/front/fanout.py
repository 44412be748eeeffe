"""Concurrent, bounded, briefly cached requests to every shard.

Guarantees, whatever the shards send and however many there are:

* **time**: one fan-out (:meth:`Fanout.get_all`) costs at most ``timeout_s`` of wall time in
  all. It is a *total* deadline shared by the fan-out's requests (:func:`vramwatch.bounded.fetch`:
  a shard that sends a byte a second ends at it too); at most ``max_concurrent`` requests run
  at once, and a shard whose turn has not come by the deadline is answered "not asked". Shards
  whose last request failed may hold at most half of the slots, so dead or hanging peers (2,000
  of them, say) never crowd out the ones that answer; the background health probe has a few
  slots of its own;
* **memory**: an answer is streamed and refused past ``max_bytes`` (inflated, gzip counted as
  it inflates); at most ``max_concurrent`` answers are in flight; one over 256 KiB is decoded
  off the event loop; one cached document per (shard, path, query) within its TTL plus one
  last-good document, ``max_cached`` of each;
* **credentials**: the peer token goes only to peers whose ``credentials`` the operator gave
  (:class:`~vramwatch.front.peers.Peer`), in each request's own headers; no redirect is
  followed;
* **availability**: an identical request within ``cache_ttl_s`` is answered from the cache; a
  shard that does not answer is served from its last good answer (``stale``); ``/healthz``
  answers from the outcomes already known (:meth:`Fanout.health`) and never waits on a shard.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import orjson
from prometheus_client import CollectorRegistry, Counter, Histogram

from vramwatch.bounded import FetchError, HttpLimits, Reply, fetch
from vramwatch.front.merge import ShardAnswer
from vramwatch.front.peers import Peer
from vramwatch.remote import detail_text

#: the largest document read from a shard (a 4,096-rank /ranks page is a few MB)
MAX_PEER_BYTES = 64 * 2**20
#: shard requests running at once (others wait for a slot within the fan-out's deadline)
MAX_CONCURRENT = 64
#: answers larger than this are decoded in a worker thread
DECODE_INLINE_BYTES = 256 * 1024
#: a streamed download (a snapshot) must end within this
STREAM_DEADLINE_S = 600.0
TIMEOUT_FLAG, SIZE_FLAG, CONCURRENCY_FLAG = "--peer-timeout", "--peer-max-mb", "--peer-concurrency"


def _detail(body: bytes) -> str:
    """A shard's error message as one line that still names the field (:func:`detail_text`)."""
    try:
        doc = orjson.loads(body)
        detail = doc.get("detail", doc) if isinstance(doc, dict) else doc
    except orjson.JSONDecodeError:
        detail = body[:300].decode("utf-8", "replace")
    return detail_text(detail)


async def decode(body: bytes) -> Any:
    """JSON (orjson: no NaN, no Infinity), off the event loop when it is large."""
    if len(body) > DECODE_INLINE_BYTES:
        return await asyncio.to_thread(orjson.loads, body)
    return orjson.loads(body)


class Fanout:
    def __init__(self, *, token: str | None = None, timeout_s: float = 2.0, cache_ttl_s: float = 1.0,
                 max_cached: int = 4096, max_bytes: int = MAX_PEER_BYTES, max_concurrent: int = MAX_CONCURRENT,
                 registry: CollectorRegistry | None = None) -> None:
        self.timeout_s = timeout_s
        self.cache_ttl_s = cache_ttl_s
        self.max_cached = max_cached
        self.max_bytes = max_bytes
        self.max_concurrent = max_concurrent
        self._token = token
        # no default headers (a token goes per request, to peers allowed it); redirects not followed
        self._client = httpx.AsyncClient(timeout=timeout_s, follow_redirects=False, limits=httpx.Limits(
            max_connections=max_concurrent, max_keepalive_connections=max_concurrent))
        self._slots = asyncio.Semaphore(max_concurrent)
        self._suspect_slots = asyncio.Semaphore(max(1, max_concurrent // 2))  # shards that failed last time
        self._probe_slots = asyncio.Semaphore(max(1, max_concurrent // 8))  # the background health refresh
        self._fresh: OrderedDict[tuple[str, str, str], tuple[float, ShardAnswer]] = OrderedDict()
        self._last_good: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self._inflight: dict[tuple[str, str, str], asyncio.Future[ShardAnswer]] = {}
        self._reachable: dict[str, bool] = {}  # shard -> did its last request get an answer
        self._health_task: asyncio.Task[Any] | None = None
        self._health_at = float("-inf")
        registry = registry or CollectorRegistry()
        self.requests = Counter("vramwatch_front_peer_requests", "Cross-shard requests by outcome",
                                ["shard", "outcome"], registry=registry)
        self.latency = Histogram("vramwatch_front_peer_request_duration_seconds", "Cross-shard request latency",
                                 ["shard"], registry=registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
        self.registry = registry

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self._client.aclose()

    @staticmethod
    def _key(peer: Peer, path: str, params: dict[str, Any]) -> tuple[str, str, str]:
        return (peer.url, path, "&".join(f"{k}={params[k]}" for k in sorted(params)))

    def _remember(self, store: OrderedDict, key: tuple[str, str, str], value: Any) -> None:
        store[key] = value
        store.move_to_end(key)
        while len(store) > self.max_cached:
            store.popitem(last=False)

    def headers(self, peer: Peer) -> dict[str, str]:
        """The credentials this peer may get: the token when the operator named or allowed it."""
        return {"authorization": f"Bearer {self._token}"} if self._token and peer.credentials else {}

    async def _request(self, peer: Peer, method: str, path: str, deadline: float, *,
                       params: dict[str, Any] | None = None, body: bytes | None = None,
                       stated_s: float | None = None) -> Reply:
        """One request within the fan-out's ``deadline`` (loop time): slots first, then the fetch.
        ``stated_s``: the timeout the deadline came from, as a refusal names it."""
        stated_s = self.timeout_s if stated_s is None else stated_s
        loop = asyncio.get_running_loop()
        gates = [self._probe_slots] if path == "/healthz" else (
            [self._suspect_slots, self._slots] if self._reachable.get(peer.name) is False else [self._slots])
        held: list[asyncio.Semaphore] = []
        try:
            async with asyncio.timeout_at(deadline):
                for gate in gates:
                    await gate.acquire()
                    held.append(gate)
        except TimeoutError:
            for gate in held:
                gate.release()
            raise FetchError(f"not asked within {stated_s:g} s: {self.max_concurrent} shard requests were "
                             f"already running ({CONCURRENCY_FLAG})", CONCURRENCY_FLAG) from None
        try:
            headers = self.headers(peer)
            if body is not None:
                headers["content-type"] = "application/json"
            limits = HttpLimits(deadline - loop.time(), self.max_bytes, TIMEOUT_FLAG, SIZE_FLAG, stated_s)
            return await fetch(self._client, method, peer.url + path, limits, headers=headers, params=params,
                               content=body)
        finally:
            for gate in held:
                gate.release()

    async def _fetch(self, peer: Peer, path: str, params: dict[str, Any], deadline: float,
                     stated_s: float | None = None) -> ShardAnswer:
        key = self._key(peer, path, params)
        started = time.perf_counter()
        try:
            reply = await self._request(peer, "GET", path, deadline, params=params, stated_s=stated_s)
            self._reachable[peer.name] = reply.status < 500
            if 400 <= reply.status < 500:  # the request was refused, the shard is fine: no stale answer
                status = reply.status
                answer = ShardAnswer(peer.name, None, _detail(reply.body)[:300], status=status)
                self.requests.labels(peer.name, "not_found" if status == 404 else "refused").inc()
                if status == 404:  # "no such run here" is the common answer of most shards: cached
                    self._remember(self._fresh, key, (time.monotonic(), answer))
                return answer
            if reply.status != 200:
                raise FetchError(f"HTTP {reply.status}: {_detail(reply.body)[:150]}")
            data = await decode(reply.body)
        except (FetchError, ValueError) as exc:
            self._reachable[peer.name] = False
            self.requests.labels(peer.name, "error").inc()
            last = self._last_good.get(key)
            text = str(exc) if isinstance(exc, FetchError) else f"{type(exc).__name__}: {exc}"
            return ShardAnswer(peer.name, last, text[:300], stale=last is not None)
        finally:
            self.latency.labels(peer.name).observe(time.perf_counter() - started)
        self.requests.labels(peer.name, "ok").inc()
        answer = ShardAnswer(peer.name, data)
        self._remember(self._fresh, key, (time.monotonic(), answer))
        self._remember(self._last_good, key, data)
        return answer

    async def get_one(self, peer: Peer, path: str, params: dict[str, Any] | None = None,
                      deadline: float | None = None, *, timeout_s: float | None = None) -> ShardAnswer:
        """One shard's answer (cached ``cache_ttl_s``) within ``deadline`` (loop time; default:
        ``timeout_s`` from now, the front's unless given: a request a shard may take long to
        answer the first time, a snapshot diff, passes its own)."""
        params = params or {}
        key = self._key(peer, path, params)
        cached = self._fresh.get(key)
        if cached is not None and time.monotonic() - cached[0] <= self.cache_ttl_s:
            self.requests.labels(peer.name, "cached").inc()
            return cached[1]
        pending = self._inflight.get(key)
        if pending is not None:  # the same request is already on its way: share it
            return await asyncio.shield(pending)
        stated = self.timeout_s if timeout_s is None else timeout_s
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + stated
        task = asyncio.ensure_future(self._fetch(peer, path, params, deadline, stated))
        self._inflight[key] = task
        try:
            return await task
        finally:
            self._inflight.pop(key, None)

    async def get_all(self, peers: Sequence[Peer], path: str, params: dict[str, Any] | None = None, *,
                      timeout_s: float | None = None) -> list[ShardAnswer]:
        """Every shard's answer, all within one ``timeout_s`` (the front's unless given) from now."""
        stated = self.timeout_s if timeout_s is None else timeout_s
        deadline = asyncio.get_running_loop().time() + stated
        return list(await asyncio.gather(*(self.get_one(p, path, params, deadline, timeout_s=stated) for p in peers)))

    async def post_one(self, peer: Peer, path: str, body: Any) -> tuple[int, Any]:
        """POST a JSON body to one shard (never cached): (status, decoded reply); status 0 when the
        shard did not answer within ``timeout_s`` (the reply is then the error text)."""
        started = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            reply = await self._request(peer, "POST", path, deadline, body=orjson.dumps(body))
            data = await decode(reply.body)
        except (FetchError, ValueError) as exc:
            self.requests.labels(peer.name, "error").inc()
            return 0, f"{type(exc).__name__}: {exc}"[:300]
        finally:
            self.latency.labels(peer.name).observe(time.perf_counter() - started)
        self.requests.labels(peer.name, "ok" if reply.status < 400 else "refused").inc()
        return reply.status, data

    async def open_stream(self, peer: Peer, path: str) -> httpx.Response | None:
        """A 200 reply of one shard opened for streaming (the caller closes it), else None. Its
        headers must arrive within ``timeout_s``; read the body with :func:`stream_chunks`."""
        # identity: the bytes are passed through as they come, never inflated here
        request = self._client.build_request("GET", peer.url + path,
                                             headers={**self.headers(peer), "accept-encoding": "identity"})
        try:
            async with asyncio.timeout(self.timeout_s):
                reply = await self._client.send(request, stream=True)
        except (httpx.HTTPError, TimeoutError):
            self.requests.labels(peer.name, "error").inc()
            return None
        if reply.status_code != 200:
            await reply.aclose()
            self.requests.labels(peer.name, "not_found" if reply.status_code == 404 else "refused").inc()
            return None
        self.requests.labels(peer.name, "ok").inc()
        return reply

    def health(self, peers: Sequence[Peer]) -> list[str]:
        """Shards whose last request got no answer, known now; a refresh of every shard's
        ``/healthz`` is started in the background at most once per ``max(cache_ttl_s, 1)``."""
        now = time.monotonic()
        running = self._health_task is not None and not self._health_task.done()
        if not running and now - self._health_at >= max(self.cache_ttl_s, 1.0):
            self._health_at = now
            self._health_task = asyncio.ensure_future(self.get_all(list(peers), "/healthz"))
        return [p.name for p in peers if self._reachable.get(p.name) is False]

    def unreachable(self, answers: Sequence[ShardAnswer]) -> list[str]:
        return [a.shard for a in answers if a.error and not a.refused]


async def stream_chunks(reply: httpx.Response, deadline_s: float = STREAM_DEADLINE_S) -> AsyncIterator[bytes]:
    """A streamed reply's body, ended (with the connection) when it runs past ``deadline_s`` in all:
    memory O(chunk), time bounded whatever the shard sends. The deadline wraps each read only,
    never the caller's own sends."""
    deadline = asyncio.get_running_loop().time() + deadline_s
    chunks = reply.aiter_raw().__aiter__()
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return
            yield chunk
    except (TimeoutError, httpx.HTTPError):
        return  # the client sees the body end early; the shard's connection is closed below
    finally:
        await reply.aclose()
