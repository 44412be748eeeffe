"""``POST /api/v1/samples``: the ingest route's attacks and limits. Every refusal is a 4xx naming
the limit or the field, nothing is stored, and nothing is a traceback in the collector's log."""

from __future__ import annotations

import socket
import time

import httpx
import orjson
import pytest
from helpers import NDJSON_HEADERS, gz, make_sample, ndjson

from vramwatch.collector.server import BackgroundServer


@pytest.fixture
def collector(tmp_path):
    with BackgroundServer(str(tmp_path / "vw.db")) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        srv.client = client  # type: ignore[attr-defined]
        yield srv


def stored(srv) -> int:
    return srv.client.get("/healthz").json()["series"]


DEEP = 5000


def _deep_object(depth: int = DEEP) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


def _deep_array(depth: int = DEEP) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(("what", "body", "gzipped"), [
    ("object line", _deep_object(), False),
    ("object line, gzip", _deep_object(), True),
    ("array body", b"[" + _deep_object() + b"]", False),
    ("nested array", _deep_array(), False),
    ("after a good line", ndjson([make_sample(0)]) + _deep_object() + b"\n", False),
    ("inside extra", orjson.dumps(make_sample(0))[:-1] + b',"extra":{"loss":' + _deep_object() + b"}}", True),
])
def test_json_nested_thousands_deep_is_a_400_naming_the_limit(collector, caplog, what, body, gzipped) -> None:
    headers = {**NDJSON_HEADERS, **({"content-encoding": "gzip"} if gzipped else {})}
    r = collector.client.post("/api/v1/samples", content=gz(body) if gzipped else body, headers=headers)
    assert r.status_code == 400, (what, r.status_code, r.text[:300])
    assert "nested deeper than 1024 levels" in r.json()["detail"], r.text[:300]
    assert stored(collector) == 0
    assert [rec.getMessage() for rec in caplog.records if rec.exc_info] == []


def test_json_nested_within_the_parser_limit_is_a_422_naming_the_field(collector) -> None:
    """Deep enough to exhaust the one-pass decoder's recursion, shallow enough for the line parser:
    the sample is judged, and refused for what it is."""
    sample = orjson.dumps(make_sample(0))[:-1] + b',"extra":{"loss":' + _deep_object(1000) + b"}}"
    r = collector.client.post("/api/v1/samples", content=sample + b"\n" + _deep_object(1000), headers=NDJSON_HEADERS)
    assert r.status_code == 422, r.text[:300]
    assert [(e["index"], e["field"]) for e in r.json()["errors"]] == [(0, "extra.loss"), (1, "schema")]
    assert stored(collector) == 0


def test_clients_leaving_mid_body_are_counted_in_one_civil_line_not_tracebacks(collector, caplog) -> None:
    """Thirty clients send half of what their Content-Length promised and leave: nothing stored,
    nothing answered, no traceback; one rate-limited line says so."""
    body = ndjson([make_sample(i) for i in range(100)])
    head = (f"POST /api/v1/samples HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-ndjson\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    for _ in range(30):
        with socket.create_connection((collector.host, collector.port)) as sock:
            sock.sendall(head + body[: len(body) // 2])
    ingestor = collector.app.state.ingestor
    deadline = time.monotonic() + 20
    while ingestor.clients_left < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ingestor.clients_left == 30
    assert [rec.getMessage() for rec in caplog.records if rec.exc_info] == []
    assert not any("Traceback" in rec.getMessage() or "Exception in ASGI" in rec.getMessage()
                   for rec in caplog.records)
    lines = [rec.getMessage() for rec in caplog.records if "left before sending its whole body" in rec.getMessage()]
    assert len(lines) == 1, lines
    assert stored(collector) == 0
    r = collector.client.post("/api/v1/samples", content=body, headers=NDJSON_HEADERS)  # and it still serves
    assert r.status_code == 200 and r.json()["accepted"] == 100
