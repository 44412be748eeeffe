"""Probes: where a sample's memory numbers come from.

* ``torch``: :class:`~vramwatch.probe.torch_cuda.TorchCudaProbe`, one
  ``torch.cuda.memory_stats_as_nested_dict()`` per step plus NVML numbers from a background
  poller (real GPUs);
* ``simulated``: :class:`~vramwatch.probe.simulated.SimulatedProbe`, a scenario-driven
  allocator simulator for the demo, tests and benchmarks;
* ``none``: no probe, the monitor is a no-op;
* ``auto`` (default): ``torch`` when a CUDA device is visible, else one clear warning and
  ``none``; never zeros reported as if they were measurements.

Every probe is a :class:`BaseProbe` (the complete protocol, with no-op defaults), so the
hook calls its methods directly. An object that only has ``read``/``device_info`` (a
user's own probe) is wrapped once by :func:`as_probe`.

:class:`vramwatch.config.Config` chooses the probe (``VRAMWATCH_PROBE``) and the simulator's
scenario (``VRAMWATCH_SIM_SCENARIO`` / ``VRAMWATCH_SIM_SEED``).
"""

from __future__ import annotations

from typing import Any

from vramwatch.probe.base import PROBE_NAMES, BaseProbe, NoProbeWarning, Probe, as_probe, warn_once


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
) -> BaseProbe | None:
    """Build the probe named by ``spec`` (or adopt a Probe instance via :func:`as_probe`).

    ``None`` means the configured default (``VRAMWATCH_PROBE``, else ``auto``). Returns
    ``None`` (and warns once) when no real measurement is possible: the caller becomes a
    no-op rather than inventing numbers. Raises ``ValueError`` for an unknown name.
    """
    if spec is None:
        from vramwatch.config import Config

        spec = Config.from_env().probe
    if not isinstance(spec, str):
        return as_probe(spec)
    name = spec.strip().lower()
    if name not in PROBE_NAMES:
        raise ValueError(f"probe: must be one of {', '.join(PROBE_NAMES)} or a Probe, got {spec!r}")
    if name == "none":
        return None
    if name == "simulated":
        from vramwatch.probe.simulated import probe_from_env

        # VRAMWATCH_SIM_SCENARIO / VRAMWATCH_SIM_SEED choose the scenario when set
        if scenario is not None:
            simulated_params["scenario"] = scenario
        return probe_from_env(rank=rank, local_rank=local_rank, **simulated_params)
    from vramwatch.probe.torch_cuda import NoCudaError, TorchCudaProbe

    try:
        return TorchCudaProbe(device, peak=peak, nvml_interval_s=nvml_interval_s)
    except NoCudaError as exc:
        warn_once("no-cuda", f"vramwatch: {exc}; GPU-memory monitoring is off in this process "
                             "(probe='simulated' or VRAMWATCH_PROBE=simulated runs the simulator instead)")
        return None


__all__ = ["PROBE_NAMES", "BaseProbe", "NoProbeWarning", "Probe", "as_probe", "make_probe", "warn_once"]
