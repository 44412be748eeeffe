"""A scripted CUDA caching allocator behind torch's *own* Python ``torch.cuda`` code.

Only the C++ entry points that a CPU build of torch lacks are replaced:

* ``torch._C._cuda_memoryStats(device)`` -> a fresh nested dict of the real shape (the
  fixture ``cuda_memory_stats.json`` next to this file says where the shape comes from),
  with the live numbers of this fake allocator;
* ``torch._C._cuda_resetPeakMemoryStats(device)`` -> peak := current, as the allocator does;
* ``torch._C._cuda_hostMemoryStats()`` -> the pinned host allocator's nested stats;
* ``torch._C._cuda_getAllocatorBackend()`` -> ``"native"``;
* ``torch.cuda.memory.is_initialized`` -> True (a CPU build never initialises CUDA).

Device discovery, called once when a probe starts (``is_available``, ``device_count``,
``current_device``, ``get_device_properties``), is replaced at the ``torch.cuda`` level
because the real functions lazily initialise a CUDA runtime this machine lacks.
Everything on the per-step path -- ``memory_stats_as_nested_dict``, ``memory_stats``
(flatten + sort), ``reset_peak_memory_stats``, ``_get_device_index`` -- is torch's real code.

Use it through :meth:`FakeCuda.install` (a pytest ``monkeypatch``) or :meth:`FakeCuda.patched`
(a context manager, for benchmarks).
"""

from __future__ import annotations

import contextlib
import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GiB = 1024**3
FIXTURE = Path(__file__).with_name("cuda_memory_stats.json")
_POOLS = ("all", "small_pool", "large_pool")
# stat arrays the fake drives from its own state; the others keep the fixture's numbers
_LIVE = ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes")


def load_fixture() -> dict[str, Any]:
    """The nested stats dict of the real shape (without the fixture's ``_source`` note)."""
    data = json.loads(FIXTURE.read_text())
    data.pop("_source", None)
    return data


class _Stat:
    """One allocator counter: current and the high-water mark since the last reset."""

    __slots__ = ("current", "peak")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def set(self, value: int) -> None:
        self.current = value
        if value > self.peak:
            self.peak = value


class FakeCuda:
    """The allocator state a test scripts: ``alloc``/``free`` move ``allocated`` and its peak."""

    def __init__(self, *, total: int = 80 * GiB, uuid: str = "5a2b1c3d-0000-1111-2222-333344445555",
                 devices: int = 1, backend: str = "native") -> None:
        self.total = total
        self.uuid = uuid
        self.devices = devices
        self.backend = backend
        self._stats = {name: _Stat() for name in _LIVE}
        self.active_extra = 0
        self.retries = 0
        self.ooms = 0
        self.pinned = 0  # host pinned allocator bytes
        self.stats_calls = 0  # calls of the C++ entry point torch._C._cuda_memoryStats
        self.reset_calls = 0
        self.fail_next = 0
        self.template = load_fixture()
        self.memory = types.SimpleNamespace(get_allocator_backend=lambda: backend)

    # ---------------------------------------------------------------- what training does

    @property
    def allocated(self) -> int:
        return self._stats["allocated_bytes"].current

    @property
    def peak(self) -> int:
        return self._stats["allocated_bytes"].peak

    @property
    def reserved(self) -> int:
        return self._stats["reserved_bytes"].current

    @reserved.setter
    def reserved(self, value: int) -> None:
        self._stats["reserved_bytes"].set(value)

    @property
    def inactive_split(self) -> int:
        return self._stats["inactive_split_bytes"].current

    @inactive_split.setter
    def inactive_split(self, value: int) -> None:
        self._stats["inactive_split_bytes"].set(value)

    def alloc(self, nbytes: int) -> None:
        allocated = self.allocated + nbytes
        self._stats["allocated_bytes"].set(allocated)
        if allocated > self.reserved:
            self.reserved = allocated

    def free(self, nbytes: int) -> None:
        self._stats["allocated_bytes"].set(self.allocated - nbytes)

    # ---------------------------------------------------------------- the C++ entry points

    def memory_stats_entry(self, device: int) -> dict[str, Any]:
        """Stand-in for ``torch._C._cuda_memoryStats``: a new nested dict on every call, like C++."""
        self.stats_calls += 1
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if not isinstance(device, int):
            raise TypeError("invalid argument to memory_allocated")  # what the C++ entry says
        self._stats["active_bytes"].set(self.allocated + self.active_extra)
        out: dict[str, Any] = {}
        for key, value in self.template.items():
            if type(value) is not dict:
                out[key] = value
            elif "all" in value:
                out[key] = {pool: dict(stat) for pool, stat in value.items()}
            else:
                out[key] = dict(value)
        for name, stat in self._stats.items():
            small = stat.current // 64  # a plausible small-pool share; vramwatch reads "all"
            pools = out[name]
            pools["all"]["current"], pools["all"]["peak"] = stat.current, stat.peak
            pools["small_pool"]["current"], pools["small_pool"]["peak"] = small, stat.peak // 64
            pools["large_pool"]["current"] = stat.current - small
            pools["large_pool"]["peak"] = stat.peak - stat.peak // 64
        out["num_alloc_retries"] = self.retries
        out["num_ooms"] = self.ooms
        return out

    def reset_peak_entry(self, device: int) -> None:
        """Stand-in for ``torch._C._cuda_resetPeakMemoryStats``: every peak := current."""
        self.reset_calls += 1
        for stat in self._stats.values():
            stat.peak = stat.current

    def host_memory_stats_entry(self) -> dict[str, Any]:
        """Stand-in for ``torch._C._cuda_hostMemoryStats`` (pinned host allocator)."""
        stat = {"current": self.pinned, "peak": self.pinned, "allocated": self.pinned, "freed": 0}
        return {"allocations": dict(stat, current=1 if self.pinned else 0), "allocated_bytes": stat,
                "active_requests": dict(stat), "active_bytes": dict(stat), "num_host_alloc": 1,
                "num_host_free": 0}

    # ---------------------------------------------------------------- installing it

    def device_properties(self, index: int) -> Any:
        return types.SimpleNamespace(name="Fake GPU", total_memory=self.total, uuid=self.uuid)

    def _patches(self, torch: Any) -> list[tuple[Any, str, Any]]:
        return [
            (torch._C, "_cuda_memoryStats", self.memory_stats_entry),
            (torch._C, "_cuda_resetPeakMemoryStats", self.reset_peak_entry),
            (torch._C, "_cuda_hostMemoryStats", self.host_memory_stats_entry),
            (torch._C, "_cuda_getAllocatorBackend", lambda: self.backend),
            (torch.cuda.memory, "is_initialized", lambda: True),
            (torch.cuda, "is_initialized", lambda: True),
            (torch.cuda, "is_available", lambda: True),
            (torch.cuda, "device_count", lambda: self.devices),
            (torch.cuda, "current_device", lambda: 0),
            (torch.cuda, "get_device_properties", self.device_properties),
        ]

    def install(self, monkeypatch: Any) -> types.ModuleType:
        """Patch torch for one test (pytest ``monkeypatch``); returns the real ``torch.cuda``."""
        import torch

        for target, name, value in self._patches(torch):
            monkeypatch.setattr(target, name, value, raising=False)
        return torch.cuda

    @contextlib.contextmanager
    def patched(self) -> Iterator[types.ModuleType]:
        """The same patches as :meth:`install`, undone on exit (benchmarks, scripts)."""
        import torch

        missing = object()
        saved = [(target, name, getattr(target, name, missing)) for target, name, _v in self._patches(torch)]
        try:
            for target, name, value in self._patches(torch):
                setattr(target, name, value)
            yield torch.cuda
        finally:
            for target, name, old in saved:
                if old is missing:
                    delattr(target, name)
                else:
                    setattr(target, name, old)
