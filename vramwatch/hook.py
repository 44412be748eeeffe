"""The rank-local hook: ``vramwatch.init()`` returns a :class:`Monitor` for the training loop.

.. code-block:: python

    vw = vramwatch.init(url="http://collector:8765")   # no url: JSONL trace files locally
    for step, batch in enumerate(loader):
        ...; optimizer.step()
        vw.step(step, tokens=batch_tokens)               # other numbers go to `extra`
        if step % 5000 == 0:
            with vw.phase("checkpoint"):
                save_checkpoint(...)
    vw.close()                                           # also runs at exit

What it costs and what it never does
------------------------------------
``step()`` runs on the training thread: one probe read (one
``torch.cuda.memory_stats_as_nested_dict()`` on GPU; NVML and host-memory numbers come from
background pollers), one dict, one deque append. No
lock, no I/O, no network: a daemon worker (:mod:`vramwatch.delivery`) batches, gzips and
POSTs, spooling to disk while the collector is away. Nothing raises into the training
loop: a failing probe or sender is counted in :meth:`Monitor.stats` and warned about once.
Without CUDA (CPU torch, no GPU) the monitor says so once and does nothing, rather than
reporting zeros as if they were measurements.

Per-step peak (``peak=``, see :mod:`vramwatch.probe.torch_cuda`)
----------------------------------------------------------------
``peak_allocated_bytes`` is the peak since the previous sample. Default ``peak="reset"``
calls ``torch.cuda.reset_peak_memory_stats()`` after each read, so each step's peak is
exact; the run-long maximum that ``torch.cuda.max_memory_allocated()`` used to give is
kept by the monitor: :meth:`Monitor.max_memory_allocated`. ``peak="never"`` leaves the
counter alone (for code that owns it) and reports the exact peak whenever a new high is
reached, otherwise the lower bound ``max(previous allocated, allocated)``. A phase sample
(``with vw.phase("checkpoint")``) carries the peak *during* the phase; the time between the
previous step and the phase start is folded into the next train sample. As a phase begins, one
copy of the last train sample (next ``seq``, ``ts`` now) marked ``phase_open: true`` says the
rank's coming silence is a phase, not a stop (a dict copy: no probe read).

End markers (for ``vramwatch postmortem``): a clean :meth:`Monitor.close` sends one more
sample, a copy of the last train sample (same step, next ``seq``, ``ts`` now) with ``exit:
true`` -- not when the exit handler closes it after an unhandled exception, which is no clean
end; :meth:`Monitor.mark_oom` (for torch's out-of-memory observer) sends a fresh reading with
``oom_marked: true``. A rank that stops without either died silently -- unless it said
something: an uncaught exception is sent as its last words, a fatal signal leaves a crash record
that its next process sends (:mod:`vramwatch.evidence.last_words`).

Configuration: one :class:`~vramwatch.config.Config` (every field, every ``VRAMWATCH_*``
variable; arguments win over the environment). ``init(**kwargs)`` is
``Monitor(Config.from_env(**kwargs))``.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from vramwatch import identity as _identity
from vramwatch.config import Config
from vramwatch.delivery import BatchSender, FileExporter, HttpExporter, leftover_spools, lifecycle, spool_prefix
from vramwatch.evidence.capture import CaptureAgent, attach_capture
from vramwatch.evidence.foreign import ForeignReporter, attach_foreign
from vramwatch.evidence.last_words import LastWordsRecorder, attach_last_words, note_phase
from vramwatch.notebook import live_view
from vramwatch.probe import BaseProbe, make_probe
from vramwatch.probe.host import HostPoller
from vramwatch.probe.model_memory import ModelMemory, runtime_settings
from vramwatch.stepseq import SeqCounter, add_numbers
from vramwatch.wire import PHASE_RE, SCHEMA_VERSION


class HookWarning(UserWarning):
    """Something in the hook failed; training goes on, the failure is counted in stats()."""


_current: Monitor | None = None


class _NullPhase:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


_NULL_PHASE = _NullPhase()


class _Phase:
    __slots__ = ("_monitor", "_name", "_open", "_t0")

    def __init__(self, monitor: Monitor, name: str) -> None:
        self._monitor = monitor
        self._name = name
        self._t0 = 0.0
        self._open = False

    def __enter__(self) -> _Phase:
        self._t0 = time.perf_counter()
        self._open = self._monitor._begin_phase(self._name)
        self._monitor._mark("phase_open")  # a long first checkpoint is not read as the job stopping
        self._monitor._open_phase = self._name  # a crash record's phase
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        self._monitor._open_phase = None
        if exc is not None:  # the phase an exception left: its last words' phase if nothing catches it
            note_phase(exc, self._name)
        self._monitor._end_phase(self._name, self._t0, self._open)
        return False  # never swallow the user's exception


class Monitor:
    """One rank's monitor. Build it with :func:`vramwatch.init` (same arguments as :class:`Config`).

    ``Monitor(config)`` takes a :class:`Config`; ``Monitor(url, **fields)`` is
    ``Monitor(Config.from_env(url=url, **fields))``.
    """

    memory: ModelMemory | None = None  # vw.watch(model, optimizer)
    _runtime_pending = True
    last_words: LastWordsRecorder | None = None  # how this process ends (None: monitoring is off)
    _open_phase: str | None = None  # the phase a crash record names

    def __init__(self, config: Config | str | None = None, /, **overrides: Any) -> None:
        if not isinstance(config, Config):
            config = Config.from_env(url=config, **overrides)
        elif overrides:
            raise TypeError("Monitor(config): pass either a Config or keyword arguments, not both")
        self.config = config
        self.identity = _identity.resolve(run=config.run, host=config.host, rank=config.rank,
                                          local_rank=config.local_rank, world_size=config.world_size)
        self.url = config.url
        exporter = HttpExporter(config.url, token=config.token) if config.url else None  # ValueError: bad url
        self._active = self._closed = False
        self._lock = threading.Lock()  # close() vs. atexit; never taken by step()
        self._pid = os.getpid()
        self._samples = self._probe_errors = self._hook_errors = self._ignored_numbers = 0
        self._last_error: str | None = None
        self._warned: set[str] = set()
        self._last_step = 0
        self._last_t: float | None = None
        self._seq = SeqCounter()  # seq per (step, phase), a range per pass of the loop
        self._last_sample: dict[str, Any] | None = None
        self._last_train: dict[str, Any] | None = None
        self.probe: BaseProbe | None = None
        self.sender: BatchSender | None = None
        self.host: HostPoller | None = None
        self.trace_path: Path | None = None
        self._step_hooks: tuple[Callable[[int], None], ...] = ()
        self._close_hooks: tuple[Callable[[float], object], ...] = ()
        self.capture: CaptureAgent | None = None
        self.foreign: ForeignReporter | None = None
        lifecycle.on_fork_in_child(self, "_after_fork_in_child")
        if config.enabled and self._start_probe():
            self._base = self._base_sample()
            self.sender = self._make_sender(exporter)
            self.host = HostPoller.start(config.host_interval_s, pinned=self.probe.pinned_host_bytes)  # type: ignore[union-attr]
            self._active = True
            self.capture = attach_capture(self)  # None unless CUDA, a collector URL and snapshots on
            self.foreign = attach_foreign(self)  # None unless NVML is polled and there is a collector
            self.last_words = attach_last_words(self, *self._last_words_place())
        lifecycle.register(self)  # after its sender: the exit handler closes newest first, so this one first

    def _start_probe(self) -> bool:
        config, ident = self.config, self.identity
        spec = config.probe
        try:
            self.probe = make_probe(spec, device=config.device, rank=ident["rank"], local_rank=ident["local_rank"],
                                    peak=config.peak, nvml_interval_s=config.nvml_interval_s,
                                    scenario=config.scenario)
        except ValueError:
            raise  # a wrong probe name is the caller's error: say so before training starts
        except Exception as exc:
            self._warn("probe-start", f"vramwatch: the {spec if isinstance(spec, str) else 'given'} probe failed to "
                                      f"start ({type(exc).__name__}: {exc}); monitoring is off")
            self.probe = None
        return self.probe is not None

    def _base_sample(self) -> dict[str, Any]:
        ident = self.identity
        try:
            info = self.probe.device_info()  # type: ignore[union-attr]
        except Exception as exc:
            info = {}
            self._probe_error(exc)
        base: dict[str, Any] = {"schema": SCHEMA_VERSION, "run": ident["run"], "host": ident["host"],
                                "rank": ident["rank"], "local_rank": ident["local_rank"],
                                "world_size": ident["world_size"], "incarnation": ident["incarnation"],
                                "pid": ident["pid"]}
        for key in ("uuid", "gpu", "allocator"):
            if info.get(key) is not None:
                base[key] = info[key]
        return base

    def _make_sender(self, exporter: HttpExporter | None) -> BatchSender:
        config, ident = self.config, self.identity
        common = {"batch_size": config.batch_size, "interval_s": config.flush_interval_s,
                  "max_queue": config.max_queue, "worker": config.delivery_worker}
        if exporter is None:
            self.trace_path = config.trace_root() / ident["run"] / (
                f"{ident['host']}-rank{ident['rank']}-{ident['incarnation']}.jsonl")
            return BatchSender(FileExporter(self.trace_path), **common)
        root = config.spool_root()
        # earlier incarnations of this rank left samples behind: replay them first (one cap for all)
        return BatchSender(exporter, **common, backoff_max_s=config.backoff_max_s,
                           spool_path=root / f"{spool_prefix(ident['run'], ident['rank'])}{ident['incarnation']}.jsonl",
                           adopt_spools=leftover_spools(root, ident["run"], ident["rank"]),
                           max_spool_bytes=config.max_spool_bytes)

    def _last_words_place(self) -> tuple[Path, str]:
        """Where the crash record lives: beside the spool (or the trace files), named like the spool."""
        ident = self.identity
        where = self.trace_path.parent if self.trace_path is not None else self.config.spool_root()
        return where, spool_prefix(ident["run"], ident["rank"])

    # ------------------------------------------------------------------ hot path

    def step(self, step: int, **numbers: float) -> None:
        """Record one training step. Cheap, never blocks, never raises.

        ``tokens=`` fills the wire field ``tokens``; other keyword numbers go to ``extra``
        (pass Python numbers: the hook never calls ``.item()``, which would sync the GPU).
        """
        if not self._active:
            return
        try:
            if type(step) is not int:
                step = int(step)
            try:
                reading = self.probe.read(step, "train")  # type: ignore[union-attr]
            except Exception as exc:
                self._probe_error(exc)
                return
            if self.memory is not None:
                categories = self.memory.reading()  # a few len() unless the state changed: sparse fields
                if categories:
                    reading = {**reading, **categories}
            now = time.perf_counter()
            last, self._last_t = self._last_t, now
            if step < self._last_step and self._last_train is not None:
                self._seq.new_lap()  # the loop started over in this process (a notebook cell run again)
            self._emit(reading, step, "train", None if last is None else now - last, numbers, seq=self._seq.lap)
            self._last_step = step
            for hook in self._step_hooks:  # empty unless a feature (snapshot capture) asked
                hook(step)
        except Exception as exc:
            self._hook_error(exc)

    def watch(self, model: Any = None, optimizer: Any = None) -> None:
        """Count what ``model``, its gradients and ``optimizer``'s state hold, exactly, into the samples
        (:mod:`vramwatch.probe.model_memory`). Either may come later or be a list; a call adds."""
        if self.memory is None:
            self.memory = ModelMemory.for_probe(self.probe)
        self.memory.watch(model, optimizer)

    def add_step_hook(self, hook: Callable[[int], None]) -> None:
        """Run ``hook(step)`` on the training thread after each recorded step (keep it O(1) when idle;
        what it raises is counted in ``stats()['hook_errors']``, never raised into training)."""
        self._step_hooks += (hook,)

    def add_close_hook(self, hook: Callable[[float], object]) -> None:
        """Run ``hook(timeout_s)`` at :meth:`close` before the sender flushes (e.g. a pending upload)."""
        self._close_hooks += (hook,)

    def _emit(self, reading: dict[str, Any], step: int, phase: str, step_time_s: float | None,
              numbers: dict[str, Any] | None = None, host: dict[str, Any] | None = None, seq: int = 0,
              flag: str | None = None) -> None:
        """Build the one sample shape every path sends, and queue it."""
        sample = self._base.copy()
        sample.update(reading)
        sample["step"] = step
        sample["ts"] = time.time()
        sample["phase"] = phase
        if seq:
            sample["seq"] = seq
        if flag is not None:
            sample[flag] = True
        if step_time_s is not None:
            sample["step_time_s"] = step_time_s
        if host is None and self.host is not None:
            host = self.host.latest
        if host:
            sample.update(host)
        if self._runtime_pending:  # torch's version and allocator settings: sparse, on the first sample
            self._runtime_pending = False
            sample.update(runtime_settings())
        if numbers:
            self._add_numbers(sample, numbers)
        self._last_sample = sample
        if phase == "train":
            self._last_train = sample
        self.sender.submit(sample)  # type: ignore[union-attr]
        self._samples += 1

    def _add_numbers(self, sample: dict[str, Any], numbers: dict[str, Any]) -> None:
        ignored, not_number = add_numbers(sample, numbers)
        self._ignored_numbers += ignored
        if not_number is not None:
            self._warn("numbers", f"vramwatch: step({not_number}) must be a Python number; ignored (use "
                                  ".item() yourself if you mean it)")

    # ------------------------------------------------------------------ phases

    def phase(self, name: str) -> _Phase | _NullPhase:
        """``with vw.phase("checkpoint"): ...`` records one sample whose peak is the phase's."""
        if not self._active:
            return _NULL_PHASE
        if type(name) is not str or not PHASE_RE.match(name):
            self._hook_errors += 1
            self._warn(f"phase:{name!r}", f"vramwatch: phase: {name!r} is not a short name "
                                          "(1-32 of A-Z a-z 0-9 _ . : -); not recorded")
            return _NULL_PHASE
        return _Phase(self, name)

    def begin_phase(self, name: str) -> _Phase | _NullPhase:
        """Open a phase without a with-block (callbacks); call ``.__exit__(None, None, None)`` to end it."""
        phase = self.phase(name)
        phase.__enter__()
        return phase

    def _begin_phase(self, name: str) -> bool:
        try:
            self.probe.begin_phase(name)  # type: ignore[union-attr]
            if self.host is not None:
                self.host.begin_phase()
        except Exception as exc:
            self._probe_error(exc)
            return False
        return True

    def _end_phase(self, name: str, t0: float, opened: bool) -> None:
        if not self._active:
            return
        try:
            step = self._last_step
            probe = self.probe
            try:
                reading = probe.end_phase(step, name) if opened else probe.read(step, name)  # type: ignore[union-attr]
            except Exception as exc:
                self._probe_error(exc)
                return
            now = time.perf_counter()
            # phases are rare and checkpoints peak on the host too: the phase's peak RSS, read afresh
            host = self.host.end_phase() if self.host is not None and opened else None
            self._emit(reading, step, name, now - t0, host=host, seq=self._phase_seq(step, name))
            self._last_t = now  # the next step's time excludes the phase
        except Exception as exc:
            self._hook_error(exc)

    def _phase_seq(self, step: int, name: str) -> int:
        return self._seq.phase(step, name)

    # ------------------------------------------------------------------ lifecycle

    def flush(self, timeout: float = 5.0) -> bool:
        """Deliver what was recorded so far, waiting at most ``timeout`` s. True: all delivered."""
        sender = self.sender
        if sender is None or self._pid != os.getpid():
            return True
        try:
            return sender.flush(timeout)
        except Exception as exc:
            self._hook_error(exc)
            return False

    def close(self, timeout: float = 5.0) -> bool:
        """Flush (bounded by ``timeout``), spool what could not be sent, stop threads."""
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            was_active, self._active = self._active, False
        if self._pid != os.getpid():
            return True
        if was_active and not lifecycle.dying_of_an_exception():
            self._mark_exit()  # a clean close: the post-mortem tells it from a silent death
        delivered = True
        deadline = time.monotonic() + timeout  # one budget for the close hooks and the sender
        for hook in self._close_hooks:
            try:
                hook(max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                self._hook_error(exc)
        try:
            if self.sender is not None:
                delivered = self.sender.close(max(0.1, deadline - time.monotonic()))
        except Exception as exc:
            self._hook_error(exc)
            delivered = False
        try:
            if self.host is not None:
                self.host.release()
            if self.probe is not None:
                self.probe.close()
        except Exception as exc:
            self._probe_error(exc)
        if self.last_words is not None:
            self.last_words.close()
        lifecycle.unregister(self)
        return delivered

    def mark_oom(self) -> None:
        """Send a fresh sample marked ``oom_marked`` now (call it from torch's out-of-memory observer,
        on the training thread, before the error unwinds: the reading shows the risen ``ooms``).
        Never raises."""
        if not self._active:
            return
        try:
            step = self._last_step
            reading = self.probe.read(step, "train")  # type: ignore[union-attr]
            self._emit(reading, step, "train", None, seq=self._next_seq(step, "train"), flag="oom_marked")
        except Exception as exc:
            self._hook_error(exc)

    def _mark_exit(self) -> None:
        """A clean close: one more copy of the last train sample (now, next ``seq``) with ``exit: true``,
        so the post-mortem tells a clean end from a silent death. A copy, not a probe read: no side
        effects (peak resets), and always exactly one extra sample."""
        self._mark("exit")

    def _mark(self, flag: str) -> None:
        """A copy of the last train sample (now, next ``seq``) with ``flag`` true: ``exit`` (a clean
        close), ``phase_open`` (a phase began: its silence is expected until its phase sample)."""
        last = self._last_train if self._last_train is not None else self._last_sample
        if last is None:
            return
        try:
            sample = dict(last)
            for other in ("step_time_s", "oom_marked", "exit", "phase_open"):
                sample.pop(other, None)
            sample["ts"] = time.time()
            sample["seq"] = self._next_seq(sample["step"], sample["phase"])
            sample[flag] = True
            self._last_sample = sample
            self.sender.submit(sample)  # type: ignore[union-attr]
            self._samples += 1
        except Exception as exc:
            self._hook_error(exc)

    def _next_seq(self, step: int, phase: str) -> int:
        """The next free ``seq`` of ``phase`` at ``step`` (:class:`vramwatch.stepseq.SeqCounter`)."""
        return self._seq.next(step, phase)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _repr_html_(self) -> str:
        """Jupyter shows the monitor as its run's live page (:mod:`vramwatch.notebook`)."""
        where = None if self.trace_path is None else str(self.trace_path)
        return live_view(self.url, self.identity["run"], where=where)

    @property
    def active(self) -> bool:
        return self._active

    @property
    def run(self) -> str:
        return self.identity["run"]

    @property
    def rank(self) -> int:
        return self.identity["rank"]

    def max_memory_allocated(self) -> int | None:
        """Run-long peak of allocated bytes (what ``torch.cuda.max_memory_allocated()`` would say
        had the probe not reset it); None when the probe cannot tell."""
        return self.probe.max_allocated_bytes if self.probe is not None else None

    def stats(self) -> dict[str, Any]:
        """Counters: samples, errors, delivery (sent, spooled, dropped ...). Never raises."""
        out: dict[str, Any] = {
            "active": self._active,
            "probe": self.probe.name if self.probe is not None else None,
            "run": self.identity["run"],
            "rank": self.identity["rank"],
            "incarnation": self.identity["incarnation"],
            "samples": self._samples,
            "probe_errors": self._probe_errors,
            "hook_errors": self._hook_errors,
            "ignored_numbers": self._ignored_numbers,
            "last_error": self._last_error,
        }
        try:
            if self.probe is not None:
                out.update(self.probe.stats())
            if self.host is not None:
                out.update(self.host.stats())
            if self.foreign is not None:
                out.update({f"foreign_{k}": v for k, v in self.foreign.stats().items()})
            if self.last_words is not None:
                out.update(self.last_words.stats())
            if self.sender is not None:
                sender_stats = self.sender.stats()
                out["last_delivery_error"] = sender_stats.pop("last_error")
                out.update(sender_stats)
        except Exception as exc:
            out["stats_error"] = f"{type(exc).__name__}: {exc}"
        if self.trace_path is not None:
            out["trace_path"] = str(self.trace_path)
        return out

    # ------------------------------------------------------------------ failures

    def _warn(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        try:
            warnings.warn(message, HookWarning, stacklevel=4)
        except Exception:
            pass  # warnings configured as errors must not reach the training loop

    def _probe_error(self, exc: BaseException) -> None:
        self._probe_errors += 1
        self._last_error = f"probe: {type(exc).__name__}: {exc}"
        self._warn("probe-error", f"vramwatch: the probe failed ({type(exc).__name__}: {exc}); "
                                  "that step is not recorded, training goes on (counted in stats())")

    def _hook_error(self, exc: BaseException) -> None:
        self._hook_errors += 1
        self._last_error = f"hook: {type(exc).__name__}: {exc}"
        self._warn("hook-error", f"vramwatch: internal error ({type(exc).__name__}: {exc}); "
                                 "training goes on (counted in stats())")

    def _after_fork_in_child(self) -> None:
        # a forked DataLoader worker must neither sample nor send; the parent keeps going
        self._active = False
        self._closed = True
        self._lock = threading.Lock()


def init(url: str | None = None, **kwargs: Any) -> Monitor:
    """Start monitoring this rank: ``Monitor(Config.from_env(url=url, **kwargs))``.

    A second ``init()`` in the same process for the same run, rank and collector (a notebook cell
    run again) returns the running monitor: the process goes on, no restart is recorded and no
    thread is started twice. Sent to another collector, the same rank's previous monitor closes
    first; another run or rank gets a monitor of its own beside it.

    Every keyword is a :class:`~vramwatch.config.Config` field. Identity (run, rank, ...)
    comes from torchrun/SLURM environment variables when not given. Wrong arguments raise
    ``ValueError`` naming the argument; a missing GPU or a failing probe only warns (the
    monitor is then a no-op).
    """
    global _current
    config = Config.from_env(url=url, **kwargs)
    previous = _current
    if previous is not None and previous._pid == os.getpid() and not previous._closed:
        same = _same_rank(previous, config)
        if same and config.url == previous.config.url and config.enabled == previous.config.enabled:
            return previous  # a notebook cell run again: the same process goes on, nothing restarts
        if same:
            previous.close()  # the same rank sent elsewhere from now on: the old monitor ends cleanly
        # another rank or run: both go on (one process may monitor several, as the demo does)
    monitor = Monitor(config)
    _current = monitor
    return monitor


def _same_rank(monitor: Monitor, config: Config) -> bool:
    """Whether ``config`` names the monitor's own run, host and rank (a repeated ``init()``)."""
    ident = _identity.resolve(run=config.run, host=config.host, rank=config.rank, local_rank=config.local_rank,
                              world_size=config.world_size)
    mine = monitor.identity
    return (ident["run"], ident["host"], ident["rank"]) == (mine["run"], mine["host"], mine["rank"])


def current() -> Monitor | None:
    """The monitor of the latest :func:`init` in this process (None before)."""
    return _current


def _forget_current_in_child() -> None:
    global _current
    _current = None


os.register_at_fork(after_in_child=_forget_current_in_child)

__all__ = ["Config", "HookWarning", "Monitor", "current", "init"]
