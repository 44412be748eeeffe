"""The dashboard's own endpoints against a real collector (uvicorn + SQLite):
``/chart`` (min/max envelope series) and ``/heatmap`` (ranks x steps), checked against
numbers computed by brute force from the very samples that were posted."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import H200_TOTAL, GiB, ndjson

from vramwatch.collector.server import BackgroundServer

MiB = 1024**2
RUN = "api-run"
SPIKE_STEP = 3777
FIELDS = ["ts", "allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "nvml_used_bytes", "total_bytes",
          "inactive_split_bytes", "alloc_retries"]


def sample(rank: int, step: int, phase: str = "train", incarnation: str = "a", **over: Any) -> dict[str, Any]:
    allocated = 50 * GiB + (step * 7919 % 97) * MiB
    reserved = 60 * GiB + (step * 104729 % 89) * MiB
    s = {
        "schema": 1, "run": RUN, "host": f"node-{rank}", "rank": rank, "step": step, "ts": 1.75e9 + step * 0.5,
        "phase": phase, "allocated_bytes": allocated, "reserved_bytes": reserved,
        "peak_allocated_bytes": allocated + 5 * GiB + (step % 11) * MiB, "inactive_split_bytes": (step % 5) * MiB,
        "alloc_retries": step // 1000, "ooms": 0,
        # rank 1 has no NVML for a stretch: null, never a fake zero
        "nvml_used_bytes": None if rank == 1 and 2000 <= step < 2500 else reserved + GiB,
        "total_bytes": H200_TOTAL, "incarnation": incarnation,
    }
    s.update(over)
    return s


def spike(rank: int, step: int, gib: int) -> dict[str, Any]:
    return sample(rank, step, peak_allocated_bytes=gib * GiB, reserved_bytes=(gib + 1) * GiB,
                  nvml_used_bytes=(gib + 2) * GiB)


class Feed:
    def __init__(self, url: str) -> None:
        self.url = url
        self.sent: list[dict[str, Any]] = []

    def post(self, samples: list[dict[str, Any]]) -> None:
        for i in range(0, len(samples), 10000):
            r = httpx.post(self.url + "/api/v1/samples", content=ndjson(samples[i:i + 10000]), timeout=60,
                           headers={"content-type": "application/x-ndjson"})
            assert r.status_code == 200, r.text
        self.sent += samples


@pytest.fixture(scope="module")
def feed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Feed]:
    with BackgroundServer(str(tmp_path_factory.mktemp("dash-api") / "vw.db")) as server:
        f = Feed(server.url)
        first = []
        for step in range(10000):
            for rank in (0, 1):
                first.append(spike(1, step, 130) if (rank, step) == (1, SPIKE_STEP) else sample(rank, step))
        first.append(sample(0, 5000, phase="checkpoint", reserved_bytes=132 * GiB, nvml_used_bytes=133 * GiB,
                            peak_allocated_bytes=131 * GiB))
        f.post(first)
        yield f


def chart(feed: Feed, rank: int, **params: Any) -> dict[str, Any]:
    r = httpx.get(f"{feed.url}/api/v1/runs/{RUN}/chart", params={"rank": rank, "fields": ",".join(FIELDS), **params})
    assert r.status_code == 200, r.text
    return r.json()


def raw_rows(feed: Feed, rank: int, a: float = -1, b: float = 1e18) -> list[dict[str, Any]]:
    rows = [s for s in feed.sent if s["rank"] == rank and s["phase"] == "train" and a <= s["step"] <= b]
    return sorted(rows, key=lambda s: s["step"])


def assert_envelope(doc: dict[str, Any], rows: list[dict[str, Any]], points: int) -> None:
    assert doc["raw_points"] == len(rows)
    assert len(doc["x"]) <= points and doc["x"] == sorted(doc["x"])
    assert rows[0]["step"] <= doc["x"][0] and doc["x"][-1] <= rows[-1]["step"]
    for f in FIELDS:
        values = [s[f] for s in rows if s[f] is not None]
        got = [v for v in doc["series"][f] if v is not None]
        assert max(got) == max(values), f
        assert min(got) == min(values), f


def test_chart_keeps_every_extreme(feed: Feed) -> None:
    for rank in (0, 1):
        doc = chart(feed, rank, points=200)
        assert doc["downsampled"] is True
        assert_envelope(doc, raw_rows(feed, rank), 200)
    doc = chart(feed, 1, points=200)
    # the spike is there, close to where it happened (within one bucket of 100 steps)
    i = doc["series"]["peak_allocated_bytes"].index(130 * GiB)
    assert abs(doc["x"][i] - SPIKE_STEP) <= 10000 / 100
    # the checkpoint sample (phase) is not a train point: the chart shows train samples only
    assert max(chart(feed, 0, points=200)["series"]["reserved_bytes"]) < 132 * GiB


def test_chart_zoom_windows(feed: Feed) -> None:
    doc = chart(feed, 1, start=3700, end=3800, points=3000)
    assert doc["downsampled"] is False
    assert doc["x"] == list(range(3700, 3801))
    assert doc["series"]["reserved_bytes"] == [s["reserved_bytes"] for s in raw_rows(feed, 1, 3700, 3800)]
    for a, b, points in [(1234.5, 7777, 300), (3000, 4000, 100), (0, 9999, 2000), (17, 29, 10)]:
        doc = chart(feed, 1, start=a, end=b, points=points)
        assert_envelope(doc, raw_rows(feed, 1, a, b), points)
    empty = chart(feed, 1, start=20000, end=30000)
    assert empty["x"] == [] and empty["raw_points"] == 0


def test_chart_follows_new_samples_and_restarts(feed: Feed) -> None:
    chart(feed, 0, points=500)  # build the cache first, then grow the run past a width change
    more = [sample(rank, step) for step in range(10000, 20000) for rank in (0, 1)]
    more[2 * (11111 - 10000)] = spike(0, 11111, 128)
    # rank 1 restarts: a new incarnation resumes from step 9000 (its steps overlap)
    more += [sample(1, step, incarnation="b", allocated_bytes=40 * GiB) for step in range(9000, 9500)]
    feed.post(more)
    for rank in (0, 1):
        doc = chart(feed, rank, points=500)
        assert_envelope(doc, raw_rows(feed, rank), 500)
    doc = chart(feed, 0, points=500)
    assert 128 * GiB in doc["series"]["peak_allocated_bytes"]
    old = chart(feed, 1, start=3000, end=4000, points=100)
    assert 130 * GiB in old["series"]["peak_allocated_bytes"], "the old spike is still there after coarsening"
    assert min(chart(feed, 1, points=500)["series"]["allocated_bytes"]) == 40 * GiB


def brute_heatmap(feed: Feed, doc: dict[str, Any], field: str) -> list[list[float | None]]:
    width = doc["bucket"]
    buckets = [int(x // width) for x in doc["x"]]
    z: list[list[float | None]] = []
    for row in doc["rows"]:
        cells: dict[int, float] = {}
        for s in feed.sent:
            if s["rank"] != row["rank"] or s["host"] != row["host"]:
                continue
            used = s["nvml_used_bytes"] or 0
            value = s["total_bytes"] - max(s["reserved_bytes"], used) if field == "headroom" else s["reserved_bytes"]
            b = int(s["step"] // width)
            worse = min if field == "headroom" else max
            cells[b] = worse(cells.get(b, value), value)
        z.append([None if b not in cells else round(cells[b] / GiB, 3) for b in buckets])
    return z


@pytest.mark.parametrize("field", ["headroom", "reserved"])
def test_heatmap_is_the_worst_of_each_bucket(feed: Feed, field: str) -> None:
    doc = httpx.get(f"{feed.url}/api/v1/runs/{RUN}/heatmap", params={"field": field, "cols": 64}).json()
    assert [(r["host"], r["rank"]) for r in doc["rows"]] == [("node-0", 0), ("node-1", 1)]
    assert 32 <= len(doc["x"]) <= 64 and doc["bucket"] & (doc["bucket"] - 1) == 0
    assert doc["z"] == brute_heatmap(feed, doc, field)
    # the checkpoint (phase) sample counts: it is the worst moment of rank 0
    if field == "headroom":
        assert min(doc["z"][0]) == round((H200_TOTAL - 133 * GiB) / GiB, 3)


def test_heatmap_wall_time_axis(feed: Feed) -> None:
    doc = httpx.get(f"{feed.url}/api/v1/runs/{RUN}/heatmap", params={"x": "ts", "cols": 50}).json()
    first_ts = min(s["ts"] for s in feed.sent)
    assert doc["x"][0] <= first_ts + doc["bucket"] and len(doc["z"][0]) == len(doc["x"])


def test_chart_rejects_bad_requests(feed: Feed) -> None:
    base = f"{feed.url}/api/v1/runs/{RUN}/chart"
    r = httpx.get(base, params={"rank": 0, "fields": "reserved_bytes,bogus"})
    assert r.status_code == 422 and "bogus" in r.json()["detail"] and "fields" in r.json()["detail"]
    r = httpx.get(base, params={"rank": 0, "start": 10, "end": 5})
    assert r.status_code == 422 and "end" in r.json()["detail"]
    assert httpx.get(base, params={"rank": 0, "points": 5}).status_code == 422
    assert httpx.get(f"{feed.url}/api/v1/runs/nope/chart", params={"rank": 0}).status_code == 404
    # a rank the run never had is a wrong address (as on a front), not an empty chart
    nobody = httpx.get(base, params={"rank": 7})
    assert nobody.status_code == 404 and nobody.json()["detail"].startswith("rank: no rank 7")
