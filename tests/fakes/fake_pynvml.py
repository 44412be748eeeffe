"""A fake ``pynvml`` (nvidia-ml-py) module: the same names, a scripted machine behind them.

Build one with :func:`make_pynvml` and hand it to ``open_device(..., pynvml=fake)`` or put
it in ``sys.modules["pynvml"]``. Every call is counted in ``fake.calls``.
"""

from __future__ import annotations

import threading
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

GiB = 1024**3


class NVMLError(Exception):
    def __init__(self, value: int = 999) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class NVMLError_GPUIsLost(NVMLError):
    def __init__(self) -> None:
        super().__init__(15)


class NVMLError_NotSupported(NVMLError):
    def __init__(self) -> None:
        super().__init__(3)


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H200"
    total: int = 143_771_009_024
    used: int = 10 * GiB
    processes: dict[int, int | None] = field(default_factory=dict)  # pid -> usedGpuMemory
    mig: list[FakeGpu] = field(default_factory=list)
    lost: bool = False
    process_list_supported: bool = True


def make_pynvml(gpus: list[FakeGpu], *, init_fails: bool = False) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.calls = Counter()  # type: ignore[attr-defined]
    nv.callers = Counter()  # type: ignore[attr-defined]  # (function, thread name)
    nv.gpus = gpus  # type: ignore[attr-defined]
    nv.NVMLError = NVMLError  # type: ignore[attr-defined]
    nv.NVMLError_GPUIsLost = NVMLError_GPUIsLost  # type: ignore[attr-defined]
    nv.NVMLError_NotSupported = NVMLError_NotSupported  # type: ignore[attr-defined]
    nv.NVML_ERROR_GPU_IS_LOST = 15  # type: ignore[attr-defined]
    nv.NVML_DEVICE_MIG_ENABLE = 1  # type: ignore[attr-defined]

    def counted(fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            nv.calls[fn.__name__] += 1  # type: ignore[attr-defined]
            nv.callers[(fn.__name__, threading.current_thread().name)] += 1  # type: ignore[attr-defined]
            return fn(*args)

        wrapper.__name__ = fn.__name__
        setattr(nv, fn.__name__, wrapper)
        return wrapper

    def check(gpu: FakeGpu) -> FakeGpu:
        if gpu.lost:
            raise NVMLError_GPUIsLost()
        return gpu

    @counted
    def nvmlInit() -> None:
        if init_fails:
            raise NVMLError(9)  # NVML_ERROR_DRIVER_NOT_LOADED

    @counted
    def nvmlShutdown() -> None:
        pass

    @counted
    def nvmlDeviceGetCount() -> int:
        return len(gpus)

    @counted
    def nvmlDeviceGetHandleByIndex(index: int) -> FakeGpu:
        if not 0 <= index < len(gpus):
            raise NVMLError(2)
        return gpus[index]

    @counted
    def nvmlDeviceGetUUID(handle: FakeGpu) -> str:
        return check(handle).uuid

    @counted
    def nvmlDeviceGetName(handle: FakeGpu) -> bytes:
        return check(handle).name.encode()  # older bindings return bytes

    @counted
    def nvmlDeviceGetMemoryInfo(handle: FakeGpu) -> Any:
        gpu = check(handle)
        return types.SimpleNamespace(total=gpu.total, used=gpu.used, free=gpu.total - gpu.used)

    @counted
    def nvmlDeviceGetComputeRunningProcesses(handle: FakeGpu) -> list[Any]:
        gpu = check(handle)
        if not gpu.process_list_supported:
            raise NVMLError_NotSupported()
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in gpu.processes.items()]

    @counted
    def nvmlDeviceGetMigMode(handle: FakeGpu) -> tuple[int, int]:
        if not handle.mig:
            raise NVMLError_NotSupported()
        return (1, 1)

    @counted
    def nvmlDeviceGetMaxMigDeviceCount(handle: FakeGpu) -> int:
        return 7

    @counted
    def nvmlDeviceGetMigDeviceHandleByIndex(handle: FakeGpu, index: int) -> FakeGpu:
        if index >= len(handle.mig):
            raise NVMLError(13)  # NVML_ERROR_NOT_FOUND: empty slot
        return handle.mig[index]

    return nv
