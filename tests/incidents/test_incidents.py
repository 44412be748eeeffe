"""Incidents on generated runs (tests/incident_runs.py): the six stories of a failure each get the
right incident, cause and next step; a run that finished while leaking has no incident but an
open leak; and no sentence says what the data does not show (a property over the runs)."""

from __future__ import annotations

import re
from functools import cache

import pytest
from incident_runs import SCENARIOS, MiB, Truth

from vramwatch.evidence import postmortem
from vramwatch.units import duration, rate


@cache
def _built(name: str, seed: int = 0) -> tuple[Truth, postmortem.PostMortem]:
    fn = SCENARIOS[name]
    truth = fn(seed=seed) if seed else fn()
    run = truth.samples[0]["run"]
    pm = postmortem.build(run, lambda: iter(truth.samples), now=truth.last_ts + 1000)
    return truth, pm


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_story_gets_its_incident_cause_and_next_step(name: str) -> None:
    truth, pm = _built(name)
    incidents = pm.incidents
    assert [i["kind"] for i in incidents] == truth.kinds
    assert [i["cause"] for i in incidents] == truth.causes
    assert [i["rank"] for i in incidents] == truth.lead_rank
    assert [len(i["ranks_affected"]) for i in incidents] == truth.ranks_affected
    assert [i["restarted"] for i in incidents] == truth.restarted
    assert [i["phase"] for i in incidents] == truth.phase
    assert [f["kind"] for f in pm.open_findings] == truth.open_kinds
    actions = [n["action"] for n in pm.next]
    assert [a for a in actions if a in truth.next_actions] == truth.next_actions, actions
    assert [i["ts"] for i in incidents] == sorted(i["ts"] for i in incidents)
    assert pm.to_dict()["incidents"] == incidents


def test_a_leak_that_oomed_in_a_checkpoint_is_one_incident_with_its_numbers_and_restart() -> None:
    truth, pm = _built("leak_checkpoint_restart")
    (inc,) = pm.incidents
    assert inc["step"] == 1600 and inc["phase"] == "checkpoint"
    assert abs(inc["since_step"] - truth.extra["leak_since"]) <= 64  # the engine's onset: within two blocks
    assert sorted(inc["ranks_affected"]) == list(range(8))
    assert inc["restart_step"] == truth.extra["restart_step"]
    slope = inc["finding"]["slope_bytes_per_step"]
    assert slope == pytest.approx(truth.extra["slope"], rel=0.05)
    assert rate(slope) in inc["text"] and "took the job down (8 ranks)" in inc["text"]
    # the restarted process still leaks: open, found within a few hundred steps of the restart
    (still,) = pm.open_findings
    assert still["rank"] == 5 and still["since_step"] == truth.extra["restart_step"]
    capture = next(n for n in pm.next if n["action"] == "capture_snapshots")
    assert capture["rank"] == 5 and capture["command"] == "vramwatch capture leak-ckpt --rank 5"
    # one OOM that took the job down is one incident, whatever the per-rank counts
    assert pm.tally["deaths"] == 8 and len(pm.incidents) == 1


def test_the_diff_command_names_the_leaking_ranks_snapshots_once_there_are_two() -> None:
    _, pm = _built("leak_checkpoint_restart")
    pm.snapshots = [{"id": "s-old", "rank": 5, "step": 1300}, {"id": "s-3", "rank": 3, "step": 1400},
                    {"id": "s-new", "rank": 5, "step": 1700}]
    pm.refresh_next()
    diff = next(n for n in pm.next if n["action"] == "diff_snapshots")
    assert diff["command"] == "vramwatch snapshots diff s-old s-new --top 20"
    assert [n["action"] for n in pm.next][:2] == ["diff_snapshots", "fix_leak"]
    pm.snapshots = []
    pm.refresh_next()


def test_a_job_wide_stop_with_room_says_memory_was_not_the_cause_with_the_numbers() -> None:
    _, pm = _built("job_stop_with_room")
    (inc,) = pm.incidents
    f = inc["finding"]
    assert f["min_headroom_bytes"] > 50 * 2**30 and f["host_available_bytes"] == 300 * 2**30
    assert "81,920 MiB" in inc["text"] and "300.0 GiB of host memory" in inc["text"]


@pytest.mark.parametrize("name", ["lone_death", "lone_death_then_clean_close"])
def test_a_lone_death_is_not_called_a_job_wide_stop(name: str) -> None:
    """Killed alone, whether its peers went on past the silence window or closed cleanly inside it."""
    truth, pm = _built(name)
    (inc,) = pm.incidents
    assert inc["ranks_affected"] == truth.lead_rank and "job-wide" not in inc["text"] and "alone" in inc["text"]
    assert "job-wide" not in postmortem.render_text(pm)
    assert pm.first_failure is not None and "alone" in pm.first_failure.detail


def test_raise_and_input_peak_give_settable_numbers() -> None:
    _, pm = _built("raise_ooms")
    resume = next(n for n in pm.next if n["action"] == "resume")
    assert resume["tokens_per_step"] == 16384
    _, pm = _built("input_peak")
    cap = next(n for n in pm.next if n["action"] == "cap_input")
    f = pm.incidents[0]["finding"]
    assert cap["tokens_per_step"] == f["largest_held_tokens"] <= 10000 and f["tokens"] == 20000


def test_fragmentation_without_retries_never_says_retries_climb() -> None:
    _, pm = _built("fragmentation_no_retries")
    f = pm.incidents[0]["finding"]
    assert f["retries_before"] == f["retries_after"] == 0
    assert "retries climbing" not in postmortem.render_text(pm)
    assert "has not had to retry" in f["text"]
    assert next(n for n in pm.next if n["action"] == "set_allocator")["command"] == (
        "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def test_a_run_that_finished_while_leaking_says_so() -> None:
    _, pm = _built("clean_but_leaking")
    assert pm.status == "finished" and pm.incidents == []
    text = postmortem.render_text(pm)
    assert "still open: rank 1 leaks" in text and "steps (" in text  # runway in steps with hours beside
    leak = next(f for f in pm.open_findings if f["kind"] == "leak")
    # the forecast's range beside it, the engine's own numbers
    assert leak["seconds_to_oom_low"] <= leak["seconds_to_oom"] <= leak["seconds_to_oom_high"]
    assert (f"(80 % range {duration(leak['seconds_to_oom_low'])} to {duration(leak['seconds_to_oom_high'])})"
            in leak["text"])


def _numbers(text: str) -> list[str]:
    return re.findall(r"\d[\d,]*(?:\.\d+)?", text)


@pytest.mark.parametrize("seed", [11, 12])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_no_sentence_says_what_the_data_does_not_show(name: str, seed: int) -> None:
    """Over every run: "retries climbing" only where the retry counter rose, "of which" only for a
    part within its whole, "no OOM" never after one, every leak sentence states its finding's slope
    and onset, and every incident's numbers are the finding's."""
    truth, pm = _built(name, seed)
    oomed = any(s.get("ooms") or s.get("oom_marked") for s in truth.samples)
    texts = [i["text"] for i in pm.incidents] + [f["text"] for f in pm.open_findings] + [n["text"] for n in pm.next]
    texts.append(postmortem.render_text(pm))
    for text in texts:
        if oomed:
            assert "no OOM" not in text
        if "retries climbing" in text:
            assert any((s.get("alloc_retries") or 0) > 0 for s in truth.samples)
    findings = [i["finding"] for i in pm.incidents if i["finding"]] + list(pm.open_findings)
    for f in findings:
        if f["kind"] == "leak":
            assert rate(f["slope_bytes_per_step"]) in f["text"] and f"{f['since_step']:,}" in f["text"]
            assert f["slope_bytes_per_step"] > 1 * MiB
            low, high = f["seconds_to_oom_low"], f["seconds_to_oom_high"]
            ranged = low is not None and f["seconds_to_oom"] is not None and bool(f["steps_to_oom"])
            assert ("80 % range" in f["text"]) == ranged
            if ranged:
                assert f"range {duration(low)} to {duration(high)})" in f["text"]
                assert low <= f["seconds_to_oom"] <= high
        if f["kind"] == "fragmentation" and "of " in f["text"] and f["unused_bytes"] is not None:
            assert f["split_bytes"] <= f["unused_bytes"] or "reserved but unused" not in f["text"]
        if f["kind"] == "not_memory":
            assert f["min_headroom_bytes"] >= 0.05 * f["total_bytes"]
    for inc in pm.incidents:
        assert f"{inc['step']:,}" in inc["text"]
        if inc["finding"]:
            assert inc["finding"]["text"] in inc["text"] and inc["cause"] == inc["finding"]["kind"]


def test_a_crash_loop_is_one_incident_per_death_of_the_job() -> None:
    """Two OOMs 120 s apart, the second in the process restarted after the first: two incidents,
    each with the ranks its own job stop took down (the silence window does not merge them)."""
    from incident_runs import T0, GiB, _oom, _ordered, sample

    out = []
    for r in range(2):
        for inc, (s0, s1, t0) in enumerate(((0, 400, T0), (301, 400, T0 + 460))):
            for step in range(s0, s1 + 1):
                s = sample("loop", r, step, t0 + (step - s0) + r * 0.01, f"p{inc}-{r}", 30 * GiB)
                out.append(_oom(s) if (r == 0 and step == s1) else s)
    samples = _ordered(out)
    pm = postmortem.build("loop", lambda: iter(samples), now=max(s["ts"] for s in samples) + 1000)
    assert [(i["kind"], i["rank"], sorted(i["ranks_affected"]), i["restarted"]) for i in pm.incidents] == [
        ("oom", 0, [0, 1], True), ("oom", 0, [0, 1], False)]


def test_a_front_names_a_shared_failure_by_an_oom_before_a_suspected_one_before_a_stop() -> None:
    """The same moment seen by three shards: a hook's OOM names it over a device-only suspicion,
    and a suspicion over a plain stop."""
    from vramwatch.front.merge import merge_incidents

    stop = {"kind": "job_stop", "rank": 0, "ts": 100.0, "ranks_affected": [0], "restarted": False}
    suspected = {"kind": "suspected_oom", "rank": 3, "ts": 101.0, "ranks_affected": [3], "restarted": False}
    oom = {"kind": "oom", "rank": 6, "ts": 102.0, "ranks_affected": [6], "restarted": False}
    doc = merge_incidents([{"incidents": [stop]}, {"incidents": [suspected]}])
    assert [(i["kind"], i["rank"], i["ranks_affected"]) for i in doc["incidents"]] == [("suspected_oom", 3, [0, 3])]
    doc = merge_incidents([{"incidents": [stop]}, {"incidents": [suspected]}, {"incidents": [oom]}])
    assert [(i["kind"], i["rank"], i["ranks_affected"]) for i in doc["incidents"]] == [("oom", 6, [0, 3, 6])]


def test_a_front_joins_shards_incidents_into_one_story() -> None:
    """Two shards saw one job-wide OOM (each its own ranks) and one of them a later lone death:
    two incidents, the OOM named by the shard holding it, with every shard's ranks."""
    from vramwatch.front.merge import merge_incidents

    a = {"incidents": [{"kind": "job_stop", "rank": 0, "ts": 100.0, "ranks_affected": [0, 1], "restarted": True},
                       {"kind": "death", "rank": 1, "ts": 2000.0, "ranks_affected": [1], "restarted": False}],
         "open_findings": [], "next": [{"action": "hold", "rank": None}]}
    b = {"incidents": [{"kind": "oom", "rank": 5, "ts": 101.0, "ranks_affected": [5, 4], "restarted": True}],
         "open_findings": [{"kind": "leak", "rank": 5}], "next": [{"action": "fix_leak", "rank": 5},
                                                                   {"action": "hold", "rank": None}]}
    doc = merge_incidents([a, b])
    assert [(i["kind"], i["rank"], i["ranks_affected"], i["restarted"]) for i in doc["incidents"]] == [
        ("oom", 5, [0, 1, 5, 4], True), ("death", 1, [1], False)]
    assert [f["kind"] for f in doc["open_findings"]] == ["leak"]
    assert [n["action"] for n in doc["next"]] == ["fix_leak"]
