"""Shared fixtures. Test helpers (``helpers``, ``fakes``, ``prometheus_helpers``) import as
top-level modules: pytest's default ``prepend`` import mode puts this directory on
``sys.path`` (there is no ``tests/__init__.py``), so nothing here edits ``sys.path``."""

import pytest


@pytest.fixture(scope="module")
def module_collector(tmp_path_factory: pytest.TempPathFactory):
    """A real collector (uvicorn + SQLite on disk) shared by one test module; ``.db`` is its file."""
    from vramwatch.collector.server import BackgroundServer

    db = tmp_path_factory.mktemp("collector") / "vw.db"
    with BackgroundServer(str(db)) as server:
        server.db = db
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """A real collector already holding a simulated run ("fuzz": three ranks of 1,500 steps), with
    ``.client``: what generated and awkward input is posted to, so handlers do real work."""
    import time

    import httpx
    from helpers import NDJSON_HEADERS, ndjson

    from vramwatch.collector.server import BackgroundServer
    from vramwatch.probe.simulated import simulate_trace

    db = tmp_path_factory.mktemp("fuzz") / "vw.db"
    with BackgroundServer(str(db)) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        now = time.time()
        for rank, scenario in enumerate(("healthy", "checkpoint", "slow_leak")):
            trace = [{**s, "ts": now - 3000 + i} for i, s in
                     enumerate(simulate_trace(scenario, steps=1500, run="fuzz", rank=rank))]
            assert client.post("/api/v1/samples", content=ndjson(trace), headers=NDJSON_HEADERS).status_code == 200
        srv.client = client  # type: ignore[attr-defined]
        yield srv
