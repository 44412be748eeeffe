"""The model of a run's life (vramwatch/runlife/): each ending judged as the issue names it,
the fold independent of arrival order and duplicates, deaths that stay judged, bounded memory."""

from __future__ import annotations

import random

import pytest
from endings import ENDINGS, KILL_STEP, RANKS, T0, job_killed, one_killed, oom_restart_finish
from helpers import make_sample

from vramwatch import runlife, verdicts
from vramwatch.runlife import RunLife, RunTally, fold, judge
from vramwatch.verdicts import Liveness, Outcome, RunStatus, silence_window

#: the silence window of these ranks: one sample a second
WINDOW = silence_window(1.0)


def story_of(samples, now):
    (life,) = fold(samples).values()
    return life.story(now)


def summary(story):
    """What every reader must agree on, per rank."""
    return {r.rank: (str(r.liveness), None if r.died is None else str(r.died.cause), r.ooms, r.restarts)
            for r in story.ranks}


@pytest.mark.parametrize("build", ENDINGS, ids=lambda b: b.__name__)
def test_each_ending_is_judged_as_it_happened(build) -> None:
    ending = build()
    story = story_of(ending.samples, now=ending.last_ts + 3600)
    assert story.status == ending.status
    assert {r.rank: str(r.liveness) for r in story.ranks} == ending.liveness
    assert {r.rank: None if r.died is None else str(r.died.cause) for r in story.ranks} == ending.died
    if ending.ooms:
        assert {r.rank: r.ooms for r in story.ranks} == ending.ooms
    if ending.restarts:
        assert {r.rank: r.restarts for r in story.ranks} == ending.restarts
    first = story.first_failure
    assert (None if first is None else (first.rank, str(first.cause))) == ending.first_failure
    assert story.tally.ranks == RANKS and story.tally.as_dict()["ranks"] == RANKS


def test_a_killed_rank_is_dead_at_its_last_sample_and_stays_so() -> None:
    ending = one_killed()
    # while the others still run, as soon as they went on for the silence window
    during = [s for s in ending.samples if s["ts"] <= T0 + KILL_STEP + WINDOW + 5]
    story = story_of(during, now=T0 + KILL_STEP + WINDOW + 5)
    dead = story.rank("node-1", 2)
    assert dead.liveness == Liveness.DEAD and dead.died == runlife.Death(Outcome.KILLED, KILL_STEP - 1, dead.died.ts)
    assert dead.died.ts == pytest.approx(T0 + KILL_STEP - 1 + 0.02)
    assert story.status == RunStatus.RUNNING and story.tally.dead == 1 and story.tally.live == 3
    # the same death an hour after the run ended, and a day after
    for now in (ending.last_ts + 3600, ending.last_ts + 86400):
        later = story_of(ending.samples, now=now).rank("node-1", 2)
        assert later.died == dead.died and later.liveness == Liveness.DEAD


def test_a_job_killed_at_once_is_running_then_crashed_never_finished() -> None:
    ending = job_killed()
    quiet_for = [10.0, WINDOW - 1, WINDOW + 1, 7200.0]
    statuses = [story_of(ending.samples, now=ending.last_ts + q).status for q in quiet_for]
    assert statuses == ["running", "running", "crashed", "crashed"]
    story = story_of(ending.samples, now=ending.last_ts + 7200)
    assert {r.died.cause for r in story.ranks} == {Outcome.STOPPED}
    assert all(r.died.step == 899 for r in story.ranks)


def test_torchrun_restart_after_an_oom_names_the_oom_not_its_victims() -> None:
    story = story_of(oom_restart_finish().samples, now=T0 + 7200)
    ranks = {r.rank: r for r in story.ranks}
    assert [str(i.outcome) for i in ranks[1].incarnations] == ["oom", "exited"]
    assert [str(i.outcome) for i in ranks[0].incarnations] == ["stopped", "exited"]
    assert ranks[1].incarnations[0].end == runlife.Moment(299, pytest.approx(T0 + 300.2))
    assert story.tally.deaths == RANKS and story.tally.dead == 0 and story.status == "recovered"
    assert (story.first_failure.rank, story.first_failure.cause) == (1, Outcome.OOM)


def test_an_oom_the_loop_survived_is_counted_but_not_a_death() -> None:
    samples = [make_sample(i, ts=T0 + i) for i in range(5)] + [make_sample(5, ts=T0 + 5, ooms=1)]
    story = story_of(samples, now=T0 + 6)
    assert story.ranks[0].died == runlife.Death(Outcome.OOM, 5, T0 + 5) and story.status == "crashed"
    samples += [make_sample(i, ts=T0 + i, ooms=1) for i in range(6, 9)]
    samples.append({**make_sample(8, ts=T0 + 9, ooms=1), "seq": 1, "exit": True})
    story = story_of(samples, now=T0 + 10)
    rank = story.ranks[0]
    assert rank.died is None and rank.ooms == 1 and rank.liveness == "exited" and rank.deaths == 0
    assert story.status == "recovered" and story.first_failure.cause == Outcome.OOM


def test_silent_is_a_quiet_rank_not_judged_yet() -> None:
    went_on = int(WINDOW) - 10
    samples = [make_sample(i, rank=r, ts=T0 + i) for r in range(2) for i in range(100)]
    samples += [make_sample(i, rank=0, ts=T0 + i) for i in range(100, 100 + went_on)]
    # rank 1 quiet for a second more than its window, rank 0 went on for less than it
    story = story_of(samples, now=T0 + 99 + WINDOW + 1)
    assert [str(r.liveness) for r in story.ranks] == ["live", "silent"] and story.status == "running"
    assert story.ranks[1].died is None
    # once rank 0 went on for the silence window after it, rank 1 was killed alone
    samples += [make_sample(i, rank=0, ts=T0 + i) for i in range(100 + went_on, 100 + int(WINDOW) + 5)]
    story = story_of(samples, now=T0 + 100 + WINDOW + 5)
    assert story.ranks[1].died.cause == Outcome.KILLED


def test_a_source_without_end_markers_ends_without_a_verdict_on_how() -> None:
    sparse = [{"schema": 2, "run": "imported", "host": "h", "rank": r, "step": i, "ts": T0 + i, "phase": "train",
               "nvml_used_bytes": 10 * 2**30, "total_bytes": 80 * 2**30} for r in range(2) for i in range(50)]
    story = story_of(sparse, now=T0 + 3600)
    assert [str(r.liveness) for r in story.ranks] == ["ended", "ended"] and story.status == "ended"
    assert all(r.died is None for r in story.ranks) and story.first_failure is None


def _shuffled_with_resends(samples, seed):
    """Arrival as a collector may see it: ranks interleaved differently, batches resent (duplicates),
    a spool replaying an old stretch late."""
    rng = random.Random(seed)
    out = list(samples)
    rng.shuffle(out)
    out += rng.sample(samples, len(samples) // 10)
    return out


def _store_order(samples):
    """The store's replay order: series by series (incarnation by incarnation), each by (step, phase, seq)."""
    return sorted(samples, key=lambda s: (s["rank"], s.get("incarnation", ""), s["step"], s["phase"], s.get("seq", 0)))


@pytest.mark.parametrize("build", ENDINGS, ids=lambda b: b.__name__)
def test_the_fold_is_the_same_in_any_order_with_duplicates(build) -> None:
    ending = build()
    now = ending.last_ts + 3600
    reference = story_of(ending.samples, now)
    for samples in (_store_order(ending.samples), *(_shuffled_with_resends(ending.samples, seed) for seed in range(3))):
        assert story_of(samples, now) == reference
    run = ending.samples[0]["run"]
    records = {(lf.host, lf.rank): lf.records() for lf in fold(ending.samples)[run].ranks()}
    again = {(lf.host, lf.rank): lf.records() for lf in fold(_store_order(ending.samples))[run].ranks()}
    assert records == again


def test_tallies_of_parts_add_up_to_the_whole_run() -> None:
    ending = one_killed()
    now = T0 + KILL_STEP + WINDOW + 100
    samples = [s for s in ending.samples if s["ts"] <= now]
    whole = story_of(samples, now)
    parts = [story_of([s for s in samples if s["rank"] in ranks], now) for ranks in ((0, 1), (2, 3))]
    merged = parts[0].tally + parts[1].tally
    # the shard holding the killed rank and rank 3 sees rank 3 go on: the same death, the same status
    assert merged == whole.tally and merged.status == whole.status == "running"
    assert RunTally.from_dict(merged.as_dict()) == merged


def test_statuses_and_liveness_are_the_published_vocabulary() -> None:
    meta = verdicts.meta()
    assert meta["run_statuses"] == ["running", "finished", "recovered", "crashed", "ended"]
    assert meta["liveness"] == ["live", "silent", "exited", "dead", "ended"]
    assert set(meta["run_status_meaning"]) == set(meta["run_statuses"]) == set(meta["run_status_severity"])
    assert set(meta["outcomes"]) == {str(o) for o in Outcome}
    assert meta["run_status_severity"]["crashed"] > meta["run_status_severity"]["finished"]


def test_a_rank_crash_looping_stays_bounded_and_keeps_counting() -> None:
    life = RunLife("loop")
    n = runlife.MAX_INCARNATIONS + 100
    for k in range(n):
        for i in range(3):
            life.feed(make_sample(i, run="loop", ts=T0 + 10 * k + i, incarnation=f"p{k}", ooms=1 if i == 2 else 0))
    rank = life.ranks()[0]
    assert len(rank.records()) == runlife.MAX_INCARNATIONS
    assert rank.restarts == n - 1 and rank.ooms == n
    story = life.story(now=T0 + 10 * n + 3600)
    assert story.ranks[0].deaths == n and story.ranks[0].incarnations[0].record.incarnation == "p0"


def test_last_oom_time_is_the_latest_oom_of_any_process_in_any_order() -> None:
    """The OOM alert's clock: the sample time of the rank's latest OOM whatever process raised it
    and whatever order samples came in; kept when its process's record is summed away; the
    running process's start beside it."""
    samples = [make_sample(i, run="o", ts=T0 + i, incarnation="a", ooms=int(i >= 5)) for i in range(10)]
    samples += [make_sample(i, run="o", ts=T0 + 100 + i, incarnation="b", ooms=int(i >= 3) + int(i >= 7))
                for i in range(10)]
    samples += [make_sample(i, run="o", ts=T0 + 200 + i, incarnation="c") for i in range(10)]
    for order in (samples, list(reversed(samples)), random.Random(7).sample(samples, len(samples))):
        rank = fold(order)["o"].ranks()[0]
        assert rank.last_oom_ts == T0 + 107  # process b's second OOM
        assert rank.process_start_ts == T0 + 200 and rank.ooms == 3
    assert fold(samples[20:])["o"].ranks()[0].last_oom_ts is None  # no OOM: nothing to be recent
    life = RunLife("loop")  # the OOM'd process is among the ones summed away past MAX_INCARNATIONS
    life.feed(make_sample(0, run="loop", ts=T0, incarnation="p0"))
    life.feed(make_sample(1, run="loop", ts=T0 + 5, incarnation="p1", ooms=1))
    for k in range(2, runlife.MAX_INCARNATIONS + 5):
        life.feed(make_sample(0, run="loop", ts=T0 + 10 * k, incarnation=f"p{k}"))
    rank = life.ranks()[0]
    assert "p1" not in {r.incarnation for r in rank.records()} and rank.last_oom_ts == T0 + 5


def test_a_suspected_oom_is_kept_in_any_order_once_bounded_and_never_counted_as_an_oom() -> None:
    """What the engine suspects from device memory: kept by time whatever order it is told in, a
    second report of the same moment changes nothing, the first and the latest survive the bound,
    and no OOM count, outcome or status moves."""
    found = [runlife.SuspectedOom(100 * k, T0 + 100 * k, 78 * 2**30, 2**29, 80 * 2**30, "near_full")
             for k in range(1, runlife.MAX_SUSPECTED + 11)]
    for order in (found, list(reversed(found)), random.Random(3).sample(found, len(found))):
        life = RunLife("dev")
        for i in range(10):
            life.feed(make_sample(i, run="dev", ts=T0 + i))
        rank = life.ranks()[0]
        for f in order:
            rank.suspect(f)
        for f in rank.suspected[:5]:  # told again (a replay): nothing changes
            rank.suspect(f)
        assert rank.suspected_ooms == len(found) and len(rank.suspected) == runlife.MAX_SUSPECTED
        assert rank.suspected[0] == found[0] and rank.suspected[-1] == found[-1]
        story = life.story(now=T0 + 20)
        r = story.ranks[0]
        assert (r.suspected_ooms, r.last_suspected_oom_ts, r.ooms, r.deaths) == (len(found), found[-1].ts, 0, 0)
        assert story.tally.ooms == 0 and story.first_failure is None
    assert found[0].headroom_bytes == 2 * 2**30
    assert found[0]._replace(total_bytes=None).headroom_bytes is None


def test_judge_is_pure_and_empty_runs_have_no_story() -> None:
    assert judge("none", [], now=T0).ranks == () and judge("none", [], now=T0).status == "finished"
    life = fold(oom_restart_finish().samples)["oom-restart"]
    assert life.story(T0 + 7200) == life.story(T0 + 7200)


def test_compare_and_gate_count_ooms_restarts_and_deaths_from_the_model() -> None:
    from endings import clean_exit

    from vramwatch.decisions.compare import RunFigures, compare, format_comparison
    from vramwatch.decisions.gate import gate
    from vramwatch.decisions.observe import observe

    baseline = observe(clean_exit("base").samples)["base"]
    candidate = observe(oom_restart_finish("cand").samples)["cand"]
    result = compare(baseline, candidate)
    life = {(m.name, m.rank): (m.a, m.b) for m in result.metrics if m.phase == "rank"}
    assert life[("ooms", 1)] == (0, 1) and life[("ooms", 0)] == (0, 0)
    assert all(life[("restarts", r)] == (0, 1) and life[("deaths", r)] == (0, 1) for r in range(RANKS))
    # the worst headroom is said to be the latest process's, beside the counts of every process
    assert {m.phase for m in result.metrics if m.name == "min_headroom_bytes"} == {"process"}
    assert "ooms" in format_comparison(result)
    verdict = gate(baseline, candidate)
    # the candidate's OOM is trouble the baseline does not have: named with its rank and cause
    assert not verdict.passed and verdict.line.startswith("FAIL: rank 1: OOM at step ")
    assert "(cause oom; the baseline has none)" in verdict.line
    assert "restarts (baseline 0)" in verdict.line
    # the same counts through a collector's figures document (what a front joins)
    again = RunFigures.from_dict(RunFigures.of(candidate).as_dict())
    assert [(r.rank, r.ooms, r.restarts, r.deaths) for r in again.ranks] == [(0, 0, 1, 1), (1, 1, 1, 1), (2, 0, 1, 1),
                                                                             (3, 0, 1, 1)]
    assert gate(baseline, baseline).passed


def test_the_stores_suspected_ooms_equal_the_folds_in_any_order_and_past_the_bound(tmp_path) -> None:
    """The OOMs suspected from device memory, kept in the store (SQLite on disk, one transaction
    per batch, reopened between batches) and told to a fold in the same order: the same records,
    the same first and latest past MAX_SUSPECTED, the same count dropped; a report told twice is a
    no-op in both; a run judged from the store's records (start-up's retired run) counts them all."""
    from vramwatch.collector.state.restore import stopped_story
    from vramwatch.collector.store import Store

    found = [runlife.SuspectedOom(100 * k, T0 + 100 * k, 78 * 2**30, 2**29, None if k % 7 else 80 * 2**30,
                                  "near_full" if k % 2 else "top_of_climb")
             for k in range(1, runlife.MAX_SUSPECTED + 41)]
    told = random.Random(5).sample(found, len(found))
    told += found[-10:]  # told again (a replay, a resend): kept moments, so nothing changes
    life = RunLife("dev")
    for i in range(10):
        life.feed(make_sample(i, run="dev", ts=T0 + i))
    rank = life.ranks()[0]
    path, new = tmp_path / "vw.db", 0
    for start in range(0, len(told), 30):
        store = Store(path)
        try:
            new += store.keep_suspected([("dev", "node-1", 0, f) for f in told[start:start + 30]])
            store.insert([make_sample(i, run="dev", ts=T0 + i) for i in range(10)])
        finally:
            store.close()
        for f in told[start:start + 30]:
            rank.suspect(f)
    store = Store(path, readonly=True)
    try:
        stored = store.suspected_records("dev")
        records, _ = store.life_records("dev")
        assert store.suspected_records("no-such-run") == {}
    finally:
        store.close()
    assert new == len(found) and stored == {("node-1", 0): (rank.suspected, rank.dropped_suspected)}
    assert len(rank.suspected) == runlife.MAX_SUSPECTED and rank.dropped_suspected == 40
    assert rank.suspected[0] == found[0] and rank.suspected[-1] == found[-1]
    story = stopped_story("dev", records, T0 + 3600, stored)
    (r,) = story.ranks
    assert (r.suspected_ooms, r.suspected, r.ooms) == (len(found), rank.suspected, 0)
    assert story.tally.suspected_ooms == len(found) and story.tally.ooms == 0
    assert stopped_story("dev", records, T0 + 3600).tally.suspected_ooms == 0  # what the store alone said before


def test_the_stores_suspected_ooms_from_the_engine_equal_the_folds(tmp_path) -> None:
    """Device-only samples (device used 78 GiB -> 0.4 GiB on an 80 GiB card) through the
    collector's live state: the engine suspects one OOM on rank 0; the store keeps what it raised,
    equal to the fold's record, and a retention that leaves the rank nothing forgets it."""
    from incident_runs import device_oom

    from vramwatch import wire
    from vramwatch.collector.state.live import LiveState
    from vramwatch.collector.store import Store

    trace = [wire.validate(s) for s in device_oom("dev-oom", end=T0)]
    live = LiveState()
    raised = live.ingest(trace, received_at=T0)
    reports = [(e["run"], e["host"], e["rank"], runlife.SuspectedOom.of(e, e["ts"])) for e in raised
               if e["type"] == "suspected_oom"]
    store = Store(tmp_path / "vw.db")
    try:
        store.insert(trace)
        assert store.keep_suspected(reports) == 1 and store.keep_suspected(reports) == 0
        folded = {(s.host, s.rank): (s.life.suspected, s.life.dropped_suspected) for s in live.for_run("dev-oom")
                  if s.life.suspected}
        assert store.suspected_records("dev-oom") == folded and list(folded) == [("node-a", 0)]
        ((found,), _) = folded[("node-a", 0)]
        assert found.used_before_bytes > 0.9 * 80 * 2**30 and found.used_after_bytes < 2**30
        store.retain(T0 - 7200.0)  # older than the run: nothing goes
        assert store.suspected_records("dev-oom") == folded
        store.retain(T0 + 1)  # every sample goes: the rank and its suspected OOM with it
        assert store.suspected_records("dev-oom") == {}
    finally:
        store.close()
