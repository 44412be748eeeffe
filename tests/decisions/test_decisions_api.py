"""The advice and compare routes through a real collector (uvicorn on loopback, SQLite on disk)."""

from __future__ import annotations

import httpx
import pytest
from fastapi import HTTPException
from helpers import ndjson

from vramwatch.simulation.tokens import regression_overrides, token_trace, token_truth


def post(client: httpx.Client, samples: list[dict]) -> None:
    for i in range(0, len(samples), 5000):
        r = client.post("/api/v1/samples", content=ndjson(samples[i:i + 5000]),
                        headers={"content-type": "application/x-ndjson"})
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def client(module_collector):
    with httpx.Client(base_url=module_collector.url, timeout=30) as c:
        yield c


def test_advice_route_document_and_cache_invalidation(client) -> None:
    samples = [s for r in range(2) for s in token_trace("varlen", steps=3200, run="api-run", rank=r, seed=r,
                                                         world_size=2)]
    early = [s for s in samples if s["step"] <= 1500]
    post(client, early)
    first = client.get("/api/v1/runs/api-run/advice", params={"target_tokens": 20000})
    assert first.status_code == 200, first.text
    doc = first.json()
    assert doc["readiness"]["verdict"] == "not_ready"
    assert doc["readiness"]["plateau_steps"] < 2000 and doc["readiness"]["worst_rank"] in (0, 1)
    truth = token_truth("varlen", rank=0, seed=0)
    assert doc["max_tokens_per_step"] == pytest.approx(truth.max_tokens(0.05), rel=0.03)
    assert doc["max_global_tokens_per_step"] == 2 * doc["max_tokens_per_step"]
    assert doc["target"]["tokens_per_step"] == 20000 and doc["target"]["fits"] is True
    assert doc["recommendation"].startswith("Hold")
    post(client, [s for s in samples if s["step"] > 1500])  # the run goes on: a fresh answer
    later = client.get("/api/v1/runs/api-run/advice").json()
    assert later["readiness"]["verdict"] == "ready" and later["target"] is None
    assert later["readiness"]["plateau_steps"] > doc["readiness"]["plateau_steps"]
    tighter = client.get("/api/v1/runs/api-run/advice", params={"margin": 0.1}).json()
    assert tighter["max_tokens_per_step"] < later["max_tokens_per_step"]


@pytest.mark.parametrize(("params", "field"), [
    ({"margin": "1.5"}, "margin"), ({"margin": "nan"}, "margin"), ({"target_tokens": "0"}, "target_tokens"),
    ({"target_tokens": "many"}, "target_tokens"),
])
def test_advice_route_rejects_bad_parameters_naming_them(client, params: dict, field: str) -> None:
    post(client, token_trace("varlen", steps=50, run="api-bad", seed=3))
    r = client.get("/api/v1/runs/api-bad/advice", params=params)
    assert r.status_code == 422 and field in r.text


def test_unknown_run_is_404(client) -> None:
    assert client.get("/api/v1/runs/no-such-run/advice").status_code == 404
    assert client.get("/api/v1/compare", params={"a": "no-such-run", "b": "x"}).status_code == 404
    assert client.get("/api/v1/compare", params={"a": "x"}).status_code == 422


def test_compare_route(client) -> None:
    post(client, token_trace("varlen", steps=1200, run="cmp-a", seed=5))
    post(client, token_trace("varlen", steps=1200, run="cmp-b", seed=6, **regression_overrides("varlen", 0.06)))
    doc = client.get("/api/v1/compare", params={"a": "cmp-a", "b": "cmp-b"}).json()
    assert doc["a"] == "cmp-a" and doc["b"] == "cmp-b"
    train = next(m for m in doc["metrics"] if m["metric"] == "peak_bytes" and m["phase"] == "train")
    assert 0.05 < train["growth"] < 0.07


def test_run_names_with_slashes_reach_the_advice_route(client) -> None:
    post(client, token_trace("varlen", steps=400, run="team/exp-1", seed=7))
    r = client.get("/api/v1/runs/team/exp-1/advice")
    assert r.status_code == 200, r.text
    assert r.json()["run"] == "team/exp-1" and r.json()["readiness"]["verdict"] == "not_ready"


def test_advice_route_takes_reference_runs(client) -> None:
    post(client, token_trace("fixed", steps=800, run="ref-main", seed=1))
    post(client, token_trace("fixed", steps=400, run="ref-small", seed=2, tokens_per_step=16384))
    alone = client.get("/api/v1/runs/ref-main/advice").json()
    both = client.get("/api/v1/runs/ref-main/advice", params={"reference": "ref-small"}).json()
    assert alone["ranks"][0]["fit"] == "proportional" and both["ranks"][0]["fit"] == "across_runs"
    truth = token_truth("fixed", seed=1)
    assert both["max_tokens_per_step"] == pytest.approx(truth.max_tokens(0.05), rel=0.02)
    missing = client.get("/api/v1/runs/ref-main/advice", params={"reference": "nope"})
    assert missing.status_code == 404 and "reference" in missing.text


def test_advice_reads_the_collector_s_live_tracks_and_a_replay_agrees(client, module_collector) -> None:
    """The collector decides on the engines it already holds; replaying the same samples gives the
    same answer (the live engines keep no step times: the only figure that differs)."""
    import sqlite3

    from vramwatch.decisions.advice import advise
    from vramwatch.decisions.observe import observe
    from vramwatch.simulation.stories import story_trace

    samples = story_trace("raise_ooms", run="live-story")
    post(client, samples)
    live = client.get("/api/v1/runs/live-story/advice", params={"target_tokens": 24576}).json()
    replayed = advise(observe(samples)["live-story"], target_tokens=24576).as_dict()
    for doc in (live, replayed):
        for model in doc["models"]:
            model["step_time_s"] = None
    assert live == replayed
    assert live["next"]["action"] == "back_off" and live["next"]["tokens_per_step"] == 22528
    assert live["target"]["fits"] is False and live["evidence"]["oom_ceiling"]["tokens"] == 24576
    # the store is not read again: with the run's rows gone the live answer stands
    con = sqlite3.connect(module_collector.db)
    with con:
        con.execute("DELETE FROM samples WHERE series IN (SELECT id FROM series WHERE run = 'live-story')")
    con.close()
    again = client.get("/api/v1/runs/live-story/advice", params={"target_tokens": 24576, "margin": 0.0501})
    assert again.status_code == 200 and again.json()["next"]["action"] == "back_off"


def test_advice_of_a_run_rebuilt_from_the_store_is_the_live_advice(client, module_collector) -> None:
    """A run no longer in memory is revived from the store into the live state's own engines (no
    replay beside them): its advice is the one the live tracks gave (real SQLite, the collector's
    own file)."""
    from types import SimpleNamespace

    from vramwatch.collector.reads.advice import run_view_of
    from vramwatch.collector.state.live import LiveState
    from vramwatch.collector.store import Store
    from vramwatch.decisions.advice import decide
    from vramwatch.decisions.readiness import ReadinessConfig
    from vramwatch.simulation.stories import story_trace

    post(client, story_trace("backed_off", run="plain-story"))
    live_doc = client.get("/api/v1/runs/plain-story/advice").json()
    store = Store(str(module_collector.db), readonly=True)
    try:
        rebuilt = LiveState()
        rebuilt.rebuild(store.iter_samples("plain-story"))
        request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(live=rebuilt, store=store)))
        config = ReadinessConfig()
        doc = decide(run_view_of(request, "plain-story", config), [], config=config).as_dict()
        with pytest.raises(HTTPException) as missing:
            run_view_of(request, "no-such-run", config)
    finally:
        store.close()
    assert missing.value.status_code == 404
    assert doc["next"] == live_doc["next"] and doc["next"]["action"] == "hold"
    assert doc["evidence"] == live_doc["evidence"] and doc["readiness"] == live_doc["readiness"]
