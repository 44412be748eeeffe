"""A process's last words, from real Python processes with the hook on CPU (the simulated probe,
so the monitor is active without a GPU): an uncaught CUDA-error-shaped exception, a real
``torch.OutOfMemoryError``, a SIGSEGV followed by a restart of the rank, a full disk (a real
``OSError`` errno 28 from writing to ``/dev/full``) inside ``with vw.phase("checkpoint")``, and a
two-rank job on a real collector where one rank runs out of memory and the other then raises
the NCCL watchdog's timeout. Also: the program's own hooks still run (chained, never replaced),
and crash records that are not this rank's, or not readable, change nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_helpers import exposed_samples

from vramwatch import runlife
from vramwatch.delivery import spool_prefix
from vramwatch.evidence.last_words import MAX_FILE_BYTES, crash_records
from vramwatch.verdicts import Outcome

PRELUDE = """
import os, sys, threading, time
import vramwatch
mine = []
sys.excepthook = lambda t, e, tb: (mine.append(t), print("PROGRAM'S OWN EXCEPTHOOK", t.__name__, file=sys.stderr))
vw = vramwatch.init(URL, run=RUN, probe="simulated", out_dir=OUT, spool_dir=OUT, flush_interval_s=0.05)
for step in range(STEPS):
    vw.step(step)
"""


def run_script(body: str, *, run: str, out: Path, url: str | None = None, steps: int = 5,
               env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    head = f"URL, RUN, OUT, STEPS = {url!r}, {run!r}, {str(out)!r}, {steps}\n"
    script = head + textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "RANK": "0", **(env or {})})


def trace_samples(out: Path, run: str) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted((out / run).glob("*.jsonl"))
            for line in path.read_text().splitlines()]


def story_of(samples: list[dict[str, Any]], run: str) -> runlife.RunStory:
    return runlife.fold(samples)[run].story(time.time() + 3600)


def spoken(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in samples if s.get("last_words_type")]


def test_an_uncaught_cuda_error_is_the_last_word_and_the_programs_own_hook_still_runs(tmp_path: Path) -> None:
    result = run_script("""
        raise RuntimeError("CUDA error: an illegal memory access was encountered\\n"
                           "CUDA kernel errors might be asynchronously reported at some other API call")
    """, run="cuda", out=tmp_path)
    assert result.returncode == 1
    assert "PROGRAM'S OWN EXCEPTHOOK RuntimeError" in result.stderr  # chained, not replaced
    samples = trace_samples(tmp_path, "cuda")
    (word,) = spoken(samples)
    assert word["last_words_type"] == "RuntimeError"
    assert word["last_words_message"] == "CUDA error: an illegal memory access was encountered"  # the first line
    assert word["last_words_phase"] == "train" and word["step"] == 4 and word["seq"] == 1
    assert "oom_marked" not in word
    assert not any(s.get("exit") for s in samples)  # not a clean close
    died = story_of(samples, "cuda").rank(word["host"], 0).died
    assert died.cause == Outcome.CUDA_ERROR and died.last_words.message == word["last_words_message"]
    assert not list((tmp_path / "cuda").glob("*.crash")) and not list((tmp_path / "cuda").glob("*.state"))


def test_a_real_torch_out_of_memory_error_is_an_oom_bounded_and_redacted(tmp_path: Path) -> None:
    result = run_script("""
        import torch
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB --api-token=s3cr3t. GPU 0 has a "
                                     "total capacity of 79.15 GiB of which 1.06 GiB is free. " + "x" * 400)
    """, run="oom", out=tmp_path)
    assert result.returncode == 1
    (word,) = spoken(trace_samples(tmp_path, "oom"))
    assert word["last_words_type"] == "torch.OutOfMemoryError"
    message = word["last_words_message"]
    assert len(message) == 128 and message.endswith("…") and "s3cr3t" not in message and "--api-token=***" in message
    assert word["oom_marked"] is True  # the observer never fired: the words count the OOM
    story = story_of(trace_samples(tmp_path, "oom"), "oom")
    assert story.rank(word["host"], 0).died.cause == Outcome.OOM and story.rank(word["host"], 0).ooms == 1
    assert (story.first_failure.cause, story.first_failure.last_words.type) == (Outcome.OOM, "torch.OutOfMemoryError")


def test_a_segfault_leaves_a_crash_record_that_the_ranks_next_process_sends(tmp_path: Path) -> None:
    first = run_script("""
        import signal
        time.sleep(0.6)  # the state writer has the latest sample
        os.kill(os.getpid(), signal.SIGSEGV)
    """, run="segv", out=tmp_path)
    assert first.returncode == -signal.SIGSEGV
    left = sorted(p.suffix for p in (tmp_path / "segv").iterdir() if not p.name.endswith(".jsonl"))
    assert left == [".crash", ".state", ".term"]  # what the dead process left beside its traces
    dead = {s["incarnation"] for s in trace_samples(tmp_path, "segv")}
    second = run_script("vw.close()\n", run="segv", out=tmp_path, steps=3)
    assert second.returncode == 0, second.stderr
    samples = trace_samples(tmp_path, "segv")
    (word,) = spoken(samples)
    assert word["incarnation"] in dead  # attached to the process it belongs to, sent by the next one
    assert word["last_words_type"] == "SIGSEGV"
    assert word["last_words_message"] == "Fatal Python error: Segmentation fault"
    rank = story_of(samples, "segv").rank(word["host"], 0)
    assert [str(i.outcome) for i in rank.incarnations] == ["crash", "exited"]
    assert rank.restarts == 1 and rank.deaths == 1
    assert [p for p in (tmp_path / "segv").iterdir() if not p.name.endswith(".jsonl")] == []  # sent, removed


def test_a_full_disk_inside_a_checkpoint_phase_is_a_failed_checkpoint(tmp_path: Path) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    result = run_script("""
        with vw.phase("checkpoint"):
            with open("/dev/full", "wb", buffering=0) as fh:
                fh.write(b"model state" * 1000)  # the kernel answers ENOSPC: a real OSError errno 28
    """, run="ckpt", out=tmp_path)
    assert result.returncode == 1 and "PROGRAM'S OWN EXCEPTHOOK OSError" in result.stderr
    samples = trace_samples(tmp_path, "ckpt")
    (word,) = spoken(samples)
    assert word["last_words_type"] == "OSError"
    assert word["last_words_message"].startswith("[Errno 28] No space left on device")
    assert word["last_words_phase"] == "checkpoint"
    died = story_of(samples, "ckpt").rank(word["host"], 0).died
    assert died.cause == Outcome.CHECKPOINT_FAILED and died.last_words.phase == "checkpoint"


def test_an_exception_in_another_thread_is_chained_and_counted_not_sent(tmp_path: Path) -> None:
    result = run_script("""
        seen = []
        previous = threading.excepthook
        threading.excepthook = lambda args: (seen.append(args.exc_type), previous(args))
        t = threading.Thread(target=lambda: 1 / 0)
        t.start(); t.join()
        assert seen == [ZeroDivisionError], seen
        print("OTHER", vw.stats()["other_thread_exceptions"])
        vw.step(STEPS)
        vw.close()
    """, run="thread", out=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "OTHER 1" in result.stdout and "ZeroDivisionError" in result.stderr
    samples = trace_samples(tmp_path, "thread")
    assert spoken(samples) == [] and sum(bool(s.get("exit")) for s in samples) == 1


def test_crash_records_of_another_run_or_unreadable_ones_change_nothing(tmp_path: Path) -> None:
    prefix = spool_prefix("mine", 0)
    other = spool_prefix("other", 0)
    state = {"pid": 999_999_999, "run": "other", "host": "h", "rank": 0, "incarnation": "x1", "phase": None,
             "sample": {"run": "other", "rank": 0, "incarnation": "x1"}}
    (tmp_path / f"{other}x1.state").write_text(json.dumps(state))
    (tmp_path / f"{other}x1.crash").write_text("Fatal Python error: Segmentation fault\n")
    # a file named as this rank's but saying it is another run's: refused, never sent for either
    (tmp_path / f"{prefix}x2.state").write_text(json.dumps({**state, "incarnation": "x2"}))
    (tmp_path / f"{prefix}x3.state").write_bytes(b"{" * (MAX_FILE_BYTES * 2))  # not JSON, read bounded
    found = crash_records(tmp_path, prefix, run="mine", rank=0, host="h", skip="")
    assert sorted((r.paths[0].name, r.sample, r.refused) for r in found) == [
        (f"{prefix}x2.state", None, True), (f"{prefix}x3.state", None, True)]
    assert (tmp_path / f"{other}x1.crash").exists()  # another run's record is left where it is


def test_two_ranks_one_runs_out_of_memory_the_other_times_out_in_the_collective(tmp_path: Path) -> None:
    from vramwatch.collector.server import BackgroundServer

    db = tmp_path / "vw.db"
    gone = tmp_path / "rank1-gone"
    with BackgroundServer(str(db)) as server:
        def rank(r: int, body: str) -> subprocess.Popen[str]:
            head = f"URL, RUN, OUT, STEPS = {server.url!r}, 'job', {str(tmp_path / f'r{r}')!r}, 20\n"
            return subprocess.Popen([sys.executable, "-c", head + textwrap.dedent(PRELUDE) + textwrap.dedent(body)],
                                    env={**os.environ, "PYTHONWARNINGS": "ignore", "RANK": str(r), "WORLD_SIZE": "2",
                                         "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
        one = rank(1, f"""
            import torch
            try:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB. GPU 1 has a total "
                                             "capacity of 79.15 GiB of which 3.12 GiB is free.")
            finally:
                open({str(gone)!r}, "w").close()
        """)
        zero = rank(0, f"""
            import torch.distributed as dist
            while not os.path.exists({str(gone)!r}):
                time.sleep(0.05)  # hung in the all-reduce its peer never joins
            time.sleep(0.5)
            raise dist.DistBackendError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=21, "
                                        "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600010 "
                                        "milliseconds before timing out.")
        """)
        for proc in (one, zero):
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 1, err
        with httpx.Client(base_url=server.url, timeout=30) as client:
            rows = {r["rank"]: r for r in client.get("/api/v1/runs/job/ranks").json()}
            pm = client.get("/api/v1/runs/job/postmortem").json()
            metrics = client.get("/metrics").text
    assert rows[1]["liveness"] == "dead" and rows[1]["died"]["cause"] == "oom"
    assert rows[1]["died"]["last_words"] == {
        "type": "torch.OutOfMemoryError", "phase": "train",
        "message": "CUDA out of memory. Tried to allocate 8.00 GiB. GPU 1 has a total capacity of 79.15 GiB of which "
                   "3.12 GiB is free."}
    assert rows[0]["died"]["cause"] == "collective_timeout"
    assert rows[0]["died"]["last_words"]["type"] == "torch.distributed.DistBackendError"
    assert rows[0]["died"]["culprit"] == {"host": rows[1]["host"], "rank": 1}
    assert (pm["first_failure"]["rank"], pm["first_failure"]["cause"]) == (1, "oom")
    died = {labels["rank"]: labels for name, labels, _ in exposed_samples(metrics) if name == "vramwatch_rank_died"}
    assert (died["1"]["cause"], died["1"]["phase"]) == ("oom", "train")
    assert died["1"]["last_words"].startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB")
    assert died["0"]["cause"] == "collective_timeout"
    assert pm["first_failure"]["victims"] == [{"host": rows[0]["host"], "rank": 0}]
    cli = subprocess.run([sys.executable, "-m", "vramwatch.cli", "postmortem", "job", "--db", str(db), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    doc = json.loads(cli.stdout)
    assert (doc["first_failure"]["rank"], doc["first_failure"]["cause"]) == (1, "oom")
    assert doc["first_failure"]["last_words"]["type"] == "torch.OutOfMemoryError"
    assert {r["rank"]: r["died"]["cause"] for r in doc["ranks"]} == {0: "collective_timeout", 1: "oom"}


def test_vramwatch_last_words_sends_what_a_dead_process_left_in_the_spool(tmp_path: Path) -> None:
    from vramwatch.collector.server import BackgroundServer

    spool = tmp_path / "spool"
    with BackgroundServer(str(tmp_path / "vw.db")) as server:
        dead = run_script("""
            import signal
            time.sleep(0.6)
            os.kill(os.getpid(), signal.SIGSEGV)
        """, run="crashed", out=spool, url=server.url)
        assert dead.returncode == -signal.SIGSEGV
        cli = [sys.executable, "-m", "vramwatch.cli", "last-words", "--spool-dir", str(spool), "--json"]
        listed = json.loads(subprocess.run(cli, capture_output=True, text=True, timeout=60, check=True).stdout)
        ((word,),) = [listed["last_words"]]
        assert (word["run"], word["last_words_type"], listed["sent"]) == ("crashed", "SIGSEGV", False)
        sent = subprocess.run([*cli, "--send", "--url", server.url], capture_output=True, text=True, timeout=60)
        assert sent.returncode == 0, sent.stderr
        with httpx.Client(base_url=server.url, timeout=30) as client:
            (row,) = client.get("/api/v1/runs/crashed/ranks").json()
    assert row["liveness"] == "dead" and row["died"]["cause"] == "crash"
    assert row["died"]["last_words"] == {"type": "SIGSEGV", "message": "Fatal Python error: Segmentation fault",
                                         "phase": "train"}
    assert not [p for p in spool.iterdir() if p.suffix in (".state", ".crash", ".term")]


def test_the_excepthook_never_raises_and_always_chains_even_when_sending_fails(tmp_path: Path, capsys) -> None:
    import warnings

    from vramwatch import hook

    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the trace folder should be")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unwritable folder is counted, never warned into the loop
        vw = hook.init(None, run="broken", probe="simulated", out_dir=blocked / "sub")
    try:
        vw.step(0)

        def refuse(sample: dict[str, Any]) -> None:
            raise RuntimeError("queue gone")

        vw.sender.submit = refuse  # type: ignore[method-assign]
        sys.excepthook(ValueError, ValueError("boom"), None)  # the installed, chained hook
        stats = vw.stats()
        assert stats["last_words_errors"] >= 1 and stats["last_words_sent"] == 0 and stats["crash_file"] is None
        assert "ValueError: boom" in capsys.readouterr().err  # the previous hook still printed it
    finally:
        vw.sender.submit = lambda sample: None  # type: ignore[method-assign]
        vw.close(1)


def test_a_pid_reused_by_a_later_process_does_not_keep_a_dead_one_alive(tmp_path: Path) -> None:
    from helpers import make_sample

    from vramwatch.probe.processes import start_time

    prefix = spool_prefix("reused", 0)
    sample = make_sample(7, run="reused", rank=0, host="h", incarnation="old", ts=time.time() - 5)
    doc = {"pid": os.getpid(), "start": "0", "run": "reused", "host": "h", "rank": 0, "incarnation": "old",
           "phase": "checkpoint", "sample": sample}
    (tmp_path / f"{prefix}old.state").write_text(json.dumps(doc))
    (tmp_path / f"{prefix}old.crash").write_text("Fatal Python error: Bus error\n\nCurrent thread ...\n")
    (record,) = crash_records(tmp_path, prefix, run="reused", rank=0, host="h")
    assert (record.sample["last_words_type"], record.sample["last_words_phase"]) == ("SIGBUS", "checkpoint")
    assert record.sample["incarnation"] == "old" and record.sample["step"] == 7
    # the same pid with its own start time is this very process: alive, nothing said for it
    (tmp_path / f"{prefix}old.state").write_text(json.dumps({**doc, "start": start_time(os.getpid())}))
    assert crash_records(tmp_path, prefix, run="reused", rank=0, host="h") == []


def test_an_exception_caught_inside_a_checkpoint_does_not_name_a_later_ones_phase(tmp_path: Path) -> None:
    result = run_script("""
        for attempt in range(50):  # many caught, forgotten checkpoint errors (their ids are reused)
            try:
                with vw.phase("checkpoint"):
                    raise OSError(28, "No space left on device")
            except OSError:
                pass
        try:
            with vw.phase("eval"):
                raise KeyError("labels")
        except KeyError as exc:
            raise RuntimeError("evaluation failed") from exc  # raised outside the phase, from one inside it
    """, run="phases", out=tmp_path)
    assert result.returncode == 1
    (word,) = spoken(trace_samples(tmp_path, "phases"))
    assert (word["last_words_type"], word["last_words_phase"]) == ("RuntimeError", "eval")
    died = story_of(trace_samples(tmp_path, "phases"), "phases").rank(word["host"], 0).died
    assert died.cause == Outcome.EXCEPTION
