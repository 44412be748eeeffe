"""A fake ``torch.cuda`` namespace for the torch probe: scripted allocator stats.

``FakeCuda.memory_stats()`` returns a flat dict with the real key names; the test moves
``allocated``/``reserved`` and the fake keeps ``.peak`` the way the caching allocator does
(a high-water mark since the last ``reset_peak_memory_stats()``).
"""

from __future__ import annotations

import types
from typing import Any

GiB = 1024**3


class FakeCuda:
    def __init__(self, *, total: int = 80 * GiB, uuid: str = "5a2b1c3d-0000-1111-2222-333344445555",
                 devices: int = 1, backend: str = "native") -> None:
        self.total = total
        self.uuid = uuid
        self.devices = devices
        self.allocated = 0
        self.peak = 0
        self.reserved = 0
        self.active_extra = 0
        self.inactive_split = 0
        self.retries = 0
        self.ooms = 0
        self.stats_calls = 0
        self.reset_calls = 0
        self.fail_next = 0
        self.memory = types.SimpleNamespace(get_allocator_backend=lambda: backend)

    # what the training code does
    def alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    # the torch.cuda API the probe uses
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.devices

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, index: int) -> Any:
        return types.SimpleNamespace(name="Fake GPU", total_memory=self.total, uuid=self.uuid)

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        self.stats_calls += 1
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        stats = {}
        for pool in ("all", "large_pool", "small_pool"):
            share = 1.0 if pool == "all" else 0.5
            stats[f"allocated_bytes.{pool}.current"] = int(self.allocated * share)
            stats[f"allocated_bytes.{pool}.peak"] = int(self.peak * share)
            stats[f"reserved_bytes.{pool}.current"] = int(self.reserved * share)
            stats[f"active_bytes.{pool}.current"] = int((self.allocated + self.active_extra) * share)
            stats[f"inactive_split_bytes.{pool}.current"] = int(self.inactive_split * share)
        stats["num_alloc_retries"] = self.retries
        stats["num_ooms"] = self.ooms
        stats["num_sync_all_streams"] = 0
        return stats

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.reset_calls += 1
        self.peak = self.allocated
