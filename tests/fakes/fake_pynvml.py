"""A fake ``pynvml`` (nvidia-ml-py) module: the same names, a scripted machine behind them.

Build one with :func:`make_pynvml` and hand it to ``open_device(..., pynvml=fake)`` or put
it in ``sys.modules["pynvml"]``. Every call is counted in ``fake.calls``.

Honesty: every public name defined here exists in the real ``nvidia-ml-py`` with a
compatible signature, and errors behave like its ``NVMLError`` (``NVMLError(15)`` *is* an
``NVMLError_GpuIsLost`` with ``.value == 15``); ``tests/hook/test_probes.py`` checks both
against the installed package. Strings come back as ``str`` (the real bindings decode).
"""

from __future__ import annotations

import functools
import threading
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

GiB = 1024**3


NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999
NVML_DEVICE_MIG_ENABLE = 1


class NVMLError(Exception):
    """Like nvidia-ml-py's: ``NVMLError(value)`` returns the subclass registered for ``value``."""

    _valClassMapping: dict[int, type] = {}

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return f"NVML error {self.value}"


def _subclass(name: str, value: int) -> type:
    cls = type(name, (NVMLError,), {"__new__": lambda c, v=value: NVMLError.__new__(c, v)})
    NVMLError._valClassMapping[value] = cls
    return cls


NVMLError_NotSupported = _subclass("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NotFound = _subclass("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_DriverNotLoaded = _subclass("NVMLError_DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_GpuIsLost = _subclass("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H200"
    total: int = 143_771 * 2**20  # nvidia-smi: 143771 MiB
    used: int = 10 * GiB
    processes: dict[int, int | None] = field(default_factory=dict)  # pid -> usedGpuMemory (compute)
    graphics: dict[int, int | None] = field(default_factory=dict)  # pid -> usedGpuMemory (graphics)
    mig: list[FakeGpu] = field(default_factory=list)
    lost: bool = False
    process_list_supported: bool = True


def make_pynvml(gpus: list[FakeGpu], *, init_fails: bool = False) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.calls = Counter()  # type: ignore[attr-defined]
    nv.callers = Counter()  # type: ignore[attr-defined]  # (function, thread name)
    nv.gpus = gpus  # type: ignore[attr-defined]
    for name in PUBLIC_CONSTANTS:
        setattr(nv, name, globals()[name])

    def counted(fn: Any) -> Any:
        @functools.wraps(fn)  # keeps the signature: the contract test compares it with nvidia-ml-py's
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nv.calls[fn.__name__] += 1  # type: ignore[attr-defined]
            nv.callers[(fn.__name__, threading.current_thread().name)] += 1  # type: ignore[attr-defined]
            return fn(*args, **kwargs)

        setattr(nv, fn.__name__, wrapper)
        return wrapper

    def check(gpu: FakeGpu) -> FakeGpu:
        if gpu.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return gpu

    @counted
    def nvmlInit() -> None:
        if init_fails:
            raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)

    @counted
    def nvmlShutdown() -> None:
        pass

    @counted
    def nvmlDeviceGetCount() -> int:
        return len(gpus)

    @counted
    def nvmlDeviceGetHandleByIndex(index: int) -> FakeGpu:
        if not 0 <= index < len(gpus):
            raise NVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT
        return gpus[index]

    @counted
    def nvmlDeviceGetUUID(handle: FakeGpu) -> str:
        return check(handle).uuid

    @counted
    def nvmlDeviceGetName(handle: FakeGpu) -> str:
        return check(handle).name

    @counted
    def nvmlDeviceGetMemoryInfo(handle: FakeGpu, version: int | None = None) -> Any:
        gpu = check(handle)
        return types.SimpleNamespace(total=gpu.total, used=gpu.used, free=gpu.total - gpu.used)

    @counted
    def nvmlDeviceGetIndex(handle: FakeGpu) -> int:
        if handle not in gpus:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # a MIG device handle has no index of its own
        return gpus.index(check(handle))

    @counted
    def nvmlDeviceGetComputeRunningProcesses(handle: FakeGpu) -> list[Any]:
        gpu = check(handle)
        if not gpu.process_list_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return [process_info(pid, used) for pid, used in gpu.processes.items()]

    @counted
    def nvmlDeviceGetGraphicsRunningProcesses(handle: FakeGpu) -> list[Any]:
        gpu = check(handle)
        return [process_info(pid, used) for pid, used in gpu.graphics.items()]

    @counted
    def nvmlDeviceGetMigMode(device: FakeGpu) -> list[int]:
        if not device.mig:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return [NVML_DEVICE_MIG_ENABLE, NVML_DEVICE_MIG_ENABLE]

    @counted
    def nvmlDeviceGetMaxMigDeviceCount(device: FakeGpu) -> int:
        return 7

    @counted
    def nvmlDeviceGetMigDeviceHandleByIndex(device: FakeGpu, index: int) -> FakeGpu:
        if index >= len(device.mig):
            raise NVMLError(NVML_ERROR_NOT_FOUND)  # an empty slot
        return device.mig[index]

    return nv


#: the attributes of nvidia-ml-py's process entries (its ``c_nvmlProcessInfo_t`` fields, through
#: ``nvmlStructToFriendlyObject``); the contract test compares them with the real structure's
PROCESS_INFO_FIELDS = ("pid", "usedGpuMemory", "gpuInstanceId", "computeInstanceId")


def process_info(pid: int, used: int | None) -> Any:
    """One entry as nvidia-ml-py returns it (``usedGpuMemory`` None where NVML cannot say, WDDM)."""
    values = {"pid": pid, "usedGpuMemory": used, "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF}
    return types.SimpleNamespace(**{name: values[name] for name in PROCESS_INFO_FIELDS})


PUBLIC_CONSTANTS = ("NVMLError", "NVMLError_NotSupported", "NVMLError_NotFound", "NVMLError_DriverNotLoaded",
                    "NVMLError_GpuIsLost", "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NOT_FOUND",
                    "NVML_ERROR_DRIVER_NOT_LOADED", "NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_UNKNOWN",
                    "NVML_DEVICE_MIG_ENABLE")
