"""Outbound requests of ``vramwatch watch`` and of the CLI's ``--url`` client against servers that
misbehave (tests/hostile.py): an answer is cut at its size cap (inflated, for gzip) and at one
total deadline, and watch decodes what it gets off the collector's event loop."""

from __future__ import annotations

import threading
import time

import httpx
import orjson
import pytest
from hostile import Hostile, answer, drip, flood

from vramwatch import remote
from vramwatch.bounded import FetchError, HttpLimits, fetch_sync
from vramwatch.collector.exporters.device_watch import WatchConfig, lifespan_hook
from vramwatch.collector.server import BackgroundServer

MiB = 2**20


class HealthWatch:
    """``/healthz`` of a server polled every 20 ms in a thread; the slowest answer seen."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.polls = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                assert client.get("/healthz").status_code == 200
                self.worst = max(self.worst, time.monotonic() - started)
                self.polls += 1
                self._stop.wait(0.02)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _wait(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ---------------------------------------------------------------- watch --prometheus

@pytest.mark.parametrize("bomb", [False, True])
def test_watch_cuts_an_endless_prometheus_answer_at_its_cap(tmp_path, bomb: bool) -> None:
    with Hostile(flood(limit=256 * MiB, gzip_bomb=bomb)) as prom:
        config = WatchConfig(prom.url, interval_s=0.2, lookback_s=60, timeout_s=10, max_answer_bytes=1 * MiB)
        with BackgroundServer(str(tmp_path / "vw.db"), lifespan_hooks=(lifespan_hook(config),)) as srv, \
                HealthWatch(srv.url) as health:
            poller = srv.app.state.watch
            _wait(lambda: poller.failures >= 2)
        assert prom.sent < 48 * MiB, prom.sent  # before: the whole answer was read, then decoded
        assert health.worst < 1.0, health.worst


def test_watch_decodes_a_large_answer_off_the_event_loop(tmp_path) -> None:
    """A million points that all fail conversion (no FB_FREE/TOTAL to size the GPU): seconds of
    Python work per poll, which ran on the event loop and froze /healthz for its duration."""
    doc = {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"__name__": "DCGM_FI_DEV_FB_USED", "Hostname": "n", "UUID": f"GPU-{g}", "gpu": str(g)},
         "values": [[1.7e9 + i, "1000"] for i in range(250_000)]} for g in range(4)]}}
    body = orjson.dumps(doc)
    with Hostile(answer(body)) as prom:
        config = WatchConfig(prom.url, interval_s=0.2, lookback_s=60, timeout_s=30)
        with BackgroundServer(str(tmp_path / "vw.db"), lifespan_hooks=(lifespan_hook(config),)) as srv, \
                HealthWatch(srv.url) as health:
            poller = srv.app.state.watch
            _wait(lambda: poller.skipped >= 1_000_000)
        assert health.polls > 10 and health.worst < 1.0, (health.polls, health.worst)


def test_watch_flags_reach_its_config(tmp_path, monkeypatch, capsys) -> None:
    from vramwatch.cli import main
    from vramwatch.collector import server

    configs: list[WatchConfig] = []
    monkeypatch.setattr(server, "serve", lambda settings, **kw: None)
    monkeypatch.setattr("vramwatch.cli.watch.lifespan_hook",
                        lambda config: configs.append(config) or lifespan_hook(config))
    assert main(["watch", "--prometheus", "http://127.0.0.1:9", "--db", str(tmp_path / "vw.db"),
                 "--prometheus-timeout", "3", "--max-answer-mb", "8"]) == 0
    assert (configs[0].timeout_s, configs[0].max_answer_bytes) == (3.0, 8 * MiB)
    with pytest.raises(SystemExit) as exit_:
        main(["watch", "--prometheus", "http://127.0.0.1:9", "--max-answer-mb", "0"])
    assert exit_.value.code == 2 and "--max-answer-mb" in capsys.readouterr().err


# ---------------------------------------------------------------- the CLI's --url client

def test_a_dripping_server_ends_at_the_clis_total_deadline() -> None:
    with Hostile(drip(b'{"x": 1}' + b" " * 200, every_s=0.2)) as slow:
        started = time.monotonic()
        with pytest.raises(remote.RemoteError, match=r"within 1 s \(timeout\)") as err:
            remote.get_json(slow.url, "/api/v1/runs", timeout=1.0)
        assert time.monotonic() - started < 2.5  # before: 1 s per read, 42 s in all
        assert err.value.status is None


@pytest.mark.parametrize("bomb", [False, True])
def test_the_clis_reply_is_cut_at_its_cap_also_when_gzip(bomb: bool) -> None:
    with Hostile(flood(limit=256 * MiB, gzip_bomb=bomb)) as endless:
        with pytest.raises(remote.RemoteError, match=r"larger than 1 MiB|more than 1 MiB inflated"):
            remote.get_json(endless.url, "/api/v1/runs", timeout=30, max_bytes=1 * MiB)
        assert endless.sent < 48 * MiB


def test_fetch_sync_reads_gzip_answers_and_follows_no_redirect() -> None:
    import gzip

    doc = orjson.dumps({"ok": True})
    with Hostile(answer(gzip.compress(doc), extra={"content-encoding": "gzip"})) as zipped:
        assert orjson.loads(fetch_sync(zipped.url + "/x", HttpLimits(5, 1024)).body) == {"ok": True}
    with Hostile(answer(b"", status=302, extra={"location": "http://127.0.0.2:1/steal"})) as moved:
        reply = fetch_sync(moved.url + "/x", HttpLimits(5, 1024), headers={"authorization": "Bearer t"})
        assert reply.status == 302  # not followed: the token stays with the host it was meant for
    with pytest.raises(FetchError, match="cannot reach"):
        fetch_sync("http://127.0.0.1:9/x", HttpLimits(5, 1024))
