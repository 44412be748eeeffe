"""The probe protocol, its no-op base and the one warning channel every probe shares."""

from __future__ import annotations

import warnings
from typing import Any, Protocol, runtime_checkable

PROBE_NAMES = ("auto", "torch", "simulated", "none")


@runtime_checkable
class Probe(Protocol):
    """What the hook needs from a probe. :class:`BaseProbe` implements it with no-op defaults."""

    name: str

    def device_info(self) -> dict[str, Any]:
        """uuid, gpu, total_bytes, name, allocator (those that are known). Called once."""
        ...

    def read(self, step: int, phase: str) -> dict[str, Any]:
        """allocated_bytes, reserved_bytes, peak_allocated_bytes (since the previous read),
        active_bytes, inactive_split_bytes, alloc_retries, ooms, total_bytes,
        nvml_used_bytes (int | None), process_used_bytes (optional). Hot path: every step."""
        ...

    def begin_phase(self, name: str) -> None:
        """A phase (checkpoint, eval) starts: close the interval before it."""
        ...

    def end_phase(self, step: int, name: str) -> dict[str, Any]:
        """The phase ended: a reading whose peak is the phase's."""
        ...

    @property
    def max_allocated_bytes(self) -> int | None:
        """Run-long peak of allocated bytes, or None when the probe cannot tell."""
        ...

    def stats(self) -> dict[str, Any]:
        """The probe's own counters (merged into ``Monitor.stats()``)."""
        ...

    def pinned_host_bytes(self) -> int | None:
        """Host memory pinned by the framework (None: unknown). Called off the training thread."""
        ...

    def close(self) -> None: ...


class BaseProbe:
    """The :class:`Probe` protocol with no-op defaults: subclasses override what they know."""

    name = "base"

    def device_info(self) -> dict[str, Any]:
        return {}

    def read(self, step: int, phase: str = "train") -> dict[str, Any]:
        raise NotImplementedError

    def begin_phase(self, name: str) -> None:
        return None

    def end_phase(self, step: int, name: str) -> dict[str, Any]:
        return self.read(step, name)  # without windows: the phase sample is one more read

    @property
    def max_allocated_bytes(self) -> int | None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def pinned_host_bytes(self) -> int | None:
        return None

    def close(self) -> None:
        return None


class _Adapted(BaseProbe):
    """A user's probe object with only some of the protocol: the rest are the defaults."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = str(getattr(inner, "name", type(inner).__name__))
        self.read = inner.read  # type: ignore[method-assign]  # bound once: no lookups per step
        self.device_info = inner.device_info  # type: ignore[method-assign]
        for method in ("begin_phase", "end_phase", "stats", "close"):
            own = getattr(inner, method, None)
            if callable(own):
                setattr(self, method, own)

    @property
    def max_allocated_bytes(self) -> int | None:
        value = getattr(self.inner, "max_allocated_bytes", None)
        return int(value) if isinstance(value, int) else None

    def __getattr__(self, name: str) -> Any:
        # anything else is the user's probe's own (monitor.probe.whatever keeps working)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def as_probe(obj: Any) -> BaseProbe:
    """``obj`` itself when it is a :class:`BaseProbe`, else wrapped so every method exists.

    Raises ``ValueError`` when ``obj`` has no ``read``/``device_info``.
    """
    if isinstance(obj, BaseProbe):
        return obj
    if not all(callable(getattr(obj, attr, None)) for attr in ("read", "device_info")):
        raise ValueError(f"probe: must be one of {', '.join(PROBE_NAMES)} or a Probe, got {obj!r}")
    return _Adapted(obj)


class NoProbeWarning(UserWarning):
    """Monitoring is off in this process (no CUDA device, or the probe failed to start)."""


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, NoProbeWarning, stacklevel=3)
