"""Fake C++ entry points for torch's allocator history, snapshot and OOM observer.

Only ``torch._C`` functions are replaced; ``torch.cuda.memory._record_memory_history`` and
``_snapshot`` run as torch's own Python code. Names and argument lists are torch 2.13's
(``torch/cuda/memory.py``: ``_record_memory_history_impl`` passes 8 positional arguments to
``_C._cuda_record_memory_history``; ``_snapshot`` calls ``_C._cuda_memorySnapshot(None)``;
``torch/_dynamo/trace_rules.py`` lists ``torch._C._cuda_attach_out_of_memory_observer``).
The snapshot follows the ``Snapshot``/``Segment``/``Block``/``TraceEntry`` TypedDicts in
``torch.cuda.memory._snapshot``'s docstring; ``tests/evidence/test_evidence.py`` checks both contracts.
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


# ---------------------------------------------------------------- snapshots with allocation sites
#: where torch lives in a typical installation (frames from it are never an allocation site)
TORCH_DIR = "/opt/venv/lib/python3.11/site-packages/torch"


def frame(filename: str, line: int, name: str) -> dict[str, Any]:
    """One ``Frame`` (``{filename, line, name}``), as torch's ``py_symbolize`` writes it."""
    return {"filename": filename, "line": line, "name": name}


def user_stack(filename: str, line: int, name: str, *outer: dict[str, Any]) -> list[dict[str, Any]]:
    """A realistic Python stack, innermost first: torch's module call machinery, then the user's
    line, then whatever called it (``outer``), then the interpreter's entry."""
    return [frame(f"{TORCH_DIR}/nn/modules/linear.py", 125, "forward"),
            frame(f"{TORCH_DIR}/nn/modules/module.py", 1751, "_call_impl"),
            frame(f"{TORCH_DIR}/nn/modules/module.py", 1740, "_wrapped_call_impl"),
            frame(filename, line, name), *outer,
            frame("/home/op/proj/train.py", 210, "main"), frame("<frozen runpy>", 88, "_run_code")]


@dataclass
class Alloc:
    """One block to lay out: ``size`` bytes (``requested`` what the caller asked, default the size)."""

    size: int
    frames: list[dict[str, Any]]
    state: str = "active_allocated"
    requested: int | None = None


def build_snapshot(allocs: list[Alloc], *, segment_bytes: int = 64 * MiB, cached_bytes: int = 0,
                   base: int = 0x7F0000000000, history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A snapshot in torch's documented shape holding ``allocs`` in order, packed into segments of
    ``segment_bytes`` (a segment's unused tail is an ``inactive`` block, so every segment's blocks
    add up to its ``total_size`` as the allocator's do), plus ``cached_bytes`` of wholly
    inactive segments. Same allocations in the same order give the same segment addresses, so
    growth inside kept segments is what two such snapshots show."""
    segments: list[dict[str, Any]] = []
    current: list[dict[str, Any]] = []
    used = 0

    def close(total: int) -> None:
        nonlocal current, used
        if used < total:
            current.append({"size": total - used, "requested_size": 0, "state": "inactive", "frames": []})
        segments.append(_segment(base + sum(s["total_size"] for s in segments), total, current))
        current, used = [], 0

    for a in allocs:
        if current and used + a.size > segment_bytes:
            close(segment_bytes)
        current.append({"size": a.size, "requested_size": a.size if a.requested is None else a.requested,
                        "state": a.state, "frames": a.frames})
        used += a.size
    if current:
        close(max(segment_bytes, used))
    if cached_bytes:
        current = []
        close(cached_bytes)
    return {"segments": segments, "device_traces": [list(history or [])],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}


def _segment(address: int, total: int, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    at = address
    for b in blocks:
        b["address"] = at
        at += b["size"]
    allocated = [b for b in blocks if b["state"] == "active_allocated"]
    active = [b for b in blocks if b["state"] != "inactive"]
    return {"address": address, "total_size": total, "stream": 0,
            "segment_type": "large" if total > MiB else "small", "segment_pool_id": (0, 0),
            "allocated_size": sum(b["requested_size"] for b in allocated),
            "active_size": sum(b["size"] for b in active),
            "requested_size": sum(b["requested_size"] for b in allocated), "device": 0, "is_expandable": False,
            "frames": [], "blocks": blocks}
