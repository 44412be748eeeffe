"""Hook side of last words: how this process ends, recorded even when nothing can be sent.

What it installs (once per process, whatever the number of monitors)
---------------------------------------------------------------------
* ``sys.excepthook`` and ``threading.excepthook`` are **chained**: the hook that was there before
  runs right after ours, with the same arguments; nothing is replaced or swallowed. An uncaught
  exception in the thread that started the monitor (the training thread) becomes the process's
  last words: one marker sample (a copy of the latest sample, ``ts`` now, the next ``seq``) with
  ``last_words_type`` (the qualified type), ``last_words_message`` (the message's first line,
  redacted, at most 128 characters) and ``last_words_phase`` (the phase it was raised in: the
  innermost ``with vw.phase(...)`` it left, else ``train``). Words that name an out-of-memory
  error also carry ``oom_marked``, so the OOM counts where torch's observer did not fire. It is
  queued at once; the exit handler flushes it (bounded by the exit timeout) or spools it when
  the collector is away.
  Other threads' exceptions are counted in ``stats()``, not sent: the process goes on.
* ``faulthandler`` writes into ``<spool prefix><incarnation>.crash`` beside the spool (or the
  trace files), so a fatal signal (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) leaves a record; a
  SIGTERM is written down the same way (``faulthandler.register`` chained to the handler before
  it: the signal still does what it did). A program that enabled faulthandler itself keeps it.
* A small state file (``.state``: the latest sample and the open phase) is rewritten by a daemon
  thread at most once per flush interval when it changed: what the crash record is built from.

The next process of the same rank (or a ``vramwatch`` command reading the spool,
:func:`crash_records`) finds a dead process's crash record and sends it as that process's last
words: its identity, its latest sample, ``ts`` when the record was written. The files are read
bounded (:data:`MAX_FILE_BYTES`), must name this run and rank (a file naming another run is left
alone: it cannot change that run's story) and the sample passes the wire's validation; a clean
``close()`` removes its own files.

Costs: nothing on the training thread per step (``with vw.phase`` sets one attribute more); the
excepthook builds one dict; the state thread writes a ~2 KB file at most once per interval.
Nothing here raises: every failure is counted in :meth:`LastWordsRecorder.stats`.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from vramwatch.causes import MAX_MESSAGE, MAX_TYPE, LastWords, classify, fatal_signal
from vramwatch.probe.processes import start_time
from vramwatch.redact import redact_text as redact_everywhere
from vramwatch.verdicts import Outcome
from vramwatch.wire import WireError, validate

#: a state or crash file is small; never read more of one
MAX_FILE_BYTES = 256 * 1024
#: dead processes' records adopted at most per start (a crash loop's leftovers stay bounded)
MAX_ADOPTED = 16
_CHAIN_DEPTH = 8
_STATE, _CRASH, _TERM = ".state", ".crash", ".term"


def redact_text(text: str, limit: int) -> str:
    """The one place outside text is made safe to send: its first line, control characters as
    spaces, secrets hidden by the one redaction (:func:`vramwatch.redact.redact_text`: URL userinfo,
    secret-named options and variables, headers),
    at most ``limit`` characters ("…" marks a cut)."""
    line = next(iter(str(text).splitlines()), "")
    line = "".join(c if c.isprintable() else " " for c in line).strip()
    line = redact_everywhere(line)
    return line if len(line) <= limit else line[:limit - 1] + "…"


def type_name(exc_type: type[BaseException]) -> str:
    """``torch.OutOfMemoryError``, ``OSError`` (builtins unqualified)."""
    module = getattr(exc_type, "__module__", "") or ""
    name = getattr(exc_type, "__qualname__", None) or exc_type.__name__
    return redact_text(name if module in ("builtins", "__main__") else f"{module}.{name}", MAX_TYPE)


class LastWordsRecorder:
    """One monitor's last-words machinery. Build it with :func:`attach_last_words`."""

    def __init__(self, monitor: Any, directory: Path, prefix: str, interval_s: float) -> None:
        self._monitor = weakref.ref(monitor)
        self.directory, self.prefix = directory, prefix
        ident = monitor.identity
        self.run, self.host, self.rank = ident["run"], ident["host"], ident["rank"]
        self.incarnation = ident["incarnation"]
        self.thread_id = threading.get_ident()  # init() runs on the training thread
        self.interval_s = max(0.2, interval_s)
        self.spoken = self.adopted = self.refused = self.errors = self.other_threads = 0
        self.crash_file: str | None = None
        self._stop = threading.Event()
        self._written: tuple[int, str | None] | None = None
        self._start = start_time(os.getpid())  # with the pid: this very process, not a later one given its pid
        self._thread: threading.Thread | None = None

    def path(self, incarnation: str, suffix: str) -> Path:
        return self.directory / f"{self.prefix}{incarnation}{suffix}"

    # ---------------------------------------------------------------- an exception

    def on_exception(self, exc: BaseException, thread_id: int) -> None:
        """Queue the last words of ``exc`` raised on ``thread_id`` (never raises)."""
        try:
            if thread_id != self.thread_id:
                self.other_threads += 1
                return
            monitor = self._monitor()
            if monitor is None or not monitor.active or monitor._pid != os.getpid():
                return
            sample = self._marker(monitor)
            if sample is None:
                return
            sample["last_words_type"] = type_name(type(exc))
            message = redact_text(str(exc), MAX_MESSAGE)
            if message:
                sample["last_words_message"] = message
            sample["last_words_phase"] = _phase_of(exc)
            words = LastWords(sample["last_words_type"], message, sample["last_words_phase"])
            if classify(words) == Outcome.OOM:  # an OOM the allocator's observer did not mark: counted all the same
                sample["oom_marked"] = True
            monitor._last_sample = sample
            monitor.sender.submit(sample)
            monitor._samples += 1
            self.spoken += 1
        except Exception:
            self.errors += 1

    @staticmethod
    def _marker(monitor: Any) -> dict[str, Any] | None:
        last = monitor._last_sample
        if last is None:  # died before its first step: a fresh reading
            last = dict(monitor._base)
            last.update(monitor.probe.read(monitor._last_step, "train"))
            last.update(step=monitor._last_step, phase="train")
        sample = {k: v for k, v in last.items() if k not in ("step_time_s", "oom_marked", "exit", "seq")}
        sample["ts"] = time.time()
        seq = monitor._next_seq(sample["step"], sample["phase"])
        if seq:
            sample["seq"] = seq
        return sample

    # ---------------------------------------------------------------- crash records

    def start(self) -> None:
        """Enable faulthandler into this process's crash file and start the state writer. A folder
        that cannot be written (a read-only home) leaves only the excepthooks: counted, not warned."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            self.errors += 1
            return
        _arm(self)
        self._thread = threading.Thread(target=self._write_loop, name="vramwatch-last-words", daemon=True)
        self._thread.start()

    def _write_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write_state()

    def write_state(self) -> None:
        """Rewrite the state file when the latest sample or the open phase changed."""
        monitor = self._monitor()
        if monitor is None or monitor._last_sample is None:
            return
        sample, phase = monitor._last_sample, monitor._open_phase
        if self._written == (id(sample), phase):
            return
        try:
            doc = {"pid": os.getpid(), "start": self._start, "run": self.run, "host": self.host, "rank": self.rank,
                   "incarnation": self.incarnation, "phase": phase, "sample": sample}
            tmp = self.path(self.incarnation, _STATE + ".tmp")
            tmp.write_text(json.dumps(doc), encoding="utf-8")
            os.replace(tmp, self.path(self.incarnation, _STATE))
            self._written = (id(sample), phase)
        except (OSError, TypeError, ValueError):
            self.errors += 1

    def adopt(self) -> list[dict[str, Any]]:
        """Send the crash records dead processes of this run and rank left here; remove them."""
        monitor = self._monitor()
        found = crash_records(self.directory, self.prefix, run=self.run, rank=self.rank, host=self.host,
                              skip=self.incarnation)
        for record in found[:MAX_ADOPTED]:
            if record.sample is not None and monitor is not None and monitor.sender is not None:
                monitor.sender.submit(record.sample)
                monitor._samples += 1
                self.adopted += 1
            else:
                self.refused += int(record.refused)
            record.remove()
        return [r.sample for r in found if r.sample is not None]

    def close(self) -> None:
        """Stop the writer, give faulthandler back, remove this process's files."""
        self._stop.set()
        _disarm(self)
        for suffix in (_STATE, _CRASH, _TERM, _STATE + ".tmp"):
            try:
                self.path(self.incarnation, suffix).unlink(missing_ok=True)
            except OSError:
                self.errors += 1

    def stats(self) -> dict[str, Any]:
        return {"last_words_sent": self.spoken, "crash_records_adopted": self.adopted,
                "crash_records_refused": self.refused, "last_words_errors": self.errors,
                "other_thread_exceptions": self.other_threads, "crash_file": self.crash_file}


#: the attribute ``with vw.phase(...)`` leaves on an exception that unwinds through it
PHASE_ATTR = "_vramwatch_phase"


def note_phase(exc: BaseException, phase: str) -> None:
    """Mark ``exc`` with the innermost phase it left (kept on the exception itself: no reference
    to it is held, and an exception caught and forgotten takes its mark with it). Never raises."""
    try:
        if getattr(exc, PHASE_ATTR, None) is None:
            setattr(exc, PHASE_ATTR, phase)
    except Exception:
        pass


def _phase_of(exc: BaseException) -> str:
    """The phase ``exc`` (or an exception it was raised from) left unwinding, else ``train``."""
    seen: BaseException | None = exc
    for _ in range(_CHAIN_DEPTH):
        if seen is None:
            break
        phase = getattr(seen, PHASE_ATTR, None)
        if type(phase) is str:
            return phase
        seen = seen.__cause__ or seen.__context__
    return "train"


# ---------------------------------------------------------------- reading a dead process's record


class CrashRecord:
    """A dead process's files and the marker sample they make (None when there is nothing to say
    or the files are refused)."""

    def __init__(self, paths: list[Path], sample: dict[str, Any] | None, refused: bool) -> None:
        self.paths, self.sample, self.refused = paths, sample, refused

    def remove(self) -> None:
        for p in self.paths:
            try:
                p.unlink(missing_ok=True)
            except OSError:
                pass


def crash_records(directory: Path, prefix: str, *, run: str, rank: int, host: str,
                  skip: str = "") -> list[CrashRecord]:
    """The records processes of ``run``/``rank`` that are gone left in ``directory`` (a process
    on this ``host`` whose pid is still alive is not gone). Bounded reads, validated samples."""
    out: list[CrashRecord] = []
    try:
        states = sorted(directory.glob(prefix + "*" + _STATE), key=lambda p: p.stat().st_mtime)
    except OSError:
        return out
    for state_path in states:
        incarnation = state_path.name[len(prefix):-len(_STATE)]
        if incarnation == skip:
            continue
        paths = [state_path, *(state_path.with_name(prefix + incarnation + s) for s in (_CRASH, _TERM))]
        try:
            doc = json.loads(_read(state_path))
            record = _record(doc, paths, run=run, rank=rank, host=host, incarnation=incarnation)
        except (OSError, ValueError, TypeError, KeyError, WireError):
            record = CrashRecord(paths, None, refused=True)
        if record is not None:
            out.append(record)
    return out


#: state files a spool scan looks at (the oldest first): a folder of leftovers stays a bounded read
MAX_SCANNED = 1024


def dead_processes(directory: Path, prefix_of: Callable[[str, int], str], *, host: str) -> list[CrashRecord]:
    """Every dead process's record in ``directory``, whatever its run and rank (what ``vramwatch
    last-words`` reads): each state file must be named with its own run and rank's prefix."""
    try:
        states = sorted(directory.glob("*" + _STATE), key=lambda p: p.stat().st_mtime)[:MAX_SCANNED]
    except OSError:
        return []
    seen: set[tuple[str, int]] = set()
    out: list[CrashRecord] = []
    for state_path in states:
        try:
            doc = json.loads(_read(state_path))
            run, rank = doc["run"], doc["rank"]
            prefix = prefix_of(run, rank)
        except (OSError, ValueError, TypeError, KeyError):
            out.append(CrashRecord([state_path], None, refused=True))
            continue
        if not state_path.name.startswith(prefix):
            out.append(CrashRecord([state_path], None, refused=True))
        elif (run, rank) not in seen:
            seen.add((run, rank))
            out.extend(crash_records(directory, prefix, run=run, rank=rank, host=host))
    return out


def _record(doc: dict[str, Any], paths: list[Path], *, run: str, rank: int, host: str,
            incarnation: str) -> CrashRecord | None:
    sample = doc["sample"]
    if (doc.get("run"), doc.get("rank"), sample.get("run"), sample.get("rank"), sample.get("incarnation")) != (
            run, rank, run, rank, incarnation):
        return CrashRecord(paths, None, refused=True)  # not this rank's: never speak for another run
    if doc.get("host") == host and _alive(doc.get("pid"), doc.get("start")):
        return None  # still running (two monitors of one rank): not dead
    words = _words(paths[1], paths[2])
    if words is None:
        return CrashRecord(paths, None, refused=False)  # gone without a word (SIGKILL): the model says how
    kind, message, written = words
    phase = doc.get("phase") or sample.get("phase") or "train"
    marker = {k: v for k, v in sample.items() if k not in ("step_time_s", "oom_marked", "exit")}
    marker.update(ts=max(float(sample["ts"]), written), seq=int(sample.get("seq") or 0) + 1,
                  last_words_type=kind, last_words_phase=redact_text(str(phase), MAX_TYPE))
    if message:
        marker["last_words_message"] = message
    return CrashRecord(paths, dict(validate(marker, now=time.time())), refused=False)


def _words(crash: Path, term: Path) -> tuple[str, str, float] | None:
    for path, default in ((crash, None), (term, "SIGTERM")):
        try:
            text = _read(path).decode("utf-8", "replace").strip()
            written = path.stat().st_mtime
        except OSError:
            continue
        if not text:
            continue
        first = redact_text(text, MAX_MESSAGE)
        kind = default or fatal_signal(first) or "SIGABRT"
        return kind, ("" if default else first), written
    return None


def _read(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(MAX_FILE_BYTES)


def _alive(pid: Any, start: Any) -> bool:
    """The process that wrote a state file still runs: its pid exists with the same start time (a
    pid reused by a later process, e.g. a restarted container's, is not it)."""
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # exists, another user's
    return start is None or start_time(pid) == start


# ---------------------------------------------------------------- process-wide hooks

_recorders: list[weakref.ref[LastWordsRecorder]] = []
_installed = False
_files: dict[str, TextIO] = {}  # what faulthandler writes into, kept open while armed
_owner: weakref.ref[LastWordsRecorder] | None = None


def _speak(exc: BaseException | None, thread_id: int) -> None:
    if exc is None or isinstance(exc, SystemExit):
        return
    for ref in list(_recorders):
        recorder = ref()
        if recorder is not None:
            recorder.on_exception(exc, thread_id)


def _install() -> None:
    """Chain sys.excepthook and threading.excepthook (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    previous_sys, previous_thread = sys.excepthook, threading.excepthook

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:
            _speak(exc, threading.get_ident())
        except Exception:
            pass
        previous_sys(exc_type, exc, tb)

    def thread_excepthook(args: Any) -> None:
        try:
            _speak(args.exc_value, args.thread.ident if args.thread is not None else 0)
        except Exception:
            pass
        previous_thread(args)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook


def _arm(recorder: LastWordsRecorder) -> None:
    """faulthandler into the recorder's crash file (unless the program enabled it itself, or
    another monitor of this process holds it), SIGTERM written down and chained."""
    global _owner
    if _owner is not None and _owner() is not None:
        return
    if faulthandler.is_enabled():
        recorder.crash_file = None  # the program's own faulthandler stays: no crash record
        return
    try:
        crash = open(recorder.path(recorder.incarnation, _CRASH), "w", encoding="utf-8")  # noqa: SIM115 - kept open
        faulthandler.enable(file=crash, all_threads=True)
        _files["crash"] = crash
        if hasattr(faulthandler, "register") and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            term = open(recorder.path(recorder.incarnation, _TERM), "w", encoding="utf-8")  # noqa: SIM115
            faulthandler.register(signal.SIGTERM, file=term, all_threads=False, chain=True)
            _files["term"] = term
        _owner = weakref.ref(recorder)
        recorder.crash_file = crash.name
    except (OSError, RuntimeError, ValueError):
        recorder.errors += 1


def _disarm(recorder: LastWordsRecorder) -> None:
    global _owner
    if _owner is None or _owner() is not recorder:
        return
    _owner = None
    try:
        faulthandler.disable()
        if "term" in _files:
            faulthandler.unregister(signal.SIGTERM)
    except (RuntimeError, ValueError):
        recorder.errors += 1
    for fh in _files.values():
        fh.close()
    _files.clear()


def attach_last_words(monitor: Any, directory: Path, prefix: str) -> LastWordsRecorder | None:
    """Start recording how ``monitor``'s process ends; None when the monitor is off. Sends the
    crash records earlier processes of this rank left in ``directory``. Never raises."""
    if not monitor.active or monitor.sender is None:
        return None
    try:
        recorder = LastWordsRecorder(monitor, directory, prefix, monitor.config.flush_interval_s)
        _recorders[:] = [r for r in _recorders if r() is not None]
        _recorders.append(weakref.ref(recorder))
        _install()
        recorder.start()
        recorder.adopt()
        return recorder
    except Exception as exc:
        monitor._hook_error(exc)
        return None


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) is not the rank: its crash must not read as the rank's."""
    global _owner
    _recorders.clear()
    if _owner is not None:
        try:
            faulthandler.disable()
            if "term" in _files:
                faulthandler.unregister(signal.SIGTERM)
        except (RuntimeError, ValueError):
            pass
    _owner = None
    _files.clear()


os.register_at_fork(after_in_child=_forget_in_child)


__all__ = ["MAX_FILE_BYTES", "CrashRecord", "LastWordsRecorder", "attach_last_words", "crash_records", "dead_processes",
           "note_phase", "redact_text", "type_name"]
