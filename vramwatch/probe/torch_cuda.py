"""Torch CUDA probe: one ``torch.cuda.memory_stats(device)`` call per step.

``memory_allocated()``, ``memory_reserved()`` and ``max_memory_allocated()`` each rebuild
the allocator's whole stats dict, so the probe makes exactly one ``memory_stats()`` call
per sample and picks allocated, reserved, active, inactive split, ``num_alloc_retries``
and ``num_ooms`` out of it. NVML numbers come from a background :class:`NvmlPoller`;
the training thread only reads its latest tuple.

Per-step peak policy (``peak=``)
--------------------------------
``peak_allocated_bytes`` in a sample is the highest ``allocated`` since the previous
sample. PyTorch keeps one global peak counter per device (``allocated_bytes.all.peak``,
what ``torch.cuda.max_memory_allocated()`` returns), so there are two honest options:

* ``peak="reset"`` (default): after every read the probe calls
  ``torch.cuda.reset_peak_memory_stats(device)``, so the next read's ``.peak`` is exactly
  the peak of that interval. Side effect: other code that reads
  ``torch.cuda.max_memory_allocated()`` now sees a per-step peak, not a run-long one.
  The probe keeps the run-long maximum itself: ``Monitor.max_memory_allocated()``
  (and ``probe.max_allocated_bytes``) return what ``max_memory_allocated()`` would have.
* ``peak="never"``: the probe never touches the counter. When the global peak rose since
  the previous read, that new peak happened in this interval and is exact; when it did
  not, the interval's true peak is unknown and the probe reports the lower bound
  ``max(allocated at previous read, allocated now)``. Use it when another tool owns
  ``reset_peak_memory_stats`` (DeepSpeed's see_memory_usage, torchtitan's memory monitor).

Phases: :meth:`begin_phase` reads once (closing the interval before the phase, whose
peak is carried into the next train sample) and opens a window; :meth:`end_phase` reads
once more and returns a sample whose peak is the peak *during the phase*. Windows nest.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from .nvml import NvmlPoller, open_device

PEAK_POLICIES = ("reset", "never")

_ALLOCATED = "allocated_bytes.all.current"
_ALLOCATED_PEAK = "allocated_bytes.all.peak"
_RESERVED = "reserved_bytes.all.current"
_ACTIVE = "active_bytes.all.current"
_INACTIVE_SPLIT = "inactive_split_bytes.all.current"


_UUID_RE = re.compile(r"(?:GPU-|MIG-)?[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\Z")


def uuid_text(raw: Any) -> str | None:
    """torch's ``get_device_properties(i).uuid`` as text ('xxxxxxxx-xxxx-...'), or None.

    Depending on the torch version it is a ``str`` or a ``_CUuuid`` whose ``str()`` is the
    uuid and whose ``.bytes`` are its 16 raw bytes; anything else is not trusted.
    """
    if raw is None:
        return None
    text = str(raw).strip()
    if _UUID_RE.match(text):
        return text
    data = getattr(raw, "bytes", None)
    try:
        raw_bytes = bytes(data) if data is not None else b""
    except (TypeError, ValueError):
        raw_bytes = b""
    if len(raw_bytes) == 16:
        return str(uuid.UUID(bytes=raw_bytes))
    return None


class NoCudaError(RuntimeError):
    """torch is missing, built without CUDA, or sees no device."""


def load_torch_cuda() -> ModuleType:
    """The seam: returns ``torch.cuda`` or raises :class:`NoCudaError` saying why."""
    try:
        import torch
    except Exception as exc:
        raise NoCudaError(f"torch is not importable ({exc})") from None
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise NoCudaError(f"no CUDA device: torch {torch.__version__} is {build} and sees no GPU")
    return torch.cuda


class _Window:
    __slots__ = ("peak", "saved_carry")

    def __init__(self, peak: int, saved_carry: int) -> None:
        self.peak = peak
        self.saved_carry = saved_carry


class TorchCudaProbe:
    name = "torch"

    def __init__(
        self,
        device: int | None = None,
        *,
        peak: str = "reset",
        nvml: bool = True,
        nvml_interval_s: float = 1.0,
        cuda: Any = None,
        pynvml: ModuleType | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if peak not in PEAK_POLICIES:
            raise ValueError(f"peak: must be one of {', '.join(PEAK_POLICIES)}, got {peak!r}")
        env = os.environ if env is None else env
        self.cuda = load_torch_cuda() if cuda is None else cuda
        if device is None:
            local = env.get("LOCAL_RANK", "").strip()
            # before torch.cuda.set_device(local_rank), current_device() is 0 on every rank
            device = int(local) if local.isdigit() and int(local) < self.cuda.device_count() else None
            if device is None:
                device = self.cuda.current_device()
        self.device = int(device)
        self.peak_policy = peak
        self._reset = peak == "reset"
        self._memory_stats = self.cuda.memory_stats
        self._reset_peak = self.cuda.reset_peak_memory_stats
        props = self.cuda.get_device_properties(self.device)
        self._uuid = uuid_text(getattr(props, "uuid", None))
        self._total = int(props.total_memory)
        self._name = str(getattr(props, "name", "cuda"))
        try:
            self._allocator = str(self.cuda.memory.get_allocator_backend())
        except Exception:
            self._allocator = "native"
        self.poller: NvmlPoller | None = None
        self.nvml_device = None
        if nvml:
            self.nvml_device = open_device(self.device, torch_uuid=self._uuid, env=env, pynvml=pynvml)
            if self.nvml_device is not None:
                self.poller = NvmlPoller(self.nvml_device, interval_s=nvml_interval_s)
        # peak bookkeeping (see module docstring)
        stats = self._memory_stats(self.device)
        allocated = int(stats.get(_ALLOCATED, 0))
        self.max_allocated_bytes = int(stats.get(_ALLOCATED_PEAK, allocated))  # run-long, never reset
        self._last_global_peak = self.max_allocated_bytes
        self._last_allocated = allocated
        self._carry = allocated  # peak since the previous sample
        self._windows: list[_Window] = []
        if self._reset:
            self._reset_peak(self.device)

    # ------------------------------------------------------------ Probe protocol

    def device_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"gpu": self.device, "total_bytes": self._total, "name": self._name,
                                "allocator": self._allocator}
        if self.nvml_device is not None:
            info["uuid"] = self.nvml_device.uuid
            info["name"] = self.nvml_device.name
        elif self._uuid is not None:
            info["uuid"] = self._uuid if self._uuid[:4] in ("GPU-", "MIG-") else "GPU-" + self._uuid
        return info

    def _interval_peak(self, stats: Mapping[str, Any]) -> tuple[int, int]:
        """(allocated now, peak of allocated since the previous memory_stats() read)."""
        allocated = int(stats.get(_ALLOCATED, 0))
        global_peak = int(stats.get(_ALLOCATED_PEAK, allocated))
        if self._reset:
            self._reset_peak(self.device)
            interval = max(global_peak, allocated)
        elif global_peak > self._last_global_peak:
            interval = global_peak  # a new all-time high happened in this interval: exact
        else:
            interval = max(self._last_allocated, allocated)  # lower bound; the true peak is unknown
        self._last_global_peak = max(self._last_global_peak, global_peak)
        self._last_allocated = allocated
        if interval > self.max_allocated_bytes:
            self.max_allocated_bytes = interval
        for window in self._windows:
            if interval > window.peak:
                window.peak = interval
        return allocated, interval

    def _sample(self, stats: Mapping[str, Any], allocated: int, peak: int) -> dict[str, Any]:
        sample: dict[str, Any] = {
            "allocated_bytes": allocated,
            "reserved_bytes": int(stats.get(_RESERVED, 0)),
            "peak_allocated_bytes": peak,
            "active_bytes": int(stats.get(_ACTIVE, 0)),
            "inactive_split_bytes": int(stats.get(_INACTIVE_SPLIT, 0)),
            "alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "ooms": int(stats.get("num_ooms", 0)),
            "total_bytes": self._total,
            "nvml_used_bytes": None,
        }
        poller = self.poller
        reading = poller.latest if poller is not None else None
        if reading is not None:
            sample["nvml_used_bytes"] = reading.used_bytes
            # NVML's total is the device capacity it also measures "used" against
            sample["total_bytes"] = max(reading.total_bytes, self._total)
            if reading.process_used_bytes is not None:
                sample["process_used_bytes"] = reading.process_used_bytes
        return sample

    def read(self, step: int, phase: str = "train") -> dict[str, Any]:
        stats = self._memory_stats(self.device)
        allocated, interval = self._interval_peak(stats)
        peak = max(self._carry, interval)
        self._carry = allocated
        return self._sample(stats, allocated, peak)

    def begin_phase(self, name: str) -> None:
        stats = self._memory_stats(self.device)
        allocated, interval = self._interval_peak(stats)
        saved = max(self._carry, interval)  # the gap before the phase goes to the next train sample
        self._windows.append(_Window(allocated, saved))
        self._carry = allocated

    def end_phase(self, step: int, name: str) -> dict[str, Any]:
        stats = self._memory_stats(self.device)
        allocated, _interval = self._interval_peak(stats)
        if not self._windows:  # end without begin: the phase covers the time since the previous sample
            peak = max(self._carry, _interval)
            self._carry = allocated
            return self._sample(stats, allocated, peak)
        window = self._windows.pop()
        self._carry = max(window.saved_carry, allocated)
        return self._sample(stats, allocated, window.peak)

    def close(self) -> None:
        if self.poller is not None:
            self.poller.close()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"nvml": self.poller is not None, "peak_policy": self.peak_policy,
                               "max_allocated_bytes": self.max_allocated_bytes}
        if self.poller is not None:
            out.update(self.poller.stats())
        return out


__all__ = ["PEAK_POLICIES", "NoCudaError", "TorchCudaProbe", "load_torch_cuda"]
