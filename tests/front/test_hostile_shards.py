"""The federating front against shards and a Prometheus that misbehave (tests/hostile.py: real
loopback sockets): answers are cut at their size cap and at one total deadline, discovery
never stalls a request, thousands of peers cost a bounded number of requests at once, a
malformed shard answer is a 502 naming the shard, and the peer token goes only where the
operator pointed."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import make_sample, ndjson, wait_until
from hostile import Hostile, answer, drip, flood, json_answer, silent

from vramwatch.collector.server import BackgroundServer
from vramwatch.front import FrontSettings, PeerSource, parse_peers
from vramwatch.front.server import BackgroundFront

MiB = 2**20
TOKEN = "peer-s3cret"


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory):
    """One real collector holding run ``good`` (ranks 0, 1)."""
    db = tmp_path_factory.mktemp("shard") / "vw.db"
    with BackgroundServer(str(db)) as srv:
        t0 = time.time() - 60
        body = ndjson([make_sample(s, run="good", rank=r, ts=t0 + s) for r in (0, 1) for s in range(20)])
        assert httpx.post(srv.url + "/api/v1/samples", content=body,
                          headers={"content-type": "application/x-ndjson"}).status_code == 200
        yield srv


def front_over(*urls: str, **kw) -> BackgroundFront:
    peers = [f"s{i}={u}" for i, u in enumerate(urls)]
    return BackgroundFront(FrontSettings(peers=PeerSource(static=parse_peers(peers)), cache_ttl_s=0, **kw))


def shard_errors(client: httpx.Client) -> dict[str, str | None]:
    return {s["shard"]: s["error"] for s in client.get("/api/v1/shards").json()}


@pytest.mark.parametrize("bomb", [False, True])
def test_an_endless_shard_answer_is_cut_at_the_size_cap(shard, bomb: bool) -> None:
    with Hostile(flood(limit=256 * MiB, gzip_bomb=bomb)) as endless, \
            front_over(shard.url, endless.url, timeout_s=10.0, max_peer_bytes=1 * MiB) as front, \
            httpx.Client(base_url=front.url, timeout=30) as client:
        started = time.monotonic()
        runs = client.get("/api/v1/runs")
        assert runs.status_code == 200 and [r["run"] for r in runs.json()] == ["good"]
        assert time.monotonic() - started < 8
        assert "--peer-max-mb" in shard_errors(client)["s1"]
        # read stopped at the cap: what the shard got out is the cap plus socket buffers, not 256 MiB
        assert endless.sent < 48 * MiB, endless.sent


def test_a_shard_that_drips_its_answer_ends_at_one_total_deadline(shard) -> None:
    body = b'[{"run": "slow", "ranks": 1}]' + b" " * 200  # 230 bytes at 5 a second: 46 s
    with Hostile(drip(body, every_s=0.2)) as slow, front_over(shard.url, slow.url, timeout_s=1.0) as front, \
            httpx.Client(base_url=front.url, timeout=30) as client:
        started = time.monotonic()
        runs = client.get("/api/v1/runs")
        took = time.monotonic() - started
        assert runs.status_code == 200 and [r["run"] for r in runs.json()] == ["good"]
        assert took < 3.0, took  # before: each read had 1 s, so the drip went on for its 46 s
        assert "within 1 s (--peer-timeout)" in shard_errors(client)["s1"]


def test_discovery_from_a_dripping_prometheus_never_stalls_a_request(shard, monkeypatch) -> None:
    monkeypatch.setattr("vramwatch.front.peers.DISCOVERY_DEADLINE_S", 1.0)
    targets = b'{"status": "success", "data": {"activeTargets": []}}'
    with Hostile(drip(targets, every_s=0.5)) as prom:
        source = PeerSource(static=parse_peers([shard.url]), prometheus=prom.url, refresh_s=0.1)
        with BackgroundFront(FrontSettings(peers=source, timeout_s=2.0)) as front, \
                httpx.Client(base_url=front.url, timeout=30) as client:
            worst = 0.0
            until = time.monotonic() + 3.0
            while time.monotonic() < until:  # discoveries keep running (and timing out) meanwhile
                started = time.monotonic()
                assert client.get("/healthz").status_code == 200
                assert client.get("/api/v1/runs").json()[0]["run"] == "good"
                worst = max(worst, time.monotonic() - started)
            assert worst < 0.75, worst  # before: the lock was held across a drip of 40-90 s
            assert len(prom.requests) >= 2


def test_two_thousand_peers_cost_a_bounded_fan_out_and_health_answers_at_once(shard) -> None:
    with Hostile(silent()) as black_hole:
        urls = [shard.url, *(f"{black_hole.url}/p{i}" for i in range(2000))]
        with front_over(*urls, timeout_s=1.0, max_concurrent_peers=32) as front, \
                httpx.Client(base_url=front.url, timeout=60) as client:
            started = time.monotonic()
            assert client.get("/healthz").json()["shards"] == 2001
            assert time.monotonic() - started < 0.5  # liveness waits on no shard
            for _ in range(2):
                started = time.monotonic()
                runs = client.get("/api/v1/runs")
                took = time.monotonic() - started
                assert runs.status_code == 200 and runs.json()[0]["run"] == "good"
                assert took < 4.0, took  # one deadline for the whole fan-out; before: > 60 s
            assert len(black_hole.requests) <= 2 * 32 + 32  # each fan-out asked at most a slot's worth
            unreachable = client.get("/healthz").json()["unreachable"]
            assert len(unreachable) == 2000 and "s0" not in unreachable


def test_a_malformed_heatmap_is_a_502_naming_the_shard(shard) -> None:
    for bucket in (0, -4, 0.0, "wide", None, [2]):
        bad = {"field": "headroom", "x": [0.5], "bucket": bucket, "rows": [{"host": "h", "rank": 9}],
               "z": [[1.0]], "unit": "GiB", "outside": 0}
        with Hostile(json_answer(bad)) as odd, front_over(shard.url, odd.url, timeout_s=5.0) as front:
            reply = httpx.get(front.url + "/api/v1/runs/good/heatmap", timeout=30)
            assert reply.status_code == 502, (bucket, reply.text)
            assert reply.json()["detail"].startswith("shard s1: a malformed heatmap answer"), reply.text


# ---------------------------------------------------------------- credentials

def _prometheus_listing(victim: Hostile) -> Hostile:
    targets = {"status": "success", "data": {"activeTargets": [
        {"labels": {"job": "vramwatch"}, "scrapeUrl": f"{victim.url}/internal/admin/metrics"},
        {"labels": {"job": "other"}, "scrapeUrl": "http://127.0.0.3:1/metrics"}]}}
    return Hostile(json_answer(targets))


@pytest.mark.parametrize("allowed", [False, True])
def test_the_peer_token_goes_only_where_the_operator_pointed(shard, allowed: bool) -> None:
    with Hostile(answer(b"[]"), host="127.0.0.2") as victim, _prometheus_listing(victim) as prom:
        source = PeerSource(static=parse_peers([shard.url]), prometheus=prom.url,
                            allow=["127.0.0.2"] if allowed else ["*.gpu.internal"])
        settings = FrontSettings(peers=source, token=TOKEN, peer_token=TOKEN, timeout_s=2.0, cache_ttl_s=0)
        with BackgroundFront(settings) as front, httpx.Client(base_url=front.url, timeout=30) as client:
            authed = {"authorization": f"Bearer {TOKEN}"}
            assert client.get("/api/v1/runs", headers=authed).json()[0]["run"] == "good"
            client.get("/api/v1/runs/good/ranks", headers=authed)
        assert victim.requests, "the discovered peer was asked"
        # the base URL is scheme://host:port: never the scrape URL's own path
        assert all(r.path.startswith(("/api/v1/", "/healthz")) for r in victim.requests), victim.requests
        sent = {r.headers.get("authorization") for r in victim.requests}
        assert sent == ({f"Bearer {TOKEN}"} if allowed else {None}), sent
        assert all("authorization" not in r.headers for r in prom.requests)  # Prometheus gets no peer token


def test_a_front_holding_a_peer_token_asks_its_readers_for_it(shard, tmp_path: Path, monkeypatch, capsys) -> None:
    from vramwatch.cli import main
    from vramwatch.front import server

    with pytest.raises(ValueError, match="must ask its readers"):
        FrontSettings(peers=PeerSource(static=parse_peers([shard.url])), peer_token=TOKEN)
    token_file = tmp_path / "peer-token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.delenv("VRAMWATCH_TOKEN", raising=False)
    assert main(["serve", "--peers", shard.url, "--peer-token-file", str(token_file)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--peer-token-file" in err and "VRAMWATCH_TOKEN or --token-file" in err

    seen: list[FrontSettings] = []
    monkeypatch.setattr(server, "serve_front", lambda settings, **kw: seen.append(settings))
    monkeypatch.setenv("VRAMWATCH_TOKEN", TOKEN)
    assert main(["serve", "--peers", shard.url]) == 0  # no --auth-read: the token held is asked anyway
    with BackgroundFront(seen[0]) as front:
        assert httpx.get(front.url + "/api/v1/runs", timeout=10).status_code == 401
        assert httpx.post(front.url + "/api/v1/runs/good/capture", json={"rank": 0}, timeout=10).status_code == 401
        ok = httpx.get(front.url + "/api/v1/runs", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert ok.status_code == 200 and ok.json()[0]["run"] == "good"
        assert httpx.get(front.url + "/healthz", timeout=10).status_code == 200


def test_a_capture_body_past_64_kib_is_refused_before_it_is_read(shard) -> None:
    with front_over(shard.url, timeout_s=5.0) as front:
        for url in (front.url, shard.url):
            big = httpx.post(url + "/api/v1/runs/good/capture", content=b"{" + b" " * (80 * 1024) + b"}",
                             headers={"content-type": "application/json"}, timeout=10)
            assert big.status_code == 413 and "65536" in big.json()["detail"], (url, big.text)

            def chunks():
                yield b'{"rank": 0}'

            chunked = httpx.post(url + "/api/v1/runs/good/capture", content=chunks(),
                                 headers={"content-type": "application/json"}, timeout=10)
            assert chunked.status_code == 411, (url, chunked.text)


def test_front_healthz_stays_fast_while_a_shard_hangs(shard) -> None:
    with Hostile(silent()) as hung, front_over(shard.url, hung.url, timeout_s=3.0) as front, \
            httpx.Client(base_url=front.url, timeout=30) as client:
        slow = threading.Thread(target=lambda: client.get("/api/v1/runs"))
        slow.start()
        wait_until(lambda: hung.requests, what="the hung shard holding the front's request")
        started = time.monotonic()
        assert httpx.get(front.url + "/healthz", timeout=10).status_code == 200
        assert time.monotonic() - started < 0.5
        slow.join()
