"""Remedies for the binding rank, from the run's own numbers: each saving against the categories the
samples carried, each batch after through the same model advise uses, expandable segments only where
the torch version and allocator settings allow it; the input-peak finding; a front's join agrees."""

from __future__ import annotations

from dataclasses import replace

import pytest
from memory_runs import fragmented, watched_varlen

from vramwatch.decisions.advice import advise, join
from vramwatch.decisions.memory import InputPeak
from vramwatch.decisions.observe import observe
from vramwatch.decisions.remedies import CHECKPOINT_KEEPS, EIGHT_BIT_SAVES, REMEDIES, Remedy
from vramwatch.simulation.tokens import token_truth

TRUTH = token_truth("varlen", rank=0, seed=0)
FLOOR = int(TRUTH.floor_bytes)


@pytest.fixture(scope="module")
def doc() -> dict:
    samples = watched_varlen("rem", floor=FLOOR, change_at=1000)
    return advise(observe(samples)["rem"]).as_dict()


def by_name(doc: dict) -> dict[str, dict]:
    return {r["remedy"]: r for r in doc["remedies"]}


def test_each_saving_is_the_run_s_own_categories(doc: dict) -> None:
    found = by_name(doc)
    rank = doc["binding_rank"]
    facts = next(f for f in doc["memory"] if f["rank"] == rank)
    p, g, o = FLOOR // 4, FLOOR // 4, 2 * (FLOOR // 2 // 2)  # the state doubled at step 1000: carried forward
    assert (facts["params_bytes"], facts["grads_bytes"], facts["optimizer_bytes"]) == (p, g, o)
    assert facts["activation_bytes"] == facts["peak_bytes"] - p - g - o
    assert found["eight_bit_optimizer"]["saves_bytes"] == int(EIGHT_BIT_SAVES * o)
    assert found["lora"]["saves_bytes"] == g + o
    assert found["sharding"]["saves_bytes"] == int((p + g + o) / 2)  # two ranks
    assert all(r["rank"] == rank and set(r) >= {"remedy", "saves_bytes", "rank", "tokens_per_step_after", "costs",
                                                 "basis", "text"} for r in doc["remedies"])
    assert [r["saves_bytes"] for r in doc["remedies"]] == sorted((r["saves_bytes"] for r in doc["remedies"]),
                                                                 reverse=True)
    assert set(found) <= set(REMEDIES)
    # no fragmentation verdict: no allocator setting offered; rank 1's other process is not the binding rank's
    assert "expandable_segments" not in found


def test_the_batch_after_goes_through_the_same_model(doc: dict) -> None:
    found = by_name(doc)
    m = next(x for x in doc["models"] if x["rank"] == doc["binding_rank"])
    # the truth with the saving taken off the floor: the model's answer within its stated uncertainty
    saved = found["eight_bit_optimizer"]["saves_bytes"]
    after = replace(TRUTH, floor_bytes=TRUTH.floor_bytes - saved).max_tokens(doc["margin"])
    assert found["eight_bit_optimizer"]["tokens_per_step_after"] == pytest.approx(after, rel=0.05)
    assert found["eight_bit_optimizer"]["tokens_per_step_after"] > doc["max_tokens_per_step"]
    # checkpointing scales the per-token transient: its saving is the fitted slope's part at the largest batch
    t = m["transient"]
    tokens = m["tokens_seen_max"]
    per_token = t["bytes_per_token"] * tokens + t["bytes_per_token2"] * tokens ** 2
    assert found["activation_checkpointing"]["saves_bytes"] == int((1 - CHECKPOINT_KEEPS) * per_token)
    acc = found["gradient_accumulation"]
    assert 0 < acc["tokens_per_step_after"] < tokens and "micro" in acc["text"]


def test_peaks_following_the_longest_sequence_are_a_finding_and_a_remedy(doc: dict) -> None:
    peaks = [InputPeak.from_dict(f["input_peak"]) for f in doc["memory"] if f["input_peak"]]
    assert {p.rank for p in peaks} == {0, 1}
    p = peaks[0]
    assert p.correlation > 0.95 and p.seq_len_min < p.seq_len_cap < p.seq_len_max
    assert p.explains(p.seq_len_max) and not p.explains(p.seq_len_cap) and not p.explains(None)
    last = next(f for f in doc["memory"] if f["rank"] == p.rank)["seq_len_last"]
    assert p.seq_len_min <= last <= p.seq_len_max
    shorter = by_name(doc)["shorter_sequences"]
    assert shorter["saves_bytes"] == p.cap_saves_bytes if p.rank == doc["binding_rank"] else True
    assert f"{p.seq_len_cap:,}" in shorter["text"]


def test_no_seq_len_or_constant_lengths_give_no_finding() -> None:
    samples = watched_varlen("noseq", floor=FLOOR, seq=False, steps=600)
    doc = advise(observe(samples)["noseq"]).as_dict()
    assert all(f["input_peak"] is None for f in doc["memory"]) and "shorter_sequences" not in by_name(doc)


def test_a_front_joining_the_document_answers_the_same(doc: dict) -> None:
    assert join([doc]).as_dict()["remedies"] == doc["remedies"]
    assert Remedy.from_dict(doc["remedies"][0]).as_dict() == doc["remedies"][0]


@pytest.mark.parametrize(("version", "conf", "offered"), [
    ("2.4.0", "-", True),
    ("2.4.0", "max_split_size_mb:128", False),  # before 2.5 the combination can assert near OOM
    ("2.6.0+cu124", "max_split_size_mb:128", True),
    ("2.0.1", "-", False),  # no expandable segments before 2.1
    ("2.4.0", "expandable_segments:True", False),  # already on
])
def test_expandable_segments_only_for_fragmentation_and_a_torch_that_allows_it(version: str, conf: str,
                                                                              offered: bool) -> None:
    run = f"frag-{version}-{conf}"
    doc = advise(observe(fragmented(run, torch_version=version, alloc_conf=conf))[run]).as_dict()
    found = by_name(doc)
    assert doc["memory"][0]["fragmented"] is True
    assert ("expandable_segments" in found) is offered
    if offered:
        r = found["expandable_segments"]
        assert r["saves_bytes"] == doc["memory"][0]["inactive_split_bytes"]
        assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in r["text"] and version in r["basis"]


def test_another_process_on_the_binding_rank_s_gpu_is_a_remedy() -> None:
    samples = watched_varlen("foreign", floor=FLOOR, steps=600, ranks=1)
    for s in samples:
        if s["phase"] == "train":
            s["foreign_used_bytes"] = 3 * 2**30
    doc = advise(observe(samples)["foreign"]).as_dict()
    r = by_name(doc)["close_foreign_process"]
    assert r["saves_bytes"] == 3 * 2**30 and "stale notebook kernel" in r["costs"]
    assert "sharding" not in by_name(doc)  # one rank: nothing to shard across
