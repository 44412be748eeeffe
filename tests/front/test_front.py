"""The federating front over node-local collectors: merging rules, peer lists, and a
three-shard run with a real Prometheus (peer discovery), a killed and restarted shard, and
the real hook spooling and replaying."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
from helpers import make_sample, ndjson, wait_until

from vramwatch import hook
from vramwatch.collector.server import BackgroundServer
from vramwatch.collector.store import Store
from vramwatch.front import FrontSettings, PeerError, PeerSource, parse_peers
from vramwatch.front.merge import (
    ShardAnswer,
    merge_advice,
    merge_figures,
    merge_heatmap,
    merge_postmortem,
    merge_ranks,
    merge_runs,
)
from vramwatch.front.server import BackgroundFront


# ---------------------------------------------------------------- merging rules (pure)
def test_merge_runs_sums_counts_and_keeps_the_worst():
    a = ShardAnswer("a", [{"run": "r", "ranks": 8, "hosts": 1, "samples": 80, "ooms": 0, "last_ts": 10.0,
                           "last_step": 9, "worst_state": "plateau", "worst_rank": 0, "min_headroom_bytes": 5,
                           "seconds_to_oom": None, "status": "running", "suspected_ooms": 2}])
    b = ShardAnswer("b", [{"run": "r", "ranks": 8, "hosts": 1, "samples": 70, "ooms": 1, "last_ts": 12.0,
                           "last_step": 11, "worst_state": "leak", "worst_rank": 9, "min_headroom_bytes": 3,
                           "seconds_to_oom": 60.0, "status": "crashed", "suspected_ooms": 1},
                          {"run": "other", "ranks": 1}],
                     stale=True)
    runs = {r["run"]: r for r in merge_runs([a, b])}
    r = runs["r"]
    assert (r["ranks"], r["hosts"], r["samples"], r["ooms"], r["suspected_ooms"]) == (16, 2, 150, 1, 3)
    assert (r["last_ts"], r["last_step"], r["min_headroom_bytes"], r["seconds_to_oom"]) == (12.0, 11, 3, 60.0)
    assert (r["worst_state"], r["worst_rank"], r["status"]) == ("leak", 9, "crashed")
    assert r["shards"] == ["a", "b"] and r["unreachable_shards"] == ["b"]


def test_merge_ranks_tags_shards_and_marks_stale_rows():
    rows = merge_ranks([ShardAnswer("a", [{"rank": 1, "host": "x"}]),
                        ShardAnswer("b", [{"rank": 0, "host": "y", "liveness": "live"}], "ConnectError", stale=True),
                        ShardAnswer("c", None, "ConnectError")])
    assert [(r["rank"], r["shard"], r.get("liveness")) for r in rows] == [(0, "b", "unreachable"), (1, "a", None)]
    assert rows[0]["unreachable"] is True


def test_merge_postmortem_and_advice():
    pm = merge_postmortem("r", [
        ShardAnswer("a", {"status": "crashed", "first_failure": {"rank": 3, "ts": 20.0, "cause": "silent"},
                          "ranks": [{"rank": 3}], "snapshots": []}),
        ShardAnswer("b", {"status": "crashed", "first_failure": {"rank": 9, "ts": 20.0, "cause": "oom"},
                          "ranks": [{"rank": 9}], "snapshots": [{"rank": 9}]}),
    ])
    assert pm["first_failure"]["rank"] == 9 and pm["first_failure"]["shard"] == "b"  # the OOM wins the tie
    assert [r["rank"] for r in pm["ranks"]] == [3, 9] and pm["status"] == "crashed"


def _split_run(name: str, ranks: int, shards: int, *, leak_rank: int | None = None) -> tuple[list, object]:
    """A run's ranks dealt over ``shards`` collectors: (each shard's observation, the whole run's)."""
    from vramwatch.decisions.observe import observe
    from vramwatch.simulation.tokens import token_trace

    per_rank = {r: token_trace("varlen", steps=2600, run=name, rank=r, seed=r, world_size=ranks,
                               **({"leak_onset": 1200, "leak_rate_frac": 0.0005} if r == leak_rank else {}))
                for r in range(ranks)}
    parts = [observe(s for r in range(i, ranks, shards) for s in per_rank[r])[name] for i in range(shards)]
    return parts, observe(s for r in range(ranks) for s in per_rank[r])[name]


@pytest.mark.parametrize("leak_rank", [None, 5])
def test_merged_advice_equals_one_collector_holding_every_rank(leak_rank):
    """The front decides on the union of the shards' ranks: the same readiness, binding rank, largest
    batch (per rank and global), projection and recommendation as one collector with all of them."""
    from vramwatch.decisions.advice import advise

    parts, whole = _split_run("adv", 6, 3, leak_rank=leak_rank)
    docs = [advise(p, target_tokens=20000).as_dict() for p in parts]
    merged = merge_advice([ShardAnswer(f"s{i}", d) for i, d in enumerate(docs)] + [ShardAnswer("down", None, "x")])
    expected = advise(whole, target_tokens=20000).as_dict()
    assert merged.pop("shards") == ["s0", "s1", "s2"]
    assert merged == expected
    assert expected["world_size"] == 6 and len(expected["ranks"]) == 6
    # the shards alone disagree with the run (each sees 2 ranks): the merge is not one of them
    assert expected["readiness"]["verdict"] == max((d["readiness"]["verdict"] for d in docs),
                                                   key=("ready", "not_ready", "unsafe").index)
    if leak_rank is not None:
        assert expected["readiness"]["verdict"] == "unsafe" and "leak" in expected["readiness"]["causes"]


def test_merged_figures_and_compare_equal_one_collector():
    from vramwatch.decisions.compare import RunFigures, compare

    a_parts, a_whole = _split_run("a", 4, 2)
    b_parts, b_whole = _split_run("b", 4, 2, leak_rank=2)
    fa = merge_figures("a", [ShardAnswer(f"s{i}", RunFigures.of(p).as_dict()) for i, p in enumerate(a_parts)])
    fb = merge_figures("b", [ShardAnswer("s1", RunFigures.of(b_parts[1]).as_dict()),
                             ShardAnswer("s0", RunFigures.of(b_parts[0]).as_dict())])
    assert fa["shards"] == ["s0", "s1"] and [r["rank"] for r in fa["ranks"]] == [0, 1, 2, 3]
    assert compare(RunFigures.from_dict(fa), RunFigures.from_dict(fb)).as_dict() == compare(a_whole, b_whole).as_dict()
    assert merge_figures("a", [ShardAnswer("s0", None, "404")]) is None


def test_merge_heatmap_folds_finer_shards_into_the_coarsest_grid():
    a = {"field": "headroom", "x": [0.5, 1.5, 2.5, 3.5], "bucket": 1, "rows": [{"host": "h", "rank": 1}],
         "z": [[9.0, 7.0, None, 8.0]], "unit": "GiB", "outside": 0}
    b = {"field": "headroom", "x": [1.0, 3.0, 5.0], "bucket": 2, "rows": [{"host": "g", "rank": 0}],
         "z": [[5.0, None, 4.0]], "unit": "GiB", "outside": 2}
    doc = merge_heatmap([ShardAnswer("A", a), ShardAnswer("B", b), ShardAnswer("C", None, "x")])
    assert doc["bucket"] == 2 and doc["x"] == [1.0, 3.0, 5.0] and doc["outside"] == 2
    assert [(r["rank"], r["shard"]) for r in doc["rows"]] == [(0, "B"), (1, "A")]
    assert doc["z"] == [[5.0, None, 4.0], [7.0, 8.0, None]]  # headroom: the least of the folded cells
    reserved = merge_heatmap([ShardAnswer("A", {**a, "field": "reserved"}),
                              ShardAnswer("B", {**b, "field": "reserved"})])
    assert reserved["z"][1] == [9.0, 8.0, None]  # bytes: the most
    wide = merge_heatmap([ShardAnswer("A", a), ShardAnswer("B", {**b, "x": [1001.0], "z": [[5.0]]})], cols=16)
    assert len(wide["x"]) == 32 and wide["bucket"] == 32 and wide["z"][0][-1] == 5.0  # 2 x cols at most


def test_peer_lists(tmp_path: Path):
    assert [p.name for p in parse_peers(["http://a:1", "b=http://b:2/x/", "# comment", ""])] == ["a:1", "b"]
    for bad in (["ftp://a"], ["http://a:1", "http://a:1"], ["nonsense"]):
        with pytest.raises(PeerError):
            parse_peers(bad)
    path = tmp_path / "peers.txt"
    path.write_text("http://a:1\n")
    source = PeerSource(file=str(path))
    assert [p.url for p in source.current()] == ["http://a:1"]
    path.write_text("http://a:1\nhttp://b:2\n")
    os.utime(path, (time.time() + 5, time.time() + 5))
    assert [p.url for p in source.current()] == ["http://a:1", "http://b:2"]
    path.write_text("garbage\n")
    os.utime(path, (time.time() + 10, time.time() + 10))
    assert len(source.current()) == 2  # a bad edit keeps the last good list
    with pytest.raises(PeerError):
        PeerSource(file=str(tmp_path / "missing.txt"))


# ---------------------------------------------------------------- a front over real collectors
def test_front_routes_rank_requests_to_the_owning_shard(tmp_path: Path):
    t0 = time.time() - 50
    with BackgroundServer(str(tmp_path / "a.db")) as a, BackgroundServer(str(tmp_path / "b.db")) as b:
        for shard, ranks in ((a, (0, 1)), (b, (2, 3))):
            samples = [make_sample(s, rank=r, host=f"h{r // 2}", ts=t0 + s) for r in ranks for s in range(20)]
            assert httpx.post(shard.url + "/api/v1/samples", content=ndjson(samples),
                              headers={"Content-Type": "application/x-ndjson"}).status_code == 200
        settings = FrontSettings(peers=PeerSource(static=parse_peers([a.url, "B=" + b.url])), timeout_s=1.0)
        with BackgroundFront(settings) as front, httpx.Client(base_url=front.url, timeout=10) as client:
            ranks = client.get("/api/v1/runs/run-a/ranks").json()
            assert [(r["rank"], r["shard"]) for r in ranks] == [(0, a.url[7:]), (1, a.url[7:]), (2, "B"), (3, "B")]
            # the polling page's delta request gets the full rows: versions are per shard
            delta = client.get("/api/v1/runs/run-a/ranks", params={"compact": 1, "since": 1, "limit": 1}).json()
            assert [r["rank"] for r in delta] == [0, 1, 2, 3] and not any("version" in r for r in delta)
            series = client.get("/api/v1/runs/run-a/series", params={"rank": 3, "fields": "allocated_bytes"})
            assert series.status_code == 200 and series.json()["raw_points"] == 20
            direct = httpx.get(b.url + "/api/v1/runs/run-a/series", params={"rank": 3, "fields": "allocated_bytes"})
            assert series.json()["series"] == direct.json()["series"]
            assert client.get("/api/v1/runs/run-a/series", params={"rank": 9}).status_code == 404
            assert client.get("/api/v1/runs/run-a/series", params={"rank": "x"}).status_code == 422
            assert client.get("/api/v1/runs/nope/ranks").status_code == 404
            assert client.get("/api/v1/runs").json()[0]["ranks"] == 4
            assert "vramwatch_front_peer_requests_total" in client.get("/metrics").text
            assert client.get("/").status_code == 200


@pytest.mark.prometheus
def test_three_shards_prometheus_discovery_kill_and_replay(tmp_path: Path):
    from prometheus_helpers import PrometheusServer, free_port, need_binary

    need_binary("prometheus")
    ports = [free_port() for _ in range(3)]
    shards = [BackgroundServer(str(tmp_path / f"s{i}.db"), port=ports[i]).start() for i in range(3)]
    monitors = []
    try:
        for i in range(3):
            for j in range(8):
                monitors.append(hook.init(shards[i].url, run="fed", host=f"node-{i}", rank=8 * i + j,
                                          probe="simulated", spool_dir=tmp_path / f"spool{i}-{j}",
                                          flush_interval_s=0.2))

        def run_steps(steps: range) -> None:
            for step in steps:
                for vw in monitors:
                    vw.step(step)

        run_steps(range(0, 50))
        for vw in monitors:
            assert vw.flush(10)
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
                  "scrape_configs": [{"job_name": "vramwatch", "honor_labels": True,
                                      "static_configs": [{"targets": [s.url[7:] for s in shards]}]}]}
        with PrometheusServer(tmp_path / "prom", config, {}) as prom:
            prom.wait_for('count(vramwatch_step{run="fed"})', lambda r: r and r[0]["value"][1] == "24")
            source = PeerSource(prometheus=prom.url, refresh_s=1.0)
            settings = FrontSettings(peers=source, timeout_s=1.0, cache_ttl_s=0.2)
            with BackgroundFront(settings) as front, httpx.Client(base_url=front.url, timeout=10) as client:
                union = set()
                for s in shards:
                    union |= {(r["host"], r["rank"], s.url[7:]) for r in httpx.get(
                        s.url + "/api/v1/runs/fed/ranks").json()}
                rows = client.get("/api/v1/runs/fed/ranks").json()
                assert {(r["host"], r["rank"], r["shard"]) for r in rows} == union and len(union) == 24

                shards[2].stop()  # one shard dies mid-run
                run_steps(range(50, 100))
                gone = shards[2].url[7:]
                started = time.monotonic()
                rows = client.get("/api/v1/runs/fed/ranks").json()
                assert time.monotonic() - started < settings.timeout_s + 1.0
                # the fan-out's brief cache may answer once more from before the stop
                rows = wait_until(lambda: (lambda rows: rows if all(
                    r["liveness"] == "unreachable" for r in rows if r["shard"] == gone) else None)(
                    client.get("/api/v1/runs/fed/ranks").json()), what="the dead shard's ranks unreachable")
                dead = [r for r in rows if r["shard"] == gone]
                assert len(dead) == 8 and all(r["liveness"] == "unreachable" for r in dead)
                assert all(r["verdict"]["state"] for r in dead)  # last known verdict kept
                for vw in monitors[:16]:
                    assert vw.flush(10)
                live = wait_until(lambda: (lambda rows: rows if all(r["last_step"] == 99 for r in rows) else None)(
                    [r for r in client.get("/api/v1/runs/fed/ranks").json() if r["shard"] != gone]),
                    what="the live shards' ranks at step 99")
                assert len(live) == 16 and all(r["last_step"] == 99 for r in live)
                assert client.get("/healthz").json()["unreachable"] == [shards[2].url[7:]]

                shards[2] = BackgroundServer(str(tmp_path / "s2.db"), port=ports[2]).start()
                for vw in monitors:
                    vw.close()
                rows = wait_until(lambda: (lambda rows: rows if not any(r.get("unreachable") for r in rows) and all(
                    r["last_step"] == 99 for r in rows) else None)(client.get("/api/v1/runs/fed/ranks").json()),
                    what="every rank back at step 99")
                assert not any(r.get("unreachable") for r in rows) and all(r["last_step"] == 99 for r in rows)
        shards[2].stop()
        store = Store(str(tmp_path / "s2.db"), readonly=True)
        try:
            # nothing lost: the spool replayed every step, plus the one exit-marked sample of each close()
            assert store.count("fed") == 8 * 100 + 8
        finally:
            store.close()
    finally:
        for vw in monitors:
            vw.close()
        for s in shards:
            s.stop()


def test_postmortem_through_the_front(tmp_path: Path):
    import subprocess
    import sys

    t0 = time.time() - 4000
    with BackgroundServer(str(tmp_path / "a.db")) as a, BackgroundServer(str(tmp_path / "b.db")) as b:
        for shard, rank, steps in ((a, 0, 1000), (b, 1, 300)):
            samples = [make_sample(s, rank=rank, host=f"h{rank}", ts=t0 + s) for s in range(steps)]
            httpx.post(shard.url + "/api/v1/samples", content=ndjson(samples),
                       headers={"Content-Type": "application/x-ndjson"}).raise_for_status()
        settings = FrontSettings(peers=PeerSource(static=parse_peers([a.url, b.url])), timeout_s=1.0)
        with BackgroundFront(settings) as front:
            proc = subprocess.run([sys.executable, "-m", "vramwatch.cli", "postmortem", "run-a", "--url", front.url,
                                   "--json"], capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, proc.stderr
            import json

            doc = json.loads(proc.stdout)
            assert doc["first_failure"]["rank"] == 1 and doc["first_failure"]["shard"] == b.url[7:]
            proc = subprocess.run([sys.executable, "-m", "vramwatch.cli", "postmortem", "run-a", "--url", front.url],
                                  capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0 and "first failure: rank 1" in proc.stdout, proc.stderr
            proc = subprocess.run([sys.executable, "-m", "vramwatch.cli", "postmortem", "nope", "--url", front.url],
                                  capture_output=True, text=True, timeout=60)
            assert proc.returncode == 2 and "404" in proc.stderr


def test_a_front_adds_up_the_shards_suspected_ooms(tmp_path: Path):
    """Device-only samples of one job (rank 0's memory vanishes near full, rank 1 flat) split over
    two shards, each a real collector: the front's runs row and tally count the suspected OOM that
    one shard's engine raised, once, and never as an OOM; a tally without the count (an older
    shard) adds as 0."""
    from incident_runs import device_oom

    from vramwatch.runlife import RunTally

    trace = device_oom("dev-split", end=time.time() - 1)
    with BackgroundServer(str(tmp_path / "a.db")) as a, BackgroundServer(str(tmp_path / "b.db")) as b:
        for shard, rank in ((a, 0), (b, 1)):
            _post_all(shard.url, [s for s in trace if s["rank"] == rank])
        settings = FrontSettings(peers=PeerSource(static=parse_peers([a.url, b.url])), timeout_s=5.0)
        with BackgroundFront(settings) as front:
            (row,) = [r for r in httpx.get(front.url + "/api/v1/runs", timeout=30).json() if r["run"] == "dev-split"]
    assert (row["ranks"], row["suspected_ooms"], row["ooms"]) == (2, 1, 0)
    assert (row["tally"]["suspected_ooms"], row["tally"]["ooms"], row["status"]) == (1, 0, "running")
    older = {k: v for k, v in row["tally"].items() if k != "suspected_ooms"}
    assert (RunTally.from_dict(older) + RunTally.from_dict(row["tally"])).suspected_ooms == 1


# ---------------------------------------------------------------- run-level answers over --url
def _cli(*args: str) -> tuple[int, str, str]:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "vramwatch.cli", *args], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def _post_all(url: str, samples: list[dict]) -> None:
    for i in range(0, len(samples), 5000):
        httpx.post(url + "/api/v1/samples", content=ndjson(samples[i:i + 5000]),
                   headers={"Content-Type": "application/x-ndjson"}, timeout=30).raise_for_status()


def test_advise_compare_gate_report_over_a_front_equal_one_collector(tmp_path: Path):
    """Runs spread over two shards: ``--url FRONT`` gives what one collector holding every rank
    gives (advise, compare, gate), the report covers every rank, captures and snapshots go
    through the front, and the front's API lists every read route a collector has."""
    import gzip
    import json
    import re

    from vramwatch.simulation.tokens import regression_overrides, token_trace

    def trace(run: str, rank: int, **overrides) -> list[dict]:
        return token_trace("varlen", steps=2600, run=run, rank=rank, seed=rank, world_size=4, **overrides)

    runs = {"base": {r: trace("base", r) for r in range(4)},
            "cand": {r: trace("cand", r, **(regression_overrides("varlen", 0.08) if r == 3 else {})) for r in range(4)}}
    with BackgroundServer(str(tmp_path / "a.db")) as a, BackgroundServer(str(tmp_path / "b.db")) as b, \
            BackgroundServer(str(tmp_path / "whole.db")) as whole:
        for ranks in runs.values():
            _post_all(a.url, [s for r in (0, 1) for s in ranks[r]])  # node-local: ranks 0-1 on a, 2-3 on b
            _post_all(b.url, [s for r in (2, 3) for s in ranks[r]])
            _post_all(whole.url, [s for r in range(4) for s in ranks[r]])
        settings = FrontSettings(peers=PeerSource(static=parse_peers(["A=" + a.url, "B=" + b.url])), timeout_s=5.0,
                                 cache_ttl_s=0.0)
        with BackgroundFront(settings) as front, httpx.Client(base_url=front.url, timeout=30) as client:
            for args in (("advise", "cand", "--json", "--target-tokens", "20000"),
                         ("compare", "base", "cand", "--json")):
                code, out, err = _cli(*args, "--url", front.url)
                assert code == 0, err
                expected = _cli(*args, "--url", whole.url)
                assert expected[0] == 0 and json.loads(out) == json.loads(expected[1])
            doc = json.loads(_cli("advise", "cand", "--json", "--url", front.url)[1])
            assert doc["world_size"] == 4 and [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3]
            code, out, _ = _cli("advise", "cand", "--url", front.url)
            assert code == 0 and out == _cli("advise", "cand", "--url", whole.url)[1] and "run cand:" in out
            gate = _cli("gate", "base", "cand", "--url", front.url)
            assert gate[0] == 1 and "FAIL" in gate[1] and "rank 3" in gate[1]
            assert gate[1] == _cli("gate", "base", "cand", "--url", whole.url)[1]
            assert _cli("gate", "base", "base", "--url", front.url)[0] == 0
            assert client.get("/api/v1/compare", params={"a": "base", "b": "cand"}).json() == \
                httpx.get(whole.url + "/api/v1/compare", params={"a": "base", "b": "cand"}).json()
            missing = _cli("compare", "base", "nope", "--url", front.url)
            assert missing[0] == 2 and "nope" in missing[2]
            bad = client.get("/api/v1/runs/cand/advice", params={"margin": "2"})
            assert bad.status_code == 422 and "margin" in bad.text

            code, _, err = _cli("report", "cand", "--url", front.url, "--out", str(tmp_path / "r.html"))
            assert code == 0, err
            page = (tmp_path / "r.html").read_text()
            data = json.loads(re.search(r"window\.VRAMWATCH_STATIC = (\{.*?\});</script>", page, re.S).group(1))
            assert sorted(r["rank"] for r in data["ranks"]) == [0, 1, 2, 3]
            assert {k.split("\u0000")[1] for k in data["series"]} == {"0", "1", "2", "3"}
            assert [r["rank"] for r in data["heatmap"]["step"]["headroom"]["rows"]] == [0, 1, 2, 3]
            for field in ("headroom", "reserved"):  # the front's grid is the one collector's grid
                merged = client.get("/api/v1/runs/cand/heatmap", params={"field": field}).json()
                one = httpx.get(whole.url + "/api/v1/runs/cand/heatmap", params={"field": field}).json()
                assert (merged["x"], merged["z"], merged["bucket"]) == (one["x"], one["z"], one["bucket"])
                assert [(r["rank"], r["shard"]) for r in merged["rows"]] == [(0, "A"), (1, "A"), (2, "B"), (3, "B")]

            # captures through the front reach the owning shard; the shard's 4xx comes back as is
            one = client.post("/api/v1/runs/cand/capture", json={"rank": 2, "steps": 3})
            assert one.status_code == 200 and one.json()["ranks"] == [2]
            every = client.post("/api/v1/runs/cand/capture", json={"steps": 3}).json()
            assert every["ranks"] == [0, 1, 2, 3]
            assert client.post("/api/v1/runs/cand/capture", json={"steps": -1}).status_code == 422
            assert client.post("/api/v1/runs/cand/capture", content=b"{}").status_code == 415
            # a snapshot stored on shard B downloads through the front
            blob = b"snapshot bytes" * 1000
            httpx.post(b.url + "/api/v1/snapshots", params={"run": "cand", "host": "h", "rank": 2, "step": 7},
                       content=gzip.compress(blob), headers={"Content-Type": "application/octet-stream"}
                       ).raise_for_status()
            listed = client.get("/api/v1/runs/cand/snapshots").json()
            assert [(s["rank"], s["shard"]) for s in listed] == [(2, "B")] and "shard=B" in listed[0]["url"]
            assert client.get(listed[0]["url"]).content == blob
            assert client.get("/api/v1/snapshots/" + "0" * 32).status_code == 404

            # the dashboard finds its optional routes in the OpenAPI document: the front lists every
            # read route a collector has
            def get_paths(url: str) -> set[str]:
                paths = httpx.get(url + "/openapi.json").json()["paths"]
                return {p for p, ops in paths.items() if "get" in ops and p.startswith("/api/v1/")}

            assert get_paths(whole.url) - get_paths(front.url) == set()
    dead = f"http://127.0.0.1:{__import__('prometheus_helpers').free_port()}"
    assert _cli("advise", "cand", "--url", dead)[0] == 3  # unreachable: neither ready nor not ready, as gate
    assert _cli("gate", "base", "cand", "--url", dead)[0] == 3


def test_a_front_has_the_collectors_host_check_and_read_deadline() -> None:
    """The front listens like a collector, so it is protected like one: a Host that is not a
    loopback name is refused (421: a page on an attacker's DNS name cannot reach a loopback
    front), and a client that trickles its headers is cut off at the header deadline (408)."""
    import socket

    settings = FrontSettings(peers=PeerSource(static=parse_peers(["http://127.0.0.1:9"])), header_timeout_s=0.5)
    with BackgroundFront(settings) as front:
        ok = httpx.get(f"{front.url}/healthz", timeout=10)
        assert ok.status_code != 421
        rebound = httpx.get(f"{front.url}/api/v1/runs", headers={"Host": "evil.example"}, timeout=10)
        assert rebound.status_code == 421 and "evil.example" in rebound.json()["detail"]
        with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
            started = time.monotonic()
            sock.sendall(b"GET /api/v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")  # and never more
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 5
