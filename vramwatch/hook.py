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
``step()`` runs on the training thread: one probe read (one ``torch.cuda.memory_stats()``
on GPU; NVML numbers come from a background poller), one dict, one deque append. No
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
previous step and the phase start is folded into the next train sample.

Configuration by environment (arguments win): ``VRAMWATCH_URL``, ``VRAMWATCH_TOKEN``,
``VRAMWATCH_RUN``, ``VRAMWATCH_PROBE`` (auto/torch/simulated/none), ``VRAMWATCH_DIR``
(trace files without url), ``VRAMWATCH_SPOOL_DIR``, ``VRAMWATCH_DISABLE=1``.
"""

from __future__ import annotations

import atexit
import math
import numbers as _numbers
import os
import re
import threading
import time
import warnings
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

from vramwatch import identity as _identity
from vramwatch.delivery import BatchSender, FileTransport, HttpTransport, default_spool_dir, spool_prefix
from vramwatch.probe import Probe, make_probe
from vramwatch.probe.torch_cuda import PEAK_POLICIES
from vramwatch.wire import MAX_INT, PHASE_RE, SCHEMA_VERSION

_EXTRA_KEY_RE = re.compile(r"[^\x00-\x1f\x7f]{1,64}\Z")


class HookWarning(UserWarning):
    """Something in the hook failed; training goes on, the failure is counted in stats()."""


_live_monitors: weakref.WeakSet[Monitor] = weakref.WeakSet()
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
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        self._monitor._end_phase(self._name, self._t0, self._open)
        return False  # never swallow the user's exception


class Monitor:
    """One rank's monitor. Build it with :func:`vramwatch.init` (same arguments)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        run: str | None = None,
        host: str | None = None,
        rank: int | None = None,
        local_rank: int | None = None,
        world_size: int | None = None,
        probe: str | Probe | None = None,
        device: int | None = None,
        token: str | None = None,
        peak: str = "reset",
        nvml_interval_s: float = 1.0,
        flush_interval_s: float = 1.0,
        batch_size: int = 512,
        max_queue: int = 8192,
        out_dir: str | os.PathLike[str] | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        backoff_max_s: float = 30.0,
        scenario: str | None = None,
        enabled: bool | None = None,
    ) -> None:
        if peak not in PEAK_POLICIES:
            raise ValueError(f"peak: must be one of {', '.join(PEAK_POLICIES)}, got {peak!r}")
        if flush_interval_s <= 0 or nvml_interval_s <= 0:
            raise ValueError("flush_interval_s/nvml_interval_s: must be positive")
        env = os.environ
        if enabled is None:
            enabled = env.get("VRAMWATCH_DISABLE", "").strip().lower() not in ("1", "true", "yes")
        self.identity = _identity.resolve(run=run, host=host, rank=rank, local_rank=local_rank,
                                          world_size=world_size)
        ident = self.identity
        self.url = url if url is not None else (env.get("VRAMWATCH_URL") or None)
        token = token if token is not None else (env.get("VRAMWATCH_TOKEN") or None)
        transport: HttpTransport | FileTransport | None = None
        if self.url:
            try:
                transport = HttpTransport(self.url, token=token)
            except ValueError as exc:  # name where the bad value came from
                raise ValueError(str(exc) if url is not None else "VRAMWATCH_URL" + str(exc)[3:]) from None
        self._active = False
        self._closed = False
        self._lock = threading.Lock()  # close() vs. atexit; never taken by step()
        self._pid = os.getpid()
        self._samples = 0
        self._probe_errors = 0
        self._hook_errors = 0
        self._ignored_numbers = 0
        self._last_error: str | None = None
        self._warned: set[str] = set()
        self._last_step = 0
        self._last_t: float | None = None
        self.probe: Probe | None = None
        self.sender: BatchSender | None = None
        self.trace_path: Path | None = None
        _live_monitors.add(self)
        if not enabled:
            return
        try:
            self.probe = make_probe(probe, device=device, rank=ident["rank"], local_rank=ident["local_rank"],
                                    peak=peak, nvml_interval_s=nvml_interval_s, scenario=scenario)
        except ValueError:
            raise  # a wrong probe name is the caller's error: say so before training starts
        except Exception as exc:
            self._warn("probe-start", f"vramwatch: the {probe or 'auto'} probe failed to start "
                                      f"({type(exc).__name__}: {exc}); monitoring is off")
            self.probe = None
        if self.probe is None:
            return
        try:
            info = self.probe.device_info()
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
        self._base = base
        if transport is None:
            trace_dir = Path(out_dir or env.get("VRAMWATCH_DIR") or "vramwatch-traces")
            self.trace_path = trace_dir / ident["run"] / (
                f"{ident['host']}-rank{ident['rank']}-{ident['incarnation']}.jsonl")
            self.sender = BatchSender(FileTransport(self.trace_path), batch_size=batch_size,
                                      interval_s=flush_interval_s, max_queue=max_queue)
        else:
            spool_root = Path(spool_dir) if spool_dir is not None else default_spool_dir()
            prefix = spool_prefix(ident["run"], ident["rank"])
            try:  # earlier incarnations of this rank left samples behind: replay them first
                leftovers = sorted(spool_root.glob(prefix + "*.jsonl"), key=lambda p: p.stat().st_mtime)
            except OSError:
                leftovers = []
            self.sender = BatchSender(transport, batch_size=batch_size, interval_s=flush_interval_s,
                                      max_queue=max_queue, backoff_max_s=backoff_max_s,
                                      spool_path=spool_root / f"{prefix}{ident['incarnation']}.jsonl",
                                      adopt_spools=leftovers)
        self._active = True

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
            sample = self._base.copy()
            sample.update(reading)
            sample["step"] = step
            sample["ts"] = time.time()
            sample["phase"] = "train"
            now = time.perf_counter()
            if self._last_t is not None:
                sample["step_time_s"] = now - self._last_t
            self._last_t = now
            if numbers:
                self._add_numbers(sample, numbers)
            self.sender.submit(sample)  # type: ignore[union-attr]
            self._samples += 1
            self._last_step = step
        except Exception as exc:
            self._hook_error(exc)

    def _add_numbers(self, sample: dict[str, Any], numbers: dict[str, Any]) -> None:
        extra: dict[str, float] = {}
        for key, value in numbers.items():
            if type(value) not in (int, float):
                if isinstance(value, _numbers.Real):
                    value = float(value)  # numpy scalars; never a tensor (.item() would sync the GPU)
                else:
                    self._ignored_numbers += 1
                    self._warn("numbers", f"vramwatch: step({key}=...) must be a Python number, got "
                                          f"{type(value).__name__}; ignored (use .item() yourself if you mean it)")
                    continue
            if not math.isfinite(value) or abs(value) > MAX_INT:
                self._ignored_numbers += 1
                continue
            if key == "tokens" and value >= 0:
                sample["tokens"] = int(value)
            elif _EXTRA_KEY_RE.match(key):
                extra[key] = value
        if extra:
            sample["extra"] = extra

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
        begin = getattr(self.probe, "begin_phase", None)
        if begin is None:
            return True
        try:
            begin(name)
        except Exception as exc:
            self._probe_error(exc)
            return False
        return True

    def _end_phase(self, name: str, t0: float, opened: bool) -> None:
        if not self._active:
            return
        try:
            step = self._last_step
            end = getattr(self.probe, "end_phase", None) if opened else None
            try:
                reading = end(step, name) if end is not None else self.probe.read(step, name)  # type: ignore[union-attr]
            except Exception as exc:
                self._probe_error(exc)
                return
            now = time.perf_counter()
            sample = self._base.copy()
            sample.update(reading)
            sample["step"] = step
            sample["ts"] = time.time()
            sample["phase"] = name
            sample["step_time_s"] = now - t0  # a phase sample's time is the phase's duration
            self._last_t = now  # the next step's time excludes the phase
            self.sender.submit(sample)  # type: ignore[union-attr]
            self._samples += 1
        except Exception as exc:
            self._hook_error(exc)

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
            self._active = False
        if self._pid != os.getpid():
            return True
        delivered = True
        try:
            if self.sender is not None:
                delivered = self.sender.close(timeout)
        except Exception as exc:
            self._hook_error(exc)
            delivered = False
        try:
            if self.probe is not None:
                self.probe.close()
        except Exception as exc:
            self._probe_error(exc)
        _live_monitors.discard(self)
        return delivered

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        return getattr(self.probe, "max_allocated_bytes", None)

    def stats(self) -> dict[str, Any]:
        """Counters: samples, errors, delivery (sent, spooled, dropped ...). Never raises."""
        out: dict[str, Any] = {
            "active": self._active,
            "probe": getattr(self.probe, "name", None),
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
            probe_stats = getattr(self.probe, "stats", None)
            if probe_stats is not None:
                out.update(probe_stats())
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
    """Start monitoring this rank; see :class:`Monitor` for the arguments.

    Identity (run, rank, ...) comes from torchrun/SLURM environment variables when not
    given. Wrong arguments raise ``ValueError`` naming the argument; a missing GPU or a
    failing probe only warns (the monitor is then a no-op).
    """
    global _current
    monitor = Monitor(url, **kwargs)
    _current = monitor
    return monitor


def current() -> Monitor | None:
    """The monitor of the latest :func:`init` in this process (None before)."""
    return _current


def _after_fork_in_child() -> None:
    global _current
    for monitor in list(_live_monitors):
        try:
            monitor._after_fork_in_child()
        except Exception:
            pass
    _live_monitors.clear()
    _current = None


def _close_all_at_exit() -> None:
    timeout = float(os.environ.get("VRAMWATCH_EXIT_TIMEOUT", "5") or 5)
    deadline = time.monotonic() + timeout
    for monitor in list(_live_monitors):
        if monitor._pid == os.getpid():
            try:
                monitor.close(max(0.1, deadline - time.monotonic()))
            except Exception:
                pass


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all_at_exit)

__all__ = ["HookWarning", "Monitor", "current", "init"]
