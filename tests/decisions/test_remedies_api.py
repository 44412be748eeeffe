"""Remedies through a real collector (uvicorn on loopback, SQLite on disk): the live /advice route,
the run stored and replayed by ``vramwatch advise --json`` and its text, all the same numbers as the
decisions computed from the samples themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers import ndjson
from memory_runs import watched_varlen

from vramwatch.decisions.advice import advise
from vramwatch.decisions.observe import observe
from vramwatch.simulation.tokens import token_truth

ROOT = Path(__file__).resolve().parents[2]
RUN = "remedies-api"
FLOOR = int(token_truth("varlen", rank=0, seed=0).floor_bytes)


@pytest.fixture(scope="module")
def posted(module_collector) -> tuple[str, list[dict]]:
    samples = watched_varlen(RUN, floor=FLOOR, change_at=1000)
    with httpx.Client(base_url=module_collector.url, timeout=60) as client:
        for i in range(0, len(samples), 5000):
            r = client.post("/api/v1/samples", content=ndjson(samples[i:i + 5000]),
                            headers={"content-type": "application/x-ndjson"})
            assert r.status_code == 200, r.text
    return module_collector.url, samples


def test_the_live_advice_route_carries_the_remedies_of_the_samples(posted) -> None:
    url, samples = posted
    doc = httpx.get(f"{url}/api/v1/runs/{RUN}/advice", timeout=60).json()
    offline = advise(observe(samples)[RUN]).as_dict()
    assert doc["remedies"] == offline["remedies"] and doc["remedies"]
    assert {r["remedy"] for r in doc["remedies"]} >= {"eight_bit_optimizer", "lora", "sharding",
                                                      "activation_checkpointing", "shorter_sequences"}
    facts = {f["rank"]: f for f in doc["memory"]}
    assert facts[0]["optimizer_bytes"] == 2 * (FLOOR // 2 // 2) and facts[1]["foreign_bytes"] == 2 * 2**30
    assert facts[0]["input_peak"]["correlation"] > 0.95


def test_advise_json_and_text_from_the_store(posted, module_collector) -> None:
    url, samples = posted
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "vramwatch", "advise", RUN, "--url", url, "--json"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["remedies"] == advise(observe(samples)[RUN]).as_dict()["remedies"]
    text = subprocess.run([sys.executable, "-m", "vramwatch", "advise", RUN, "--url", url],
                          capture_output=True, text=True, timeout=120, env=env).stdout
    assert f"remedies for rank {doc['remedies'][0]['rank']}, largest saving first:" in text
    assert "  - eight_bit_optimizer: Keep the optimizer state in 8 bits: saves" in text
    assert "inputs: rank 0's step peaks follow the longest sequence" in text
