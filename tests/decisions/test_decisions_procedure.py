"""The batch procedure on replays whose truth is known (vramwatch.simulation.stories): finish stably at
180,224, try 196,608, keep it only after a plateau and a checkpoint, else straight back; after a
second OOM at a batch cut 5-10 %. Every number the advice gives is settable and judged against the
simulator's truth, never against what the model saw."""

from __future__ import annotations

import pytest

from vramwatch.decisions.advice import Advice, advise
from vramwatch.decisions.observe import observe
from vramwatch.decisions.readiness import ReadinessConfig
from vramwatch.simulation.stories import story_trace, story_truth

MARGIN = 0.05


def story(name: str, **kwargs) -> Advice:
    references = [observe(story_trace(r, run=r))[r] for r in kwargs.pop("references", ())]
    return advise(observe(story_trace(name))[name], references=references, **kwargs)


def fits_in_truth(name: str, tokens: int) -> bool:
    truth = story_truth(name)
    return truth.worst_need(tokens) <= (1 - MARGIN) * truth.total_bytes


def settable_truth(name: str, granularity: int) -> int:
    return story_truth(name).max_tokens(MARGIN) // granularity * granularity


def test_a_proven_batch_is_raised_to_the_next_settable_one() -> None:
    a = story("proven")
    step = a.next
    assert a.readiness.verdict == "ready" and step.action == "raise" and step.because.cause == "proven"
    # 22,528 = 11 x 2,048: a step of 2,048 (9.1 %) would skip the seed's 172,032 and leave the 5-10 % window
    # empty; 1,024 (8,192 global) divides every batch seen and keeps both reachable
    assert a.evidence.granularity == 1024 and a.evidence.grid.source == "inferred"
    assert a.evidence.settable(0.95 * 22528) * 8 == 163840 and 21504 % a.evidence.granularity == 0
    assert (step.tokens_per_step, step.global_tokens_per_step) == (24576, 196608)  # the seed's next batch
    assert (step.proven.run, step.proven.tokens_per_step, step.proven.global_tokens_per_step) == \
        ("proven", 22528, 180224)
    assert fits_in_truth("proven", 24576)  # the raise keeps the margin in truth
    assert step.sentence.startswith("Raise to 196,608 global tokens per step (24,576 per rank, +9.1%)")


def test_a_raise_that_holds_is_kept_and_the_one_after_it_does_not_fit() -> None:
    a = story("raise_holds")
    step = a.next
    assert a.readiness.verdict == "ready" and step.proven.tokens_per_step == 24576
    assert step.action == "hold" and step.tokens_per_step == 24576 and step.because.cause == "no_fit"
    assert "26,624" in step.because.text and not fits_in_truth("raise_holds", 26624)


def test_a_raise_that_runs_out_of_memory_at_its_checkpoint_goes_back_to_the_proven_batch() -> None:
    a = story("raise_ooms", target_tokens=24576)
    oom = a.evidence.ceiling()
    assert oom is not None and oom.record.phase == "checkpoint" and oom.record.tokens == 24576
    assert oom.record.cause == "batch_change" and oom.record.step == 4000  # its first checkpoint
    step = a.next
    assert step.action == "back_off" and step.because.cause == "batch_change"
    assert (step.tokens_per_step, step.global_tokens_per_step) == (22528, 180224)
    assert step.tokens_per_step < settable_truth("raise_ooms", 1024)  # straight back, never into the unknown
    # evidence beats the model: it thinks 24,576 fits (nothing below shows the checkpoint's buffer)
    assert a.model_max_tokens_per_step >= 24576
    assert a.max_tokens_per_step == 22528 and a.bound == "proven"
    assert a.target.fits is False and a.target.because.cause == "oom"


def test_the_reference_proves_the_checkpoint_safe_below_the_batch_that_failed() -> None:
    """The new run at 196,608 ran out of memory at its first checkpoint; the run at 180,224 given
    as a reference held through three: the checkpoint is not to blame "at any batch"."""
    alone = story("try_alone")
    # an upper bound, settable (not 24,575), not 0
    assert alone.max_tokens_per_step == 23552 and alone.bound == "oom"
    # nothing proven to go back to: at least the procedure's 5 % cut, on the grid: the seed's 180,224
    assert alone.next.action == "back_off" and alone.next.global_tokens_per_step == 180224
    a = story("try_alone", references=("proven",), target_tokens=24576)
    oom = a.evidence.ceiling()
    assert oom.record.cause == "batch_change" and "held its plateau" in oom.record.detail
    assert a.next.action == "back_off" and a.next.tokens_per_step == 22528
    assert a.next.proven.run == "proven" and a.max_tokens_per_step == 22528
    assert a.target.fits is False


def test_after_backing_off_it_holds_until_proven_and_never_raises_into_the_oom() -> None:
    a = story("backed_off")
    assert a.next.action == "hold" and a.next.tokens_per_step == 22528 and a.next.because.cause == "plateau"
    assert a.evidence.ceiling().record.tokens == 24576 and a.next.proven.tokens_per_step == 22528
    # proven again (a shorter plateau asked for): the next settable batch is the one that failed
    quick = story("backed_off", readiness_config=ReadinessConfig(plateau_steps=200, checkpoints=1))
    assert quick.next.action == "hold" and quick.next.because.cause == "oom_ceiling"
    # a finer granularity leaves room between the evidence: the model decides there, a try of at least the
    # procedure's 5 % strictly under the batch that failed, kept only if it proves itself
    fine = story("backed_off", readiness_config=ReadinessConfig(plateau_steps=200, checkpoints=1),
                 granularity=512)
    assert fine.next.action == "raise" and fine.next.tokens_per_step == 24064 < 24576
    assert fine.evidence.grid.source == "option" and "else straight back to 180,224 global" in fine.next.sentence


def test_a_second_oom_at_a_batch_cuts_5_to_10_percent() -> None:
    a = story("recurrence")
    assert len(a.evidence.ooms_at(22528)) == 2 and a.evidence.proven_below(None) is None
    step = a.next
    assert step.action == "back_off" and step.because.cause == "recurrence"
    cut = 1 - step.tokens_per_step / 22528
    assert 0.05 <= cut <= 0.10 and step.tokens_per_step % a.evidence.granularity == 0
    assert fits_in_truth("recurrence", step.tokens_per_step) and not fits_in_truth("recurrence", 22528)
    assert step.global_tokens_per_step == 8 * step.tokens_per_step


def test_a_jump_that_fails_at_once_goes_back_and_the_model_does_not_learn_from_the_warm_up() -> None:
    a = story("raise_far")
    assert a.next.action == "back_off" and a.next.tokens_per_step == 20480
    assert a.evidence.granularity == 1024  # 20,480 and 28,672: at most 5 % of 20,480
    truth = story_truth("raise_far").max_tokens(MARGIN)
    # the failed process died warming up: its floor is not the job's
    assert a.max_tokens_per_step == pytest.approx(truth, rel=0.03) and a.max_tokens_per_step < 28672


def test_an_oom_after_a_leak_is_the_leak_s_and_the_restart_holds() -> None:
    a = story("leak_restart")
    oom = a.evidence.ooms[0]
    assert oom.rank == 1 and oom.record.cause == "leak" and "MiB/step" in oom.record.detail
    assert a.evidence.ceiling() is None  # a leak runs out at any batch: it caps nothing
    assert a.next.action == "hold" and a.next.because.cause == "leak" and a.next.because.rank == 1
    assert a.next.tokens_per_step == 22528 and "0 tokens" not in a.next.sentence
    assert a.max_tokens_per_step == pytest.approx(story_truth("leak_restart").max_tokens(MARGIN), rel=0.03)


def test_every_story_gives_settable_numbers_and_its_cause_as_data() -> None:
    from vramwatch.decisions.reasons import CAUSES
    from vramwatch.simulation.stories import STORIES

    for name in STORIES:
        a = story(name)
        doc = a.as_dict()["next"]
        assert doc["action"] in ("raise", "hold", "back_off", "fix") and doc["because"]["cause"] in CAUSES
        assert doc["tokens_per_step"] % a.evidence.granularity == 0 or doc["action"] in ("hold", "fix"), name
        assert doc["global_tokens_per_step"] == 8 * doc["tokens_per_step"]
