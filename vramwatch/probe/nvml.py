"""NVML (nvidia-ml-py, import name ``pynvml``): device-wide and per-process used memory.

NVML calls take milliseconds (the compute-process list tens of ms, the first call without
persistence mode seconds), so they never run on the training thread: :class:`NvmlPoller`
polls on a daemon thread at a fixed interval (default 1 s) and publishes its latest
reading as one immutable tuple that the probe reads with a single attribute load.

The torch device is mapped to its NVML handle by UUID, because ``CUDA_VISIBLE_DEVICES``
renumbers devices (torch's ``cuda:0`` may be physical GPU 3, or a MIG slice). NVML
reports ``GPU-<uuid>`` / ``MIG-<uuid>``; torch prints the bare uuid; both are compared
without the prefix. Without a UUID, ``CUDA_VISIBLE_DEVICES`` (indices or UUID prefixes)
is resolved by hand.

Failure modes are values, not exceptions: NVML missing or failing to initialise →
:func:`open_device` returns ``None`` and samples carry ``nvml_used_bytes: null``; a GPU
that falls off the bus (``NVMLError_GpuIsLost``, value 15) → the poller publishes ``None``, counts
the error and stops polling that handle.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from types import ModuleType
from typing import Any, NamedTuple

from vramwatch.probe.processes import ForeignProcess, ProcessNames

#: Foreign processes a reading names (the largest first); the rest count in foreign_used_bytes only.
MAX_FOREIGN = 16


class GpuProcess(NamedTuple):
    """One entry of NVML's compute- or graphics-process list (``usedGpuMemory`` None: NVML does not say)."""

    pid: int
    used_bytes: int | None


class NvmlReading(NamedTuple):
    used_bytes: int
    total_bytes: int
    process_used_bytes: int | None  # None: NVML does not say (MIG without privileges, container PIDs)
    ts: float
    # memory other processes hold on this GPU (a stale notebook kernel, another job); None when
    # NVML gives no process list or this process is not in it (another PID namespace: cannot tell)
    foreign_used_bytes: int | None = None
    processes: tuple[GpuProcess, ...] = ()
    # the other processes by name (largest first, at most MAX_FOREIGN); empty when NVML's PIDs
    # are another namespace's (this process is not in the list): their /proc is not theirs here
    foreign: tuple[ForeignProcess, ...] = ()


def load_pynvml() -> ModuleType | None:
    """The seam: tests put a fake ``pynvml`` module in ``sys.modules``."""
    try:
        import pynvml
    except Exception:
        return None
    return pynvml


def normalize_uuid(uuid: Any) -> str:
    """'GPU-ABC…' / 'MIG-abc…' / b'…' / torch's _CUuuid → 'abc…' (lower case, no prefix)."""
    if isinstance(uuid, bytes):
        uuid = uuid.decode("ascii", "replace")
    text = str(uuid).strip().strip("\0").lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NvmlDevice:
    """One NVML handle (a whole GPU or a MIG device) plus what this process uses on it."""

    def __init__(self, pynvml: ModuleType, handle: Any, *, pid: int | None = None,
                 names: ProcessNames | None = None) -> None:
        self.pynvml = pynvml
        self.handle = handle
        self.pid = os.getpid() if pid is None else pid
        self.names = ProcessNames() if names is None else names
        self.uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        try:
            self.name = _text(pynvml.nvmlDeviceGetName(handle))
        except Exception:
            self.name = "unknown"
        self.is_mig = self.uuid.upper().startswith("MIG-")
        try:  # the host's numbering ("GPU 3" in nvidia-smi), not torch's renumbered index
            self.index: int | None = int(pynvml.nvmlDeviceGetIndex(handle))
        except Exception:
            self.index = None  # a MIG handle, an old driver

    def read(self) -> NvmlReading:
        """Device memory and the process lists: milliseconds, so only on the poller thread."""
        nv = self.pynvml
        info = nv.nvmlDeviceGetMemoryInfo(self.handle)
        processes = self._processes()
        own, foreign = _split_processes(processes, self.pid)
        named: tuple[ForeignProcess, ...] = ()
        if foreign is not None and processes:  # our PID is listed: the others' PIDs are ours to read
            others = sorted((p for p in processes if p.pid != self.pid), key=lambda p: -(p.used_bytes or 0))
            named = tuple(self.names.lookup(p.pid, p.used_bytes) for p in others[:MAX_FOREIGN])
        return NvmlReading(int(info.used), int(info.total), own, time.time(), foreign, processes or (), named)

    def _processes(self) -> tuple[GpuProcess, ...] | None:
        """Compute and graphics processes, one entry per PID (a process in both lists is one
        process: NVML reports its whole usage in each)."""
        nv = self.pynvml
        try:
            listed = list(nv.nvmlDeviceGetComputeRunningProcesses(self.handle))
        except Exception as exc:
            if _is_gpu_lost(nv, exc):
                raise
            return None  # not supported here (e.g. MIG without privileges): unknown, not zero
        try:
            listed += nv.nvmlDeviceGetGraphicsRunningProcesses(self.handle)
        except Exception as exc:
            if _is_gpu_lost(nv, exc):
                raise  # no graphics list on a compute-only GPU: the compute list is the answer
        by_pid: dict[int, int | None] = {}
        for proc in listed:
            used = getattr(proc, "usedGpuMemory", None)
            pid, used = int(proc.pid), None if used is None else int(used)
            if pid not in by_pid or (used or 0) > (by_pid[pid] or 0):
                by_pid[pid] = used
        return tuple(GpuProcess(pid, used) for pid, used in by_pid.items())


def _split_processes(processes: tuple[GpuProcess, ...] | None, pid: int) -> tuple[int | None, int | None]:
    """(bytes this process uses, bytes the other processes use); None where NVML cannot tell."""
    if processes is None:
        return None, None
    own: int | None = None
    foreign = 0
    found = False
    for proc in processes:
        if proc.pid == pid:
            found = True
            if proc.used_bytes is not None:
                own = (own or 0) + proc.used_bytes
        elif proc.used_bytes is not None:
            foreign += proc.used_bytes
    # not listed: NVML's PIDs are another namespace's (a container), so "others" would include us
    return own, (foreign if found else None)


def _is_gpu_lost(pynvml: ModuleType, exc: BaseException) -> bool:
    lost = getattr(pynvml, "NVMLError_GpuIsLost", None)
    if lost is not None and isinstance(exc, lost):
        return True
    return getattr(exc, "value", None) == getattr(pynvml, "NVML_ERROR_GPU_IS_LOST", 15)


def _visible_entry(index: int, env: Mapping[str, str]) -> str | None:
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    return entries[index] if 0 <= index < len(entries) else None


def _handle_by_uuid(pynvml: ModuleType, wanted: str) -> Any | None:
    """Find a GPU or MIG handle whose UUID starts with ``wanted`` (CUDA accepts prefixes)."""
    if not wanted:
        return None
    nv = pynvml
    for i in range(nv.nvmlDeviceGetCount()):
        handle = nv.nvmlDeviceGetHandleByIndex(i)
        if normalize_uuid(nv.nvmlDeviceGetUUID(handle)).startswith(wanted):
            return handle
        for mig in _mig_handles(nv, handle):
            if normalize_uuid(nv.nvmlDeviceGetUUID(mig)).startswith(wanted):
                return mig
    return None


def _mig_handles(pynvml: ModuleType, handle: Any) -> list[Any]:
    nv = pynvml
    try:
        current, _pending = nv.nvmlDeviceGetMigMode(handle)
    except Exception:
        return []  # not MIG-capable, or an old driver
    if current != getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1):
        return []
    out = []
    try:
        count = nv.nvmlDeviceGetMaxMigDeviceCount(handle)
    except Exception:
        return []
    for j in range(count):
        try:
            out.append(nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, j))
        except Exception:
            continue  # empty slot
    return out


def open_device(
    torch_index: int,
    *,
    torch_uuid: Any = None,
    env: Mapping[str, str] | None = None,
    pynvml: ModuleType | None = None,
) -> NvmlDevice | None:
    """The NVML view of torch's ``cuda:<torch_index>``, or ``None`` when NVML can't say.

    Order: torch's device UUID; else the ``CUDA_VISIBLE_DEVICES`` entry (a UUID prefix or
    a physical index); else the index itself (no renumbering in effect).
    """
    env = os.environ if env is None else env
    nv = load_pynvml() if pynvml is None else pynvml
    if nv is None:
        return None
    try:
        nv.nvmlInit()
    except Exception:
        return None  # no driver / library: unknown, reported as null
    try:
        handle = None
        if torch_uuid is not None and normalize_uuid(torch_uuid):
            handle = _handle_by_uuid(nv, normalize_uuid(torch_uuid))
        if handle is None:
            entry = _visible_entry(torch_index, env)
            if entry is not None and not entry.lstrip("-").isdigit():
                handle = _handle_by_uuid(nv, normalize_uuid(entry))
            elif entry is not None:
                handle = nv.nvmlDeviceGetHandleByIndex(int(entry))
            elif env.get("CUDA_VISIBLE_DEVICES") is None:
                handle = nv.nvmlDeviceGetHandleByIndex(torch_index)
        if handle is None:
            return None
        return NvmlDevice(nv, handle)
    except Exception:
        return None


class NvmlPoller:
    """Polls one :class:`NvmlDevice` on a daemon thread; ``latest`` is the last good reading."""

    def __init__(self, device: NvmlDevice, *, interval_s: float = 1.0) -> None:
        self.device = device
        self.interval_s = max(0.01, float(interval_s))
        self.latest: NvmlReading | None = None
        self.errors = 0
        self.polls = 0
        self.lost = False
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="vramwatch-nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            if self.lost:
                return
            self._stop.wait(self.interval_s)

    def poll_once(self) -> None:
        try:
            self.latest = self.device.read()
            self.polls += 1
        except Exception as exc:
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            if _is_gpu_lost(self.device.pynvml, exc):
                self.lost = True
                self.latest = None  # a lost GPU has no used memory we know of
            elif self.latest is not None and time.time() - self.latest.ts > 10 * self.interval_s:
                self.latest = None  # too stale to attach to a sample

    def stats(self) -> dict[str, Any]:
        return {"nvml_polls": self.polls, "nvml_errors": self.errors, "nvml_lost": self.lost,
                "nvml_last_error": self.last_error}

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._pid == os.getpid() and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)


__all__ = ["GpuProcess", "NvmlDevice", "NvmlPoller", "NvmlReading", "load_pynvml", "normalize_uuid", "open_device"]
