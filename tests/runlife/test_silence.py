"""The silence window follows each rank's own cadence: a fast job reads stopped within seconds
of a kill, a slow one is not called silent between two of its steps, and a rank's marked phases
(checkpoint saves) widen its window for the next one."""

from __future__ import annotations

import pytest
from helpers import make_sample

from vramwatch.runlife import fold
from vramwatch.verdicts import SILENT_AFTER_S, SILENT_CEILING_S, SILENT_FLOOR_S, silence_window

T0 = 1_770_000_000.0


def story_of(samples, now):
    (life,) = fold(samples).values()
    return life.story(now)


def job(step_s: float, steps: int, ranks: int = 4, **kw) -> list[dict]:
    return [make_sample(i, rank=r, ts=T0 + i * step_s + r * 0.01, step_time_s=step_s if i else None, **kw)
            for i in range(steps) for r in range(ranks)]


@pytest.mark.parametrize(("step_s", "window"), [(0.25, SILENT_FLOOR_S), (1.0, SILENT_FLOOR_S), (6.0, 60.0),
                                                 (60.0, 600.0), (600.0, SILENT_CEILING_S)])
def test_the_window_is_ten_sample_intervals_within_the_floor_and_the_ceiling(step_s, window) -> None:
    story = story_of(job(step_s, 50), now=T0 + 49 * step_s + 1)
    assert {r.window_s for r in story.ranks} == {window}
    assert [r.cadence_s for r in story.ranks] == pytest.approx([step_s] * 4)


def test_a_job_killed_at_one_step_a_second_reads_stopped_within_half_a_minute() -> None:
    samples = job(1.0, 600)
    last = max(s["ts"] for s in samples)
    assert story_of(samples, now=last + SILENT_FLOOR_S - 2).status == "running"
    stopped = story_of(samples, now=last + SILENT_FLOOR_S + 1)
    assert stopped.status == "crashed" and {str(r.died.cause) for r in stopped.ranks} == {"stopped"}


def test_a_slow_run_is_not_silent_between_two_steps() -> None:
    samples = job(60.0, 30)
    last = max(s["ts"] for s in samples)
    for quiet in (90.0, 300.0, 590.0):
        story = story_of(samples, now=last + quiet)
        assert story.status == "running" and {str(r.liveness) for r in story.ranks} == {"live"}
    assert story_of(samples, now=last + 601).status == "crashed"


def test_a_rank_killed_alone_in_a_fast_job_is_dead_half_a_minute_later() -> None:
    samples = [s for s in job(1.0, 400) if not (s["rank"] == 2 and s["step"] > 200)]
    now = T0 + 200 + SILENT_FLOOR_S + 2
    story = story_of([s for s in samples if s["ts"] <= now], now=now)
    assert str(story.rank("node-1", 2).died.cause) == "killed" and story.status == "running"


def test_samples_every_ten_steps_are_expected_every_ten_step_times() -> None:
    samples = [make_sample(i, ts=T0 + i, step_time_s=10.0 if i else None) for i in range(0, 500, 10)]
    (rank,) = story_of(samples, now=T0 + 491).ranks
    assert rank.cadence_s == pytest.approx(10.0) and rank.window_s == 100.0


def test_a_marked_checkpoint_widens_the_window_and_a_restart_keeps_it() -> None:
    samples = job(1.0, 300, ranks=1)
    samples.append(make_sample(150, ts=T0 + 150.5, phase="checkpoint", step_time_s=120.0))
    (rank,) = story_of(samples, now=T0 + 300).ranks
    assert rank.window_s == 1.5 * 120.0
    later = [make_sample(i, ts=T0 + 400 + i, step_time_s=1.0, incarnation="second") for i in range(1, 50)]
    (rank,) = story_of(samples + later, now=T0 + 450).ranks
    assert rank.window_s == 1.5 * 120.0 and rank.restarts == 1


def test_a_source_without_a_cadence_keeps_the_default_window() -> None:
    (rank,) = story_of([make_sample(0, ts=T0)], now=T0 + 1).ranks
    assert rank.window_s == SILENT_AFTER_S == silence_window(None)


def test_an_asked_for_window_applies_to_every_rank() -> None:
    samples = job(1.0, 100)
    last = max(s["ts"] for s in samples)
    (life,) = fold(samples).values()
    from vramwatch.runlife import judge

    story = judge(life.run, life.ranks(), last + 100, silent_after_s=300.0)
    assert story.status == "running" and {r.window_s for r in story.ranks} == {300.0}


def test_a_first_checkpoint_longer_than_the_window_is_not_a_stop_once_its_opening_is_marked() -> None:
    """A fast job (30 s window) saves its first checkpoint for 5 min: the hook's phase-open
    marker keeps the rank live (window: the ceiling) until the phase sample closes it; then the
    window is 1.5x the measured phase. Without the marker the same silence reads as a stop."""
    samples = job(1.0, 200, ranks=2)
    opened = [dict(make_sample(199, rank=r, ts=T0 + 199.5 + r * 0.01, seq=1), phase_open=True) for r in range(2)]
    story = story_of(samples + opened, now=T0 + 199.5 + 300)
    assert story.status == "running" and {str(r.liveness) for r in story.ranks} == {"live"}
    assert {r.window_s for r in story.ranks} == {SILENT_CEILING_S}
    assert story_of(samples, now=T0 + 199.5 + 300).status == "crashed"
    # a phase still open at the ceiling is silent: a hung save is found, not hidden
    assert story_of(samples + opened, now=T0 + 200 + SILENT_CEILING_S + 1).status == "crashed"
    closed = [make_sample(199, rank=r, ts=T0 + 500 + r * 0.01, phase="checkpoint", step_time_s=300.0)
              for r in range(2)]
    story = story_of(samples + opened + closed, now=T0 + 510)
    assert story.status == "running" and {r.window_s for r in story.ranks} == {1.5 * 300.0}


def test_the_stores_records_know_a_rank_is_in_a_phase_as_the_fold_does(tmp_path) -> None:
    """A run judged from the store's per-process records (a retired run, start-up) keeps the
    phase-open window: its records equal the fold's."""
    from vramwatch.collector.store import Store

    samples = job(1.0, 100, ranks=2)
    samples += [dict(make_sample(99, rank=r, ts=T0 + 99.5 + r * 0.01, seq=1), phase_open=True) for r in range(2)]
    store = Store(tmp_path / "vw.db")
    try:
        store.insert(samples)
        stored, _ = store.life_records(samples[0]["run"])
    finally:
        store.close()
    (life,) = fold(samples).values()
    folded = {(rank_life.host, rank_life.rank): rank_life.records() for rank_life in life.ranks()}
    assert {(host, rank): (rec,) for host, rank, rec in stored} == folded
    assert all(rec.in_phase for _, _, rec in stored)
