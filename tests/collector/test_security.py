"""Security of the collector: bearer token for ingest (env or file, constant time),
``--auth-read`` over every read surface, loopback by default, no secrets in logs, and the
limits that keep one bad client from filling the disk. XSS in run names is tested with the
dashboard (tests of the dashboard engineer)."""

from __future__ import annotations

import hmac
import logging
import os
import re
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest
from collector_process import CollectorProcess
from helpers import NDJSON_HEADERS, TOKEN, fresh, make_sample, ndjson, post, stored
from test_input_inventory import route_keys

from vramwatch.collector.server import BackgroundServer

# ------------------------------------------------------------------ token for ingest


def test_token_comparison_is_constant_time_over_fixed_length_digests(tmp_path, monkeypatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    with BackgroundServer(str(tmp_path / "vw.db"), token=TOKEN) as srv, httpx.Client(base_url=srv.url) as client:
        for supplied in ("-", "x", TOKEN[:-1], TOKEN, TOKEN * 50):
            expected = 200 if supplied == TOKEN else 401
            assert post(client, fresh(1), {"authorization": f"Bearer {supplied}"}).status_code == expected
    # every comparison went through compare_digest, on equal-length inputs (no length leak)
    assert len(calls) == 5
    assert all(len(a) == len(b) == 32 for a, b in calls)


# ------------------------------------------------------------------ --auth-read


READ_PATHS = ["/", "/api/v1/runs", "/api/v1/runs/run-a/ranks", "/api/v1/runs/run-a/events",
              "/api/v1/runs/run-a/phases", "/api/v1/runs/run-a/series?rank=0", "/metrics",
              "/static/app.js", "/static/style.css", "/vendor/plotly.min.js"]
#: open on purpose: a liveness probe (no data) and the API description
PUBLIC = {"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def test_auth_read_covers_dashboard_read_api_metrics_and_static_files(tmp_path) -> None:
    with BackgroundServer(str(tmp_path / "vw.db"), token=TOKEN, auth_read=True) as srv, \
            httpx.Client(base_url=srv.url, timeout=10) as client:
        assert post(client, fresh(5), {"authorization": f"Bearer {TOKEN}"}).status_code == 200
        for path in READ_PATHS:
            anonymous = client.get(path)
            assert anonymous.status_code == 401, path
            assert b"app.js" not in anonymous.content and b"vramwatch_" not in anonymous.content, path
            assert client.get(path, headers={"authorization": "Bearer nope"}).status_code == 401, path
            assert client.get(path, headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200, path
        assert client.get("/healthz").status_code == 200

        # every GET route the app has (also ones added later, e.g. dashboard views, and those of
        # included routers, which FastAPI keeps outside app.routes' own paths) is covered
        walked = [key.split(" ", 1)[1] for key in route_keys(srv.app.routes) if key.startswith("GET ")]
        assert len(walked) > 15
        for path in walked:
            if path in PUBLIC:
                continue
            url = re.sub(r"\{run\}", "run-a", path)
            url = re.sub(r"\{[^}]+\}", "0", url)
            assert client.get(url).status_code == 401, f"{path} is readable without the token"


def test_a_browser_gets_the_token_once_in_the_url_then_an_httponly_cookie(tmp_path) -> None:
    srv = BackgroundServer(str(tmp_path / "vw.db"), token=TOKEN, auth_read=True).start()
    with httpx.Client(base_url=srv.url, timeout=10) as client:
        first = client.get("/", params={"token": TOKEN})
        assert first.status_code == 200
        cookie = first.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        # the client now carries the cookie: page assets and API calls work without the header
        for path in ("/static/app.js", "/api/v1/runs", "/metrics"):
            assert client.get(path).status_code == 200, path
        # but a cookie never authorises writes
        assert post(client, fresh(1)).status_code == 401
    with httpx.Client(base_url=srv.url, timeout=10) as stranger:
        assert stranger.get("/", params={"token": "wrong"}).status_code == 401
        assert "set-cookie" not in stranger.get("/", params={"token": "wrong"}).headers
    srv.stop()


def test_auth_read_without_a_token_is_refused_at_start(tmp_path, monkeypatch) -> None:
    from vramwatch.cli import main

    monkeypatch.delenv("VRAMWATCH_TOKEN", raising=False)
    env_free = tmp_path / "vw.db"
    assert main(["serve", "--db", str(env_free), "--auth-read", "--port", "0"]) == 2


# ------------------------------------------------------------------ binding, logs


def startup_log(db, args: tuple[str, ...], token: str | None) -> str:
    """Start ``vramwatch serve``, read its stderr up to startup, stop it; returns that text."""
    env = {k: v for k, v in os.environ.items() if k != "VRAMWATCH_TOKEN"}
    if token:
        env["VRAMWATCH_TOKEN"] = token
    proc = subprocess.Popen([sys.executable, "-m", "vramwatch", "serve", "--db", str(db), "--port", "0", *args],
                            env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if "Application startup complete" in line:
                break
    finally:
        proc.terminate()
        proc.communicate(timeout=15)
    return "".join(lines)


def test_binds_loopback_by_default_and_warns_on_all_interfaces_without_token(tmp_path) -> None:
    from vramwatch.cli import build_parser

    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    text = startup_log(tmp_path / "a.db", (), None)
    assert "listening on http://127.0.0.1:" in text and "without a token" not in text
    text = startup_log(tmp_path / "a.db", ("--host", "0.0.0.0"), None)
    assert "listening on http://0.0.0.0:" in text
    assert "listening on 0.0.0.0 without a token: anyone on the network can write samples" in text
    text = startup_log(tmp_path / "a.db", ("--host", "0.0.0.0"), TOKEN)
    assert "listening on http://0.0.0.0:" in text and "without a token" not in text


def test_no_secret_reaches_the_logs(tmp_path) -> None:
    import warnings

    import vramwatch

    server = CollectorProcess(tmp_path / "vw.db", token=TOKEN, args=("--auth-read",))
    server.args += ("--log-level", "debug")
    with server, httpx.Client(base_url=server.url, timeout=10) as client:
        good = {"authorization": f"Bearer {TOKEN}"}
        assert post(client, fresh(5), good).status_code == 200
        assert post(client, fresh(5), {"authorization": f"Bearer {TOKEN}-wrong"}).status_code == 401
        assert post(client, [make_sample(ooms=-1)], good).status_code == 422
        assert client.get("/api/v1/runs", params={"token": TOKEN + "-wrong"}).status_code == 401
        assert client.get("/metrics", headers=good).status_code == 200
        assert client.get("/", params={"token": TOKEN}).status_code == 200  # sets the cookie
        # the hook with a wrong token: 401s are counted and reported without the token
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            vw = vramwatch.init(url=server.url, run="secret-test", rank=0, probe="simulated",
                                token=f"{TOKEN}-hook", spool_dir=tmp_path / "spool", flush_interval_s=0.05)
            for step in range(5):
                vw.step(step)
            vw.flush(2)
            stats = vw.stats()
            vw.close(0.5)
        assert stats["auth_failures"] >= 1
        hook_text = repr(stats) + "".join(str(w.message) for w in caught)
        assert TOKEN not in hook_text
    assert server.proc is not None and server.proc.returncode == 0
    log = server.log()
    # the refusals are logged (who, what path), the token never is
    assert "refused POST /api/v1/samples from 127.0.0.1: missing or wrong bearer token" in log
    assert TOKEN not in log


# ------------------------------------------------------------------ limits: disk


def test_retention_deletes_old_samples_and_empty_series(tmp_path) -> None:
    db = str(tmp_path / "vw.db")
    now = time.time()
    old = [make_sample(i, run="old-run", ts=now - 10 * 86400 + i) for i in range(50)]
    mixed = [make_sample(i, run="mixed", ts=now - (9 if i < 30 else 1) * 86400 + i) for i in range(60)]
    with BackgroundServer(db, retention_days=5, maintenance_interval_s=0.2, checkpoint_interval_s=0.1) as srv, \
            httpx.Client(base_url=srv.url) as client:
        assert post(client, old + mixed).json()["accepted"] == 110
        deadline = time.monotonic() + 10
        while stored(db) > 30 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stored(db, "old-run") == 0 and stored(db, "mixed") == 30
        with sqlite3.connect(db) as conn:
            assert [r[0] for r in conn.execute("SELECT run FROM series")] == ["mixed"]
        # a late sample for the emptied series is stored again (a new series row)
        late = make_sample(999, run="old-run", ts=now)
        assert post(client, [late]).json()["accepted"] == 1
    assert stored(db) == 31


def test_limit_flags_reach_the_settings_and_bad_values_exit_2(tmp_path, monkeypatch, capsys) -> None:
    from vramwatch.cli import main
    from vramwatch.collector import server
    from vramwatch.collector.serving.app import Settings

    for args in (["--max-samples-per-run", "-1"], ["--retention-days", "soon"], ["--min-free-mb", "-5"]):
        with pytest.raises(SystemExit) as exc:
            main(["serve", *args])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and args[0] in err
    seen: list[Settings] = []
    monkeypatch.setattr(server, "serve", lambda settings, **kw: seen.append(settings))
    assert main(["serve", "--db", str(tmp_path / "x.db"), "--max-samples-per-run", "5000",
                 "--retention-days", "14", "--min-free-mb", "10"]) == 0
    assert main(["serve", "--db", str(tmp_path / "x.db"), "--max-samples-per-run", "0"]) == 0
    assert (seen[0].max_samples_per_run, seen[0].retention_days, seen[0].min_free_bytes) == (5000, 14, 10 * 2**20)
    assert (seen[1].max_samples_per_run, seen[1].retention_days) == (None, None)  # 0 turns a limit off
    with pytest.raises(ValueError, match="max_samples_per_run"):
        Settings(db_path="x", max_samples_per_run=0)
    with pytest.raises(ValueError, match="retention_days"):
        Settings(db_path="x", retention_days=-1)


# ------------------------------------------------------------------ browser-originated writes


def test_a_rebound_dns_name_cannot_reach_a_loopback_collector(tmp_path) -> None:
    with BackgroundServer(str(tmp_path / "vw.db")) as srv:
        for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example"):
            r = httpx.post(srv.url + "/api/v1/samples", content=ndjson(fresh(1)),
                           headers={"host": host, **NDJSON_HEADERS}, timeout=10)
            assert r.status_code == 421 and "allowed-host" in r.json()["detail"], host
            assert httpx.get(srv.url + "/api/v1/runs", headers={"host": host}, timeout=10).status_code == 421
        for host in (f"127.0.0.1:{srv.port}", f"localhost:{srv.port}", "localhost"):
            assert httpx.get(srv.url + "/healthz", headers={"host": host}, timeout=10).status_code == 200
    assert stored(str(tmp_path / "vw.db")) == 0
    # an explicit list: only those names (a LAN bind with a DNS name)
    with BackgroundServer(str(tmp_path / "vw2.db"), allowed_hosts=("collector.internal",)) as srv:
        assert httpx.get(srv.url + "/healthz", headers={"host": "collector.internal:8765"}).status_code == 200
        assert httpx.get(srv.url + "/healthz", headers={"host": "other.internal"}).status_code == 421


def test_allowed_host_keeps_ip_literals_so_probes_and_scrapes_by_pod_ip_work(tmp_path) -> None:
    """--allowed-host guards names (what a rebound page sends), not IP literals: the kubelet's
    probes and a ServiceMonitor's scrape name the pod by IP, the Docker HEALTHCHECK 127.0.0.1."""
    with BackgroundServer(str(tmp_path / "vw.db"), allowed_hosts=("vramwatch.example",)) as srv:
        ingest = httpx.post(srv.url + "/api/v1/samples", content=ndjson(fresh(3)),
                            headers={"host": "10.42.3.17:8765", **NDJSON_HEADERS}, timeout=10)
        assert ingest.status_code == 200 and ingest.json()["accepted"] == 3, ingest.text
        for host in ("10.42.3.17:8765", "10.42.3.17", "127.0.0.1", "[fd00::17]:8765", "[::1]"):
            assert httpx.get(srv.url + "/healthz", headers={"host": host}, timeout=10).status_code == 200, host
            metrics = httpx.get(srv.url + "/metrics", headers={"host": host}, timeout=10)
            assert metrics.status_code == 200 and "vramwatch_ooms_total{" in metrics.text, host
        for host in ("evil.example", "10.42.3.17.evil.example", "localhost"):  # names: only the listed one
            assert httpx.get(srv.url + "/metrics", headers={"host": host}, timeout=10).status_code == 421, host
        listed = httpx.get(srv.url + "/metrics", headers={"host": "vramwatch.example:8765"}, timeout=10)
        assert listed.status_code == 200


def test_allowed_host_flag_reaches_the_settings(tmp_path, monkeypatch) -> None:
    from vramwatch.cli import main
    from vramwatch.collector import server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda settings, **kw: seen.update(settings=settings))
    assert main(["serve", "--db", str(tmp_path / "vw.db"), "--allowed-host", "a.example", "--allowed-host",
                 "b.example", "--max-series", "7", "--max-connections", "9", "--header-timeout", "2"]) == 0
    settings = seen["settings"]
    assert settings.allowed_hosts == ("a.example", "b.example") and settings.max_series == 7
    assert settings.max_connections == 9 and settings.header_timeout_s == 2.0


# ------------------------------------------------------------------ token handling


def test_a_token_in_the_url_only_counts_for_the_first_page_load(tmp_path) -> None:
    with BackgroundServer(str(tmp_path / "vw.db"), token=TOKEN, auth_read=True) as srv, \
            httpx.Client(base_url=srv.url, timeout=10) as client:
        for path in ("/api/v1/runs", "/metrics", "/static/app.js", "/api/v1/meta"):
            assert client.get(path, params={"token": TOKEN}).status_code == 401, path
        assert client.get("/", params={"token": TOKEN}).status_code == 200
        assert client.get("/api/v1/runs").status_code == 200  # now with the cookie


def test_token_from_env_is_stripped_with_a_warning(tmp_path, monkeypatch, caplog) -> None:
    from vramwatch.cli import main
    from vramwatch.collector import server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda settings, **kw: seen.update(settings=settings))
    monkeypatch.setenv("VRAMWATCH_TOKEN", f"  {TOKEN} \n")
    with caplog.at_level(logging.WARNING):
        assert main(["serve", "--db", str(tmp_path / "vw.db")]) == 0
    assert seen["settings"].token == TOKEN
    assert any("whitespace" in r.getMessage() for r in caplog.records)
    assert TOKEN not in caplog.text


def test_rotating_forwarded_for_does_not_flood_the_refusal_log(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="vramwatch.collector")
    with BackgroundServer(str(tmp_path / "vw.db"), token=TOKEN) as srv, \
            httpx.Client(base_url=srv.url, timeout=10) as client:
        for i in range(50):
            r = post(client, fresh(1), {"x-forwarded-for": f"10.0.{i // 250}.{i % 250}"})
            assert r.status_code == 401
    lines = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1
