"""Fake C++ entry points for torch's allocator history, snapshot and OOM observer.

Only ``torch._C`` functions are replaced; ``torch.cuda.memory._record_memory_history`` and
``_snapshot`` run as torch's own Python code. Names and argument lists are torch 2.13's
(``torch/cuda/memory.py``: ``_record_memory_history_impl`` passes 8 positional arguments to
``_C._cuda_record_memory_history``; ``_snapshot`` calls ``_C._cuda_memorySnapshot(None)``;
``torch/_dynamo/trace_rules.py`` lists ``torch._C._cuda_attach_out_of_memory_observer``).
The snapshot follows the ``Snapshot``/``Segment``/``Block``/``TraceEntry`` TypedDicts in
``torch.cuda.memory._snapshot``'s docstring; ``tests/test_evidence.py`` checks both contracts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

MiB = 2**20


def frames(name: str) -> list[dict[str, Any]]:
    return [{"filename": "train.py", "line": 42, "name": name}]


def snapshot_of(allocated: list[int], history: list[dict[str, Any]]) -> dict[str, Any]:
    """A one-segment snapshot holding ``allocated`` blocks (bytes), in torch's shape."""
    address, blocks = 0x7F0000000000, []
    for size in allocated:
        blocks.append({"size": size, "requested_size": size, "address": address, "state": "active_allocated",
                       "frames": frames("forward")})
        address += size
    total = max(sum(allocated), 2 * MiB)
    if total > sum(allocated):
        blocks.append({"size": total - sum(allocated), "requested_size": 0, "address": address,
                       "state": "inactive", "frames": []})
    segment = {"address": 0x7F0000000000, "total_size": total, "stream": 0, "segment_type": "large",
               "segment_pool_id": (0, 0), "allocated_size": sum(allocated), "active_size": sum(allocated),
               "requested_size": sum(allocated), "device": 0, "is_expandable": False, "frames": [],
               "blocks": blocks}
    return {"segments": [segment], "device_traces": [list(history)],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}


@dataclass
class FakeAllocatorHistory:
    """State behind the fake entry points: what was recorded, the observer, the calls."""

    recording: bool = False
    max_entries: int = 0
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    allocated: list[int] = field(default_factory=lambda: [64 * MiB])
    observers: list[Any] = field(default_factory=list)

    def record_memory_history(self, enabled: Any, context: Any, stacks: Any, max_entries: Any,
                              clear_history: Any, compile_context: Any, global_record_annotations: Any,
                              skip_actions: Any) -> None:
        self.calls.append(("record", enabled, context, stacks, max_entries))
        self.recording = enabled is not None
        self.max_entries = max_entries

    def alloc(self, size: int) -> None:
        """What a tensor allocation does: a block, and a trace entry while recording."""
        self.allocated.append(size)
        if self.recording:
            self.history.append({"action": "alloc", "addr": 0x7F0000000000 + sum(self.allocated), "size": size,
                                 "stream": 0, "time_us": len(self.history), "frames": frames("leaky")})
            del self.history[: max(0, len(self.history) - self.max_entries)]

    def memory_snapshot(self, arg: Any) -> dict[str, Any]:
        self.calls.append(("snapshot", arg))
        return snapshot_of(self.allocated, self.history)

    def attach_oom_observer(self, observer: Any) -> None:
        self.observers.append(observer)

    def raise_oom(self, size: int, device_free: int = 300 * MiB) -> None:
        """What the caching allocator does on OOM: call the observers, then raise."""
        if self.recording:
            self.history.append({"action": "oom", "size": size, "stream": 0, "device_free": device_free,
                                 "frames": frames("forward")})
        for observer in self.observers:
            observer(0, size, sum(self.allocated), device_free)
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size / 2**30:.2f} GiB.")


@contextlib.contextmanager
def fake_allocator_history(monkeypatch: Any) -> Iterator[FakeAllocatorHistory]:
    fake = FakeAllocatorHistory()
    monkeypatch.setattr(torch._C, "_cuda_record_memory_history", fake.record_memory_history, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_memorySnapshot", fake.memory_snapshot, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", fake.attach_oom_observer, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    yield fake
