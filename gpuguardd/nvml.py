"""NVML through the real pynvml: GPU inventory, memory, and the driver's process lists.

NVML may be missing (no driver, a container without the library), may fail per GPU (fell off
the bus) or per call. None of that is fatal: the snapshot says what is unknown, and the engine
keeps working from device files.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

try:
    import pynvml
except ImportError:  # nvidia-ml-py is not packaged everywhere (Debian main lacks it)
    pynvml = None

from .models import GpuInfo, NvmlSnapshot

PYNVML_MISSING = "NVML: the Python module pynvml (package nvidia-ml-py) is not installed"

_PROCESS_LISTS = ("nvmlDeviceGetComputeRunningProcesses",
                  "nvmlDeviceGetGraphicsRunningProcesses",
                  "nvmlDeviceGetMPSComputeRunningProcesses")


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, pynvml.NVMLError):
        return f"NVML: {exc}"
    return f"NVML: {exc.__class__.__name__}: {exc}"


class Nvml:
    """A lazily initialised NVML session, safe to share between threads.

    Initialisation is retried on each snapshot while it fails, so a daemon started before the
    driver was loaded picks NVML up later without a restart.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._initialized = False
        self._identity: dict[int, tuple[str, str, int | None, str]] = {}
        self.last_error = ""

    def _ensure_init(self) -> bool:
        if self._initialized:
            return True
        if pynvml is None:
            self.last_error = PYNVML_MISSING
            return False
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as exc:
            self.last_error = _error_text(exc)
            return False
        self._initialized = True
        self._identity.clear()
        self.last_error = ""
        return True

    def shutdown(self) -> None:
        with self._lock:
            if self._initialized and pynvml is not None:
                try:
                    pynvml.nvmlShutdown()
                except pynvml.NVMLError:
                    pass
                self._initialized = False

    def snapshot(self, with_processes: bool = True) -> NvmlSnapshot:
        with self._lock:
            if not self._ensure_init():
                return NvmlSnapshot(available=False, error=self.last_error)
            try:
                driver = _text(pynvml.nvmlSystemGetDriverVersion())
                count = pynvml.nvmlDeviceGetCount()
            except pynvml.NVMLError as exc:
                # The driver went away under us (unloaded, reset): start over next time.
                self._initialized = False
                try:
                    pynvml.nvmlShutdown()
                except pynvml.NVMLError:
                    pass
                self.last_error = _error_text(exc)
                return NvmlSnapshot(available=False, error=self.last_error)
            gpus = [self._gpu(index, with_processes) for index in range(count)]
            return NvmlSnapshot(available=True, driver_version=driver, gpus=gpus)

    def _gpu(self, index: int, with_processes: bool) -> GpuInfo:
        gpu = GpuInfo(index=index)
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as exc:
            gpu.error = _error_text(exc)
            gpu.lost = isinstance(exc, pynvml.NVMLError_GpuIsLost)
            return gpu

        def query(call: Callable[[], Any]) -> Any | None:
            try:
                return call()
            except pynvml.NVMLError as exc:
                if isinstance(exc, pynvml.NVMLError_GpuIsLost):
                    gpu.lost = True
                if not gpu.error:
                    gpu.error = _error_text(exc)
                return None

        identity = self._identity.get(index)
        if identity is None:
            uuid = query(lambda: pynvml.nvmlDeviceGetUUID(handle))
            name = query(lambda: pynvml.nvmlDeviceGetName(handle))
            minor = query(lambda: pynvml.nvmlDeviceGetMinorNumber(handle))
            pci = query(lambda: pynvml.nvmlDeviceGetPciInfo_v3(handle))
            identity = (_text(uuid) if uuid is not None else "",
                        _text(name) if name is not None else "",
                        int(minor) if minor is not None else None,
                        _text(pci.busId) if pci is not None else "")
            # NVML numbers devices once per initialisation, so what a GPU is does not change
            # until the next nvmlInit: read it once instead of on every poll.
            if None not in (uuid, name, minor, pci):
                self._identity[index] = identity
        gpu.uuid, gpu.name, gpu.minor, gpu.pci_bus_id = identity
        memory = query(lambda: self._memory(handle))
        if memory is not None:
            gpu.memory_total, gpu.memory_used = memory
        if with_processes and not gpu.lost:
            gpu.processes = self._processes(handle, gpu)
        return gpu

    @staticmethod
    def _memory(handle: Any) -> tuple[int, int]:
        # v2 excludes the driver's reserved memory from "used", which is what "released" means.
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        except pynvml.NVMLError_FunctionNotFound:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.total), int(info.used)

    @staticmethod
    def _processes(handle: Any, gpu: GpuInfo) -> dict[int, int | None]:
        found: dict[int, int | None] = {}
        for name in _PROCESS_LISTS:
            try:
                try:
                    listed: list[Any] = getattr(pynvml, name + "_v3")(handle)
                except pynvml.NVMLError_FunctionNotFound:
                    # Drivers before 510 only have the v2 structures.
                    listed = getattr(pynvml, name + "_v2")(handle)
            except pynvml.NVMLError as exc:
                if not isinstance(exc, pynvml.NVMLError_NotSupported) and not gpu.error:
                    gpu.error = _error_text(exc)
                continue
            for proc in listed:
                used = proc.usedGpuMemory
                pid = int(proc.pid)
                previous = found.get(pid)
                if used is None:
                    found.setdefault(pid, None)
                else:
                    found[pid] = (previous or 0) + int(used)
        return found
