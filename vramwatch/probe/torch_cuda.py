"""Torch CUDA probe: one ``torch.cuda.memory_stats_as_nested_dict(device)`` call per step.

``torch.cuda.memory_stats()`` is that nested dict flattened into dotted keys and sorted, in
Python, on every call: about 8x the cost of the nested read (bench/hook_bench.py measures
both through torch's own code). ``memory_allocated()``, ``memory_reserved()`` and
``max_memory_allocated()`` each go through ``memory_stats()``. So the probe makes exactly
one ``memory_stats_as_nested_dict()`` call per sample (a public API: the allocator's
``DeviceStats`` as dicts built in C++) and picks allocated, reserved, active, inactive
split, ``num_alloc_retries`` and ``num_ooms`` out of it. It never calls ``memory_stats()``
(a test fails if it does). NVML numbers come from a background :class:`NvmlPoller`; the
training thread only reads its latest tuple.

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

Before CUDA is initialised ``memory_stats_as_nested_dict()`` returns ``{}``: the allocator
holds nothing yet, so every byte count is a true 0.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from vramwatch.config import PEAK_POLICIES
from vramwatch.errors import VramwatchError
from vramwatch.probe.base import BaseProbe
from vramwatch.probe.nvml import NvmlPoller, open_device

_NO_POOLS = {"all": {"current": 0, "peak": 0}}


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


class NoCudaError(VramwatchError, RuntimeError):
    """torch is missing, built without CUDA, or sees no device."""

    status = 500


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


class TorchCudaProbe(BaseProbe):
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
        self._nested_stats = self.cuda.memory_stats_as_nested_dict  # never memory_stats(): see above
        self._reset_peak = self.cuda.reset_peak_memory_stats
        self._host_stats = getattr(self.cuda, "host_memory_stats_as_nested_dict", None)  # torch >= 2.6
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
        allocated_stat = self._nested_stats(self.device).get("allocated_bytes", _NO_POOLS)["all"]
        allocated = int(allocated_stat["current"])
        self._max_allocated = int(allocated_stat["peak"])  # run-long, never reset
        self._last_global_peak = self._max_allocated
        self._last_allocated = allocated
        self._carry = allocated  # peak since the previous sample
        self._windows: list[_Window] = []
        if self._reset:
            self._reset_peak(self.device)

    # ------------------------------------------------------------ Probe protocol

    @property
    def max_allocated_bytes(self) -> int:
        return self._max_allocated

    def device_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"gpu": self.device, "total_bytes": self._total, "name": self._name,
                                "allocator": self._allocator}
        if self.nvml_device is not None:
            info["uuid"] = self.nvml_device.uuid
            info["name"] = self.nvml_device.name
            if self.nvml_device.index is not None:
                # the host's numbering (nvidia-smi's, dcgm-exporter's ``gpu``), not torch's index
                # renumbered by CUDA_VISIBLE_DEVICES (torch's is ``local_rank``'s device as a rule)
                info["gpu"] = self.nvml_device.index
        elif self._uuid is not None:
            info["uuid"] = self._uuid if self._uuid[:4] in ("GPU-", "MIG-") else "GPU-" + self._uuid
        return info

    def _interval_peak(self, allocated: int, global_peak: int) -> int:
        """The peak of allocated since the previous read (resets torch's counter under "reset")."""
        if self._reset:
            self._reset_peak(self.device)
            interval = global_peak if global_peak > allocated else allocated
        elif global_peak > self._last_global_peak:
            interval = global_peak  # a new all-time high happened in this interval: exact
        else:
            interval = max(self._last_allocated, allocated)  # lower bound; the true peak is unknown
        if global_peak > self._last_global_peak:
            self._last_global_peak = global_peak
        self._last_allocated = allocated
        if interval > self._max_allocated:
            self._max_allocated = interval
        for window in self._windows:
            if interval > window.peak:
                window.peak = interval
        return interval

    def _read(self) -> tuple[dict[str, Any], int, int]:
        """One nested-stats read: (sample without its peak, allocated, interval peak)."""
        stats = self._nested_stats(self.device)
        if not stats:  # CUDA not initialised yet: the allocator holds nothing
            stats = _EMPTY_STATS
        allocated_stat = stats["allocated_bytes"]["all"]
        allocated = allocated_stat["current"]
        sample: dict[str, Any] = {
            "allocated_bytes": allocated,
            "reserved_bytes": stats["reserved_bytes"]["all"]["current"],
            "peak_allocated_bytes": 0,
            "active_bytes": stats["active_bytes"]["all"]["current"],
            "inactive_split_bytes": stats["inactive_split_bytes"]["all"]["current"],
            "alloc_retries": stats["num_alloc_retries"],
            "ooms": stats["num_ooms"],
            "total_bytes": self._total,
            "nvml_used_bytes": None,
        }
        poller = self.poller
        reading = poller.latest if poller is not None else None
        if reading is not None:
            sample["nvml_used_bytes"] = reading.used_bytes
            # NVML's total is the device capacity it also measures "used" against
            if reading.total_bytes > self._total:
                sample["total_bytes"] = reading.total_bytes
            if reading.process_used_bytes is not None:
                sample["process_used_bytes"] = reading.process_used_bytes
            if reading.foreign_used_bytes is not None:
                sample["foreign_used_bytes"] = reading.foreign_used_bytes
        return sample, allocated, self._interval_peak(allocated, allocated_stat["peak"])

    def read(self, step: int, phase: str = "train") -> dict[str, Any]:
        sample, allocated, interval = self._read()
        carry = self._carry
        sample["peak_allocated_bytes"] = carry if carry > interval else interval
        self._carry = allocated
        return sample

    def begin_phase(self, name: str) -> None:
        _sample, allocated, interval = self._read()
        saved = max(self._carry, interval)  # the gap before the phase goes to the next train sample
        self._windows.append(_Window(allocated, saved))
        self._carry = allocated

    def end_phase(self, step: int, name: str) -> dict[str, Any]:
        sample, allocated, interval = self._read()
        if not self._windows:  # end without begin: the phase covers the time since the previous sample
            sample["peak_allocated_bytes"] = max(self._carry, interval)
            self._carry = allocated
            return sample
        window = self._windows.pop()
        self._carry = max(window.saved_carry, allocated)
        sample["peak_allocated_bytes"] = window.peak
        return sample

    def pinned_host_bytes(self) -> int | None:
        """Bytes held by torch's pinned host allocator (cached + in use), None when torch cannot say.

        Called off the training thread (the host poller) and at phase ends.
        """
        if self._host_stats is None:
            return None
        try:
            stats = self._host_stats()
        except Exception:
            return None
        if not stats:
            return 0  # CUDA not initialised: nothing pinned through torch
        try:
            return int(stats["allocated_bytes"]["current"])
        except (KeyError, TypeError, ValueError):
            return None

    def close(self) -> None:
        if self.poller is not None:
            self.poller.close()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"nvml": self.poller is not None, "peak_policy": self.peak_policy,
                               "max_allocated_bytes": self._max_allocated}
        if self.poller is not None:
            out.update(self.poller.stats())
            latest = self.poller.latest
            if latest is not None:  # who holds this GPU: this process, others (a stale kernel), by PID
                out["gpu_processes"] = [{"pid": p.pid, "used_bytes": p.used_bytes} for p in latest.processes]
                out["foreign_used_bytes"] = latest.foreign_used_bytes
        return out


def _empty_stats() -> dict[str, Any]:
    pools = {"all": {"current": 0, "peak": 0, "allocated": 0, "freed": 0}}
    out: dict[str, Any] = {name: pools for name in ("allocated_bytes", "reserved_bytes", "active_bytes",
                                                    "inactive_split_bytes")}
    out["num_alloc_retries"] = out["num_ooms"] = 0
    return out


_EMPTY_STATS = _empty_stats()


__all__ = ["PEAK_POLICIES", "NoCudaError", "TorchCudaProbe", "load_torch_cuda"]
