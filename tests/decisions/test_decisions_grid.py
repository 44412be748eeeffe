"""The seed procedure end to end in the operator's units, through the real CLI and a real collector
(uvicorn on loopback, SQLite on disk): global batches typed and read, settable batches only, the
seed's fallbacks reachable, a grid that never forces a deeper cut than the procedure, the runway in
time. The KoHRM job: 8 ranks, 22,528 token slots per GPU = 180,224 global (two ranks simulated)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import ndjson

from vramwatch.decisions.grid import choose
from vramwatch.simulation.stories import story_trace
from vramwatch.simulation.tokens import token_trace

ROOT = Path(__file__).resolve().parents[2]
PROVEN, TRIED, AGAIN, DECLARED, LEAK = "kohrm-180k", "kohrm-196k", "kohrm-again", "kohrm-declared", "kohrm-leak"


def vw(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "vramwatch", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def post(url: str, samples: list[dict[str, Any]]) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(0, len(samples), 5000):
            r = c.post("/api/v1/samples", content=ndjson(samples[i:i + 5000]),
                       headers={"content-type": "application/x-ndjson"})
            assert r.status_code == 200, r.text


def declaring(samples: list[dict[str, Any]], grid: int) -> list[dict[str, Any]]:
    """The training loop declares its grid: ``vw.step(step, tokens=n, token_grid=grid)``."""
    return [{**s, "extra": {"token_grid": grid}} if s["phase"] == "train" else s for s in samples]


@pytest.fixture(scope="module")
def url(module_collector) -> str:
    post(module_collector.url, story_trace("proven", run=PROVEN))
    post(module_collector.url, story_trace("try_alone", run=TRIED))
    post(module_collector.url, story_trace("recurrence", run=AGAIN))
    post(module_collector.url, declaring(story_trace("proven", run=DECLARED), 2048))
    post(module_collector.url, [s for r in range(2) for s in token_trace(
        "fixed", steps=3000, run=LEAK, rank=r, seed=r, world_size=2, leak_onset=1200, leak_rate_frac=3.5e-5)])
    return module_collector.url


def advise(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return vw("advise", *args, "--url", url)


def advise_json(url: str, *args: str) -> dict[str, Any]:
    r = advise(url, *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_seed_procedure_in_global_tokens(url: str) -> None:
    # 1. 180,224 held: raise to the seed's next batch, 196,608, named global first
    r = advise(url, PROVEN)
    assert r.returncode == 0, r.stderr
    assert "next: Raise to 196,608 global tokens per step (24,576 per rank, +9.1%)" in r.stdout
    assert "grid: settable in steps of 8,192 global (1,024 per rank), inferred" in r.stdout
    assert "largest settable batch that keeps 5% free: 196,608 global (24,576 per rank x 8 ranks)" in r.stdout
    # 2. the operator types the global batch the notes speak of, and reads it back
    r = advise(url, PROVEN, "--target-global-tokens", "196608")
    assert "at 196,608 global (24,576 per rank): fits" in r.stdout
    # 3. 196,608 ran out of memory at its first checkpoint: straight back to 180,224
    doc = advise_json(url, TRIED, "--reference", PROVEN, "--target-global-tokens", "196608")
    assert doc["evidence"]["oom_ceiling"]["phase"] == "checkpoint"
    assert doc["target"] == {**doc["target"], "global_tokens_per_step": 196608, "tokens_per_step": 24576,
                             "fits": False}
    assert (doc["next"]["action"], doc["next"]["global_tokens_per_step"]) == ("back_off", 180224)
    assert doc["next"]["sentence"].startswith("Back off to 180,224 global tokens per step (22,528 per rank, -8.3%)")
    # the largest settable batch, never 24,575 or 196,600: the proven one
    assert (doc["max_global_tokens_per_step"], doc["max_tokens_per_step"]) == (180224, 22528)
    # 4. the same run with nothing proven to go back to: the procedure's cut, not a 16.7 % one
    alone = advise_json(url, TRIED)
    assert alone["next"]["global_tokens_per_step"] == 180224 and alone["next"]["action"] == "back_off"
    assert alone["max_tokens_per_step"] % alone["evidence"]["granularity"] == 0


def test_a_repeated_oom_cuts_inside_the_seed_window_and_its_fallbacks_are_settable(url: str) -> None:
    doc = advise_json(url, AGAIN)
    step = doc["next"]
    assert step["action"] == "back_off" and step["because"]["cause"] == "recurrence"
    cut = 1 - step["global_tokens_per_step"] / 180224
    assert 0.05 <= cut <= 0.10, step["sentence"]
    grid = doc["evidence"]["grid"]
    assert step["global_tokens_per_step"] % grid["global_tokens_per_step"] == 0
    assert grid == {**grid, "global_tokens_per_step": 8192, "source": "inferred", "strict": True}
    # the seed's fallback 172,032 is on the grid: typed, it is judged (below the proven 180,224: it fits)
    r = advise(url, PROVEN, "--target-global-tokens", "172032")
    assert r.returncode == 0 and "at 172,032 global (21,504 per rank): fits" in r.stdout


def test_a_target_off_the_grid_is_one_line_naming_it(url: str) -> None:
    r = advise(url, PROVEN, "--target-global-tokens", "180000")
    assert r.returncode == 2 and not r.stdout and len(r.stderr.strip().splitlines()) == 1
    assert "not on the grid: settable in steps of 8,192 global (1,024 per rank)" in r.stderr
    assert "nearest 172,032 or 180,224 global" in r.stderr
    r = advise(url, PROVEN, "--target-global-tokens", "180225")  # does not split over 8 ranks
    assert r.returncode == 2 and "does not split equally over 8 ranks" in r.stderr
    for params in ({"target_global_tokens": 180000}, {"target_tokens": 22500}, {"target_global_tokens": 0},
                   {"target_global_tokens": "big"}, {"target_tokens": 22528, "target_global_tokens": 180224}):
        resp = httpx.get(f"{url}/api/v1/runs/{PROVEN}/advice", params=params)
        assert resp.status_code == 422, (params, resp.text)
        assert "target_" in resp.text
    resp = httpx.get(f"{url}/api/v1/runs/{PROVEN}/advice", params={"target_global_tokens": 180000})
    assert "8,192 global (1,024 per rank)" in resp.json()["detail"]


def test_a_declared_grid_wins_and_is_said(url: str) -> None:
    doc = advise_json(url, DECLARED)
    grid = doc["evidence"]["grid"]
    assert (grid["tokens_per_step"], grid["source"]) == (2048, "declared")
    assert doc["evidence"]["granularity"] == 2048 and doc["evidence"]["granularity_inferred"] is False
    assert doc["next"]["tokens_per_step"] % 2048 == 0
    r = advise(url, DECLARED, "--target-global-tokens", "172032")  # 21,504 is not on a 2,048 grid
    assert r.returncode == 2 and "16,384 global (2,048 per rank), declared" in r.stderr
    # the operator's word beats the declaration
    assert advise_json(url, DECLARED, "--granularity", "512")["evidence"]["grid"]["source"] == "option"


def test_during_a_leak_the_largest_batch_is_hidden_and_the_runway_is_in_hours(url: str) -> None:
    r = advise(url, LEAK)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("largest settable batch"))
    assert "not shown:" in line and "leak" in line and "per rank x" not in line
    doc = advise_json(url, LEAK)
    assert doc["max_tokens_per_step"] is None and doc["max_tokens_hidden"]["cause"] == "leak"
    rank = min((x for x in doc["readiness"]["ranks"] if x["steps_to_oom"] is not None),
               key=lambda x: x["steps_to_oom"])
    pace = rank["seconds_to_oom"] / rank["steps_to_oom"]
    assert pace == pytest.approx(1.0, rel=0.05)  # the simulated job's own step time
    assert f"({rank['steps_to_oom']:,} steps at {pace:.2f} s/step)" in r.stdout
    assert " min (" in r.stdout and "next: Fix first" in r.stdout


@pytest.mark.parametrize(("seen", "step"), [
    ([22528], 1024), ([24576], 1024), ([22528, 24576], 1024), ([22528, 21504], 1024), ([24000], 1200),
    ([4096 * 5], 1024), ([100_003], 1),
])
def test_an_inferred_grid_keeps_every_batch_seen_and_a_settable_batch_in_the_window(seen: list[int],
                                                                                     step: int) -> None:
    grid = choose(None, None, seen, 0)
    assert grid.step == step and all(x % grid.step == 0 for x in seen)
    for x in seen:  # a back-off of 5-10 % always has a settable batch
        assert 0.90 * x <= grid.settable(0.95 * x) <= 0.95 * x


def test_a_fragmenting_run_shows_no_largest_batch_never_0() -> None:
    from vramwatch.decisions.advice import advise
    from vramwatch.decisions.observe import observe

    frag = {"leak_rank": 1, "frag_onset": 700, "frag_rate_frac": 4e-5}
    samples = [s for r in range(2) for s in token_trace("fixed", steps=3000, run="frag", rank=r, seed=r, world_size=2,
                                                        **(frag if r == 1 else {}))]
    a = advise(observe(samples)["frag"])
    assert "fragmentation" in a.readiness.causes
    assert a.max_tokens_per_step is None and a.max_global_tokens_per_step is None
    assert a.max_hidden.cause == "fragmentation" and a.max_hidden.rank == 1 and "not shown" in a.max_hidden.text
    assert a.next.action == "fix" and a.next.tokens_per_step == 22528  # the current batch, settable


@pytest.mark.parametrize(("extra", "step"), [
    ({"token_grid": 2048}, 2048), ({"seq_len": 4096}, 4096), ({"seq_len": 4096, "grad_accum": 2}, 8192),
    ({"token_grid": 1024, "seq_len": 4096}, 1024), ({"token_grid": 0}, None), ({"token_grid": 1.5}, None),
    ({"seq_len": -4096}, None), ({"token_grid": True}, None), ({"loss": 2.3}, None), (None, None),
])
def test_a_declared_grid_is_read_from_the_step_s_numbers(extra: Any, step: int | None) -> None:
    from vramwatch.decisions.grid import declared_step

    assert declared_step(extra) == step
