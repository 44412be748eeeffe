"""Thin seam over torch's allocator history and snapshot API (CUDA only).

Everything goes through torch's own Python functions (``torch.cuda.memory._record_memory_history``,
``torch.cuda.memory._snapshot``) and one C++ entry point for the OOM observer
(``torch._C._cuda_attach_out_of_memory_observer``); tests replace only the C++ entry points
(``_cuda_record_memory_history``, ``_cuda_memorySnapshot``, the observer) with fakes of the
real signatures (``tests/fakes/fake_snapshot.py``).

Costs (field notes; measured by ``bench/gpu_check`` on a device): recording with
``context="alloc", stacks="python"`` adds ~2 µs per allocation; ``_snapshot()`` is ~0.2 ms
without traces and up to ~0.7 s with 100k history entries, which is why ``max_entries``
is bounded (default 20,000) and a capture records only a few steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

OomObserver = Callable[[int, int, int, int], None]  # (device, alloc, device_allocated, device_free)


def _torch() -> Any:
    import torch  # imported lazily: the collector and CPU-only users never pay for it

    return torch


class AllocatorHistory:
    """Start/stop allocator history, take a snapshot, attach an OOM observer. Never raises on
    an unsupported build: :meth:`supported` says whether it can work."""

    def __init__(self, device: int | None = None, *, max_entries: int = 20_000, context: str = "alloc",
                 stacks: str = "python") -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries: must be positive, got {max_entries}")
        self.device = device
        self.max_entries = max_entries
        self.context = context
        self.stacks = stacks
        self.recording = False

    @staticmethod
    def supported() -> bool:
        """CUDA present and this torch has the history API."""
        try:
            torch = _torch()
            memory = torch.cuda.memory
            return bool(torch.cuda.is_available()) and callable(getattr(memory, "_record_memory_history", None))
        except Exception:
            return False

    def start(self) -> None:
        _torch().cuda.memory._record_memory_history(
            enabled="all", context=self.context, stacks=self.stacks, max_entries=self.max_entries,
            device=self.device,
        )
        self.recording = True

    def stop(self) -> None:
        if self.recording:
            self.recording = False
            _torch().cuda.memory._record_memory_history(enabled=None, device=self.device)

    def snapshot(self) -> dict[str, Any]:
        """``torch.cuda.memory._snapshot()``: segments, blocks, history (the memory_viz format)."""
        return _torch().cuda.memory._snapshot(self.device)

    @staticmethod
    def attach_oom_observer(observer: OomObserver) -> bool:
        """Register ``observer`` to run just before torch raises an OOM; False if unavailable."""
        attach = getattr(_torch()._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            return False
        attach(observer)
        return True
