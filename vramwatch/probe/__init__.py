"""Probes: where a sample's memory numbers come from.

* ``torch``: :class:`~vramwatch.probe.torch_cuda.TorchCudaProbe`, one
  ``torch.cuda.memory_stats()`` per step, NVML polled on a background thread;
* ``simulated``: :class:`~vramwatch.probe.simulated.SimulatedProbe`, a scenario-driven
  allocator simulator for the demo, tests and benchmarks;
* ``none``: no probe, the monitor is a no-op;
* ``auto`` (default): ``torch`` when a CUDA device is visible, else one clear warning and
  ``none``; never zeros reported as if they were measurements.

``VRAMWATCH_PROBE`` (``auto``/``torch``/``simulated``/``none``) chooses when ``init()``
is not given ``probe=``; ``VRAMWATCH_SIM_SCENARIO`` / ``VRAMWATCH_SIM_SEED`` configure the
simulator.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Protocol, runtime_checkable

PROBE_NAMES = ("auto", "torch", "simulated", "none")


@runtime_checkable
class Probe(Protocol):
    name: str

    def device_info(self) -> dict[str, Any]:
        """uuid, gpu, total_bytes, name, allocator (those that are known)."""
        ...

    def read(self, step: int, phase: str) -> dict[str, Any]:
        """allocated_bytes, reserved_bytes, peak_allocated_bytes (since the previous read),
        active_bytes, inactive_split_bytes, alloc_retries, ooms, total_bytes,
        nvml_used_bytes (int | None), process_used_bytes (optional)."""
        ...

    def close(self) -> None: ...


class NoProbeWarning(UserWarning):
    """Monitoring is off in this process (no CUDA device, or the probe failed to start)."""


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, NoProbeWarning, stacklevel=3)


def make_probe(
    spec: str | Probe | None = "auto",
    *,
    device: int | None = None,
    rank: int = 0,
    local_rank: int | None = None,
    peak: str = "reset",
    nvml_interval_s: float = 1.0,
    scenario: str | None = None,
    **simulated_params: Any,
) -> Probe | None:
    """Build the probe named by ``spec`` (or return a Probe instance unchanged).

    Returns ``None`` (and warns once) when no real measurement is possible: the caller
    becomes a no-op rather than inventing numbers. Raises ``ValueError`` for an unknown name.
    """
    if spec is None:
        spec = os.environ.get("VRAMWATCH_PROBE", "").strip().lower() or "auto"
    if not isinstance(spec, str):
        if not all(hasattr(spec, attr) for attr in ("read", "device_info")):
            raise ValueError(f"probe: must be one of {', '.join(PROBE_NAMES)} or a Probe, got {spec!r}")
        return spec
    name = spec.strip().lower()
    if name not in PROBE_NAMES:
        raise ValueError(f"probe: must be one of {', '.join(PROBE_NAMES)} or a Probe, got {spec!r}")
    if name == "none":
        return None
    if name == "simulated":
        from .simulated import probe_from_env

        # VRAMWATCH_SIM_SCENARIO / VRAMWATCH_SIM_SEED choose the scenario when set
        if scenario is not None:
            simulated_params["scenario"] = scenario
        return probe_from_env(rank=rank, local_rank=local_rank, **simulated_params)
    from .torch_cuda import NoCudaError, TorchCudaProbe

    try:
        return TorchCudaProbe(device, peak=peak, nvml_interval_s=nvml_interval_s)
    except NoCudaError as exc:
        warn_once("no-cuda", f"vramwatch: {exc}; GPU-memory monitoring is off in this process "
                             "(probe='simulated' or VRAMWATCH_PROBE=simulated runs the simulator instead)")
        return None


__all__ = ["PROBE_NAMES", "NoProbeWarning", "Probe", "make_probe", "warn_once"]
