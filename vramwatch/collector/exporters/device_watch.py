"""``vramwatch watch --prometheus URL``: verdicts for every GPU dcgm-exporter reports, with no
change to any training code.

The collector runs as in ``vramwatch serve`` (dashboard, API, ``/metrics``, OTLP push);
a lifespan hook polls Prometheus's HTTP API every ``interval_s`` with a range query of
dcgm-exporter's framebuffer series, converts each GPU's points into sparse samples with
the Prometheus importer (``nvml_used_bytes`` + ``total_bytes``, rank = ``gpu``, host =
``Hostname``, run = ``--run``) and posts them to the collector's own ingest route in
process (through the ASGI app: the same validation, store and live engines as any hook's
samples). The first poll backfills ``lookback_s`` of history, so verdicts start at once.

Steps are time: ``step = round(ts / step_s)`` (default 1 s), the same rule as
``vramwatch import --from prometheus``, so a re-poll or a re-import lands on the same steps,
a missed scrape is a gap, and the engine's slope reads bytes per ``step_s`` seconds.

Cost per poll: one range query (points since the last poll) and one in-process POST; the
loop never blocks the event loop: the answer is streamed under one total deadline
(``timeout_s``, not per read) and refused past ``max_answer_bytes`` (inflated), and its
decoding and conversion run in a worker thread. Prometheus being down, slow or answering too
much is one rate-limited log line and a retry at the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from vramwatch.bounded import FetchError, HttpLimits, fetch
from vramwatch.importers.common import ImportStats
from vramwatch.importers.prometheus import DEFAULT_RUN, results_of, samples_from_results
from vramwatch.wire import encode_lines

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("vramwatch.watch")

#: samples per in-process ingest request (the collector takes 50,000 at most)
POST_BATCH = 20_000
#: dcgm-exporter's framebuffer metrics (MiB); the selector's matchers are added to it
METRIC_MATCHER = '__name__=~"DCGM_FI_DEV_FB_(USED|FREE|RESERVED|TOTAL)"'
_MATCHER_RE = re.compile(r'\s*[A-Za-z_][A-Za-z0-9_]*\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*')


def build_query(selector: str = "") -> str:
    """The PromQL selector: dcgm framebuffer metrics, narrowed by ``selector``
    (``Hostname=~"node-.*",gpu!="7"``, braces optional). Raises ValueError for a bad matcher."""
    inner = selector.strip()
    if inner.startswith("{") and inner.endswith("}"):
        inner = inner[1:-1]
    matchers = [METRIC_MATCHER]
    if inner.strip():
        for part in _split_matchers(inner):
            if not _MATCHER_RE.fullmatch(part):
                raise ValueError(f'--selector: not a label matcher: {part.strip()!r} (e.g. Hostname=~"node-.*")')
            matchers.append(part.strip())
    return "{" + ",".join(matchers) + "}"


def _split_matchers(text: str) -> list[str]:
    parts, current, quoted, escaped = [], [], False, False
    for ch in text:
        if ch == "," and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
    parts.append("".join(current))
    return parts


@dataclass
class WatchConfig:
    prometheus: str
    selector: str = ""
    run: str = DEFAULT_RUN
    #: seconds between polls, and the range query's resolution
    interval_s: float = 15.0
    #: history the first poll reads
    lookback_s: float = 3600.0
    #: seconds per engine step (steps are time for dcgm series)
    step_s: float = 1.0
    #: one query's answer must arrive in full within this, and be at most this large (inflated)
    timeout_s: float = 10.0
    max_answer_bytes: int = 64 * 2**20
    query: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.query = build_query(self.selector)
        self.prometheus = self.prometheus.rstrip("/")
        if not self.prometheus.startswith(("http://", "https://")):
            raise ValueError(f"--prometheus must be an http(s) URL, got {self.prometheus!r}")
        for name in ("interval_s", "step_s", "timeout_s", "max_answer_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.lookback_s < 0:
            raise ValueError("lookback_s must not be negative")


@dataclass
class Poller:
    """One GPU fleet's polling state: where the next range query starts, and counts."""

    config: WatchConfig
    next_start: float | None = None
    polls: int = 0
    failures: int = 0
    posted: int = 0
    skipped: int = 0

    def window(self, now: float) -> tuple[float, float]:
        """[start, end] of the next query, aligned to the interval so points land on one grid."""
        step = self.config.interval_s
        end = math.floor(now / step) * step
        start = self.next_start if self.next_start is not None else end - self.config.lookback_s
        # Prometheus answers at most 11,000 points per series: read a long backlog in pieces
        start = max(start, end - 10_000 * step)
        return math.ceil(start / step) * step, end

    async def poll(self, prom: httpx.AsyncClient, ingest: httpx.AsyncClient, now: float | None = None) -> int:
        """One poll: query, convert, post. Returns the samples the collector accepted."""
        start, end = self.window(time.time() if now is None else now)
        if end < start:
            return 0
        self.polls += 1
        limits = HttpLimits(self.config.timeout_s, self.config.max_answer_bytes, "--prometheus-timeout",
                            "--max-answer-mb")
        response = await fetch(prom, "GET", "/api/v1/query_range", limits, params={
            "query": self.config.query, "start": f"{start:.3f}", "end": f"{end:.3f}",
            "step": f"{self.config.interval_s:g}"})
        where = f"{self.config.prometheus} query_range"
        if response.status != 200:
            raise RuntimeError(f"Prometheus answered {response.status}: "
                               f"{response.body[:300].decode('utf-8', 'replace')}")
        # decoding and converting up to max_answer_bytes of JSON takes seconds: never on the loop
        bodies, stats = await asyncio.to_thread(self._convert, response.body, where)
        self.skipped += stats.skipped
        for error in stats.errors[:3]:
            log.warning("skipped a dcgm point: %s", error)
        self.next_start = end + self.config.interval_s
        accepted = 0
        for count, body in bodies:  # a backfill of a large fleet is many ingest batches
            answer = await ingest.post("/api/v1/samples", content=body,
                                       headers={"content-type": "application/x-ndjson"})
            if answer.status_code != 200:
                raise RuntimeError(f"collector refused {count} samples: {answer.status_code} {answer.text[:300]}")
            accepted += answer.json()["accepted"]
            self.posted += answer.json()["accepted"]
        return accepted

    def _convert(self, raw: bytes, where: str) -> tuple[list[tuple[int, bytes]], ImportStats]:
        """([(sample count, NDJSON body)] in batches of :data:`POST_BATCH`, counts) of one answer;
        in a worker thread. An answer of any other shape (a proxy's page, a list) raises
        ValueError naming it: a failed poll, and the next poll tries again (it must not end the
        polling task)."""
        results = results_of(orjson.loads(raw), where)
        stats = ImportStats(skip_invalid=True)
        samples = list(samples_from_results(results, self.config.run, self.config.step_s, where, stats))
        del results
        return [(len(samples[i:i + POST_BATCH]), encode_lines(samples[i:i + POST_BATCH]))
                for i in range(0, len(samples), POST_BATCH)], stats


def lifespan_hook(config: WatchConfig) -> Callable[[Any], contextlib.AbstractAsyncContextManager]:
    """A collector lifespan hook that polls Prometheus while the app runs."""

    @contextlib.asynccontextmanager
    async def run(app: Any) -> AsyncIterator[None]:
        import httpx  # not at import time: `vramwatch --help` should not pay for it

        from vramwatch.collector.settings import background

        poller = Poller(config)
        app.state.watch = poller
        token = app.state.settings.token
        headers = {"authorization": f"Bearer {token}"} if token else {}
        prom = httpx.AsyncClient(base_url=config.prometheus, timeout=config.timeout_s)
        ingest = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vramwatch-watch",
                                   headers=headers, timeout=60)

        async def loop() -> None:
            failing_since = None  # say when polls start failing, once a minute while they do, and on recovery
            last_said = 0.0
            while True:
                try:
                    accepted = await poller.poll(prom, ingest)
                    log.debug("watch: %d samples from %s", accepted, config.prometheus)
                    if failing_since is not None:
                        log.info("watch: %s answers again after %.0f s", config.prometheus,
                                 time.monotonic() - failing_since)
                        failing_since = None
                except (httpx.HTTPError, FetchError, RuntimeError, ValueError, KeyError) as exc:
                    poller.failures += 1
                    now = time.monotonic()
                    failing_since = failing_since or now
                    if now - last_said >= 60.0:
                        last_said = now
                        log.warning("watch: poll of %s failed: %s (%d failures so far; retrying every %g s)",
                                    config.prometheus, exc, poller.failures, config.interval_s)
                await asyncio.sleep(config.interval_s)

        try:
            async with background(loop()):
                log.info("watching dcgm-exporter series %s at %s every %g s", config.query, config.prometheus,
                         config.interval_s)
                yield
        finally:
            await prom.aclose()
            await ingest.aclose()

    return run
