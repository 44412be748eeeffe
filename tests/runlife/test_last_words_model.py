"""Last words in the run-life model: the classification table against the documented messages of
PyTorch, CUDA and NCCL, the culprit and its victims, who killed a process that said nothing, and
a forged or malformed last word that cannot change another run's story."""

from __future__ import annotations

import time

import pytest
from endings import RANKS, T0, crash_then_restart, culprit_and_victims, one_killed
from helpers import make_sample

from vramwatch import runlife, wire
from vramwatch.causes import LastWords, classify, fatal_signal, killed_by
from vramwatch.evidence import postmortem
from vramwatch.verdicts import Outcome

DOCUMENTED = [
    # PyTorch's caching allocator (c10/cuda/CUDACachingAllocator.cpp), 2.5+ and older spellings
    ("torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
     "79.15 GiB of which 2.44 MiB is free.", "train", Outcome.OOM),
    ("torch.cuda.OutOfMemoryError", "CUDA out of memory. Tried to allocate 1.00 GiB", "train", Outcome.OOM),
    ("RuntimeError", "CUDA out of memory. Tried to allocate 1.00 GiB", "checkpoint", Outcome.OOM),
    ("RuntimeError", "CUDA error: out of memory", "train", Outcome.OOM),
    ("RuntimeError", "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "train",
     Outcome.OOM),
    # C10_CUDA_CHECK (c10/cuda/CUDAException.cpp): cudaGetErrorString texts
    ("RuntimeError", "CUDA error: an illegal memory access was encountered", "train", Outcome.CUDA_ERROR),
    ("torch.AcceleratorError", "CUDA error: device-side assert triggered", "eval", Outcome.CUDA_ERROR),
    ("RuntimeError", "CUDA error: uncorrectable ECC error encountered", "train", Outcome.CUDA_ERROR),
    ("RuntimeError", "CUDA error: unspecified launch failure", "checkpoint", Outcome.CUDA_ERROR),
    # ProcessGroupNCCL's watchdog, and the errors of a rank whose peer is gone
    ("torch.distributed.DistBackendError", "[Rank 3] Watchdog caught collective operation timeout: "
     "WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600043 ms", "train",
     Outcome.COLLECTIVE_TIMEOUT),
    ("RuntimeError", "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST)",
     "train", Outcome.COLLECTIVE_TIMEOUT),
    ("torch.distributed.DistNetworkError", "Connection reset by peer", "train", Outcome.COLLECTIVE_TIMEOUT),
    # faulthandler's first line, the hook's signal names
    ("SIGSEGV", "Fatal Python error: Segmentation fault", "train", Outcome.CRASH),
    ("SIGBUS", "Fatal Python error: Bus error", "checkpoint", Outcome.CRASH),
    ("SIGTERM", "", "train", Outcome.KILLED),
    ("KeyboardInterrupt", "", "eval", Outcome.KILLED),
    # a checkpoint phase: anything not GPU-shaped is a failed checkpoint
    ("OSError", "[Errno 28] No space left on device: '/ckpt/step_5000.pt'", "checkpoint", Outcome.CHECKPOINT_FAILED),
    ("PermissionError", "[Errno 13] Permission denied: '/ckpt'", "ckpt_save", Outcome.CHECKPOINT_FAILED),
    ("OSError", "[Errno 28] No space left on device", "train", Outcome.EXCEPTION),
    ("ValueError", "loss is NaN", "train", Outcome.EXCEPTION),
]


@pytest.mark.parametrize(("kind", "message", "phase", "cause"), DOCUMENTED)
def test_documented_messages_map_to_their_cause(kind: str, message: str, phase: str, cause: Outcome) -> None:
    assert classify(LastWords(kind, message, phase)) == cause


def test_faulthandlers_first_line_names_the_signal_and_the_hosts_memory_names_the_killer() -> None:
    assert fatal_signal("Fatal Python error: Segmentation fault") == "SIGSEGV"
    assert fatal_signal("Fatal Python error: Floating point exception") == "SIGFPE"
    assert fatal_signal("Current thread 0x00007f (most recent call first):") is None
    assert killed_by(200 * 2**20, 60 * 2**30) == "host_oom"  # 200 MiB left beside a 60 GiB rank
    assert killed_by(40 * 2**30, 60 * 2**30) == "launcher"
    assert killed_by(None, 60 * 2**30) is None


def test_the_culprit_lists_its_victims_and_no_victim_is_a_first_failure() -> None:
    ending = culprit_and_victims()
    story = runlife.fold(ending.samples)["culprit"].story(ending.last_ts + 3600)
    first = story.first_failure
    assert (first.rank, first.cause) == (1, Outcome.OOM)
    assert (first.last_words.type, first.last_words.phase) == ("torch.OutOfMemoryError", "train")
    assert first.last_words.message.startswith("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert first.victims == tuple(("node-1", r) for r in range(RANKS) if r != 1)
    for r in story.ranks:
        if r.rank == 1:
            assert r.died.cause == Outcome.OOM and r.died.culprit is None
            assert r.died.last_words.type == "torch.OutOfMemoryError"
        else:
            assert r.died.cause == Outcome.COLLECTIVE_TIMEOUT and r.died.culprit == ("node-1", 1)
            assert r.died.as_dict()["culprit"] == {"host": "node-1", "rank": 1}
            assert r.died.ts == pytest.approx(T0 + 900 + r.rank)  # when the watchdog spoke, after the OOM
    doc = postmortem.build("culprit", lambda: iter(ending.samples), now=ending.last_ts + 3600).to_dict()
    assert doc["first_failure"]["victims"] == [{"host": "node-1", "rank": r} for r in (0, 2, 3)]
    assert doc["first_failure"]["last_words"]["type"] == "torch.OutOfMemoryError"
    assert "3 rank(s) then timed out waiting for it in a collective: 0, 2, 3" in doc["first_failure"]["detail"]
    text = postmortem.render_text(postmortem.from_dict(doc))
    assert "last words (train): torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in text
    assert text.count("(waiting for rank 1)") == 3


def test_a_timeout_with_no_failure_before_it_is_the_first_failure_and_has_no_culprit() -> None:
    ending = culprit_and_victims("hang")
    # rank 1 hung too (no OOM): every rank's last word is the watchdog's timeout
    samples = [s for s in ending.samples if not (s["rank"] == 1 and (s.get("oom_marked") or s.get("last_words_type")))]
    last1 = max((s for s in samples if s["rank"] == 1), key=lambda s: s["ts"])
    samples.append({**last1, "ts": T0 + 901.5, "seq": 1, "last_words_type": "torch.distributed.DistBackendError",
                    "last_words_message": "[Rank 1] Watchdog caught collective operation timeout",
                    "last_words_phase": "train"})
    story = runlife.fold(samples)["hang"].story(ending.last_ts + 3600)
    assert (story.first_failure.rank, story.first_failure.cause) == (0, Outcome.COLLECTIVE_TIMEOUT)
    assert story.first_failure.victims == ()
    assert all(r.died.cause == Outcome.COLLECTIVE_TIMEOUT and r.died.culprit is None for r in story.ranks)


def test_a_crash_record_sent_by_the_next_process_belongs_to_the_dead_one() -> None:
    ending = crash_then_restart()
    story = runlife.fold(ending.samples)["segfault"].story(ending.last_ts + 3600)
    rank2 = story.rank("node-1", 2)
    assert [str(i.outcome) for i in rank2.incarnations] == ["crash", "exited"]
    assert rank2.incarnations[0].record.last_words.type == "SIGSEGV"
    assert rank2.deaths == 1 and rank2.died is None


def test_a_rank_killed_without_a_word_says_whether_the_host_was_out_of_memory() -> None:
    ending = one_killed("host-oom")
    samples = [dict(s) for s in ending.samples]
    last2 = max((s for s in samples if s["rank"] == 2), key=lambda s: s["ts"])
    last2.update(host_available_bytes=100 * 2**20, host_rss_bytes=120 * 2**30)
    story = runlife.fold(samples)["host-oom"].story(ending.last_ts + 3600)
    died = story.rank("node-1", 2).died
    assert died.cause == Outcome.KILLED and died.killed_by == "host_oom"


def test_last_words_are_validated_like_every_sample_field() -> None:
    base = make_sample(1, run="forged", ts=time.time())
    for field, value in (("last_words_type", "Bad\u202eType"), ("last_words_message", "x" * 129),
                         ("last_words_message", "line\nbreak"), ("last_words_phase", ""),
                         ("last_words_type", 7)):
        with pytest.raises(wire.WireError) as err:
            wire.validate({**base, field: value})
        assert err.value.field == field
    ok = wire.validate({**base, "last_words_type": "ValueError", "last_words_message": "fine",
                        "last_words_phase": "train"})
    assert ok["last_words_type"] == "ValueError"


def test_a_last_word_of_one_run_changes_no_other_runs_story() -> None:
    ending = culprit_and_victims("victim-run")
    other = one_killed("other-run")
    forged = {**ending.samples[-1], "run": "other-run", "incarnation": "forged", "ts": T0 + 10,
              "last_words_type": "SIGSEGV", "last_words_message": "Fatal Python error: Segmentation fault"}
    lives = runlife.fold([*ending.samples, *other.samples, forged])
    # the forged word lands in the run it names, as a process of its own: the victim run is untouched
    assert runlife.fold(ending.samples)["victim-run"].story(ending.last_ts + 3600).first_failure == \
        lives["victim-run"].story(ending.last_ts + 3600).first_failure
