"""NVML through the real pynvml: GPU inventory, memory, and the driver's process lists.

NVML may be missing, may fail per GPU (GPU_IS_LOST, UNKNOWN, NO_PERMISSION) or per call, and
may hang for good: the snapshot says what is unknown. Every NVML call runs on the session's
worker thread (nvmlworker.py) with a deadline, so a hung driver costs a caller at most that.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

try:
    import pynvml
except ImportError:  # nvidia-ml-py is not packaged everywhere (Debian main lacks it)
    pynvml = None

from gpuguardd.engine import driverinfo, nvmlprocs
from gpuguardd.engine.nvmlworker import NvmlHung, NvmlWorker
from gpuguardd.records.models import GpuInfo, MigInstance, NvmlSnapshot

_SHUTDOWN_TIMEOUT_SEC = 1.0


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _error_text(exc: BaseException) -> str:
    return f"NVML: {exc}" if isinstance(exc, pynvml.NVMLError) else f"NVML: {exc.__class__.__name__}: {exc}"


def _note(gpu: GpuInfo | MigInstance, exc: BaseException) -> None:
    gpu.error = gpu.error or _error_text(exc)


def _unsupported(exc: BaseException) -> bool:
    return isinstance(exc, (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound))


class NvmlCallFailed(Exception):
    """An NVML call of device_call failed; `unsupported`: the GPU or driver lacks it."""

    def __init__(self, message: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.unsupported = unsupported


class _Progress:
    """How far a snapshot job got, read by the caller when the job does not return in time."""

    def __init__(self) -> None:
        self.done: list[GpuInfo] = []
        self.gpu: int | None = None
        self.call = "nvmlInit"

    def __str__(self) -> str:
        # What NvmlHung names: the pynvml function entered last, and the GPU it was for.
        return self.call + (f" (GPU {self.gpu})" if self.gpu is not None else "")


# The snapshot job running on this thread (a worker), if any: where each entry point is named.
_job = threading.local()


def _named(name: str) -> Any:
    """pynvml looks every C function up by name right before calling it: wrapping that lookup
    names a hang's entry point without wrapping every call site (a profile hook cost ~15 ms a poll)."""
    progress = getattr(_job, "progress", None)
    if progress is not None:
        progress.call = str(name)[:128]
    return _lookup(name)


if pynvml is not None:
    _lookup = pynvml._nvmlGetFunctionPointer
    pynvml._nvmlGetFunctionPointer = _named


class Nvml:
    """A lazily initialised NVML session, safe to share between threads: initialisation is
    retried on each call while it fails, so a daemon started before the driver picks it up."""

    def __init__(self, timeout: Callable[[], float], sysfs: Callable[[], str],
                 driver_gpus_dir: str = driverinfo.DRIVER_GPUS_DIR) -> None:
        self._lock = threading.Lock()
        self._initialized = False
        self._identity: dict[int, tuple[str, str, int | None, str]] = {}
        self._seen: dict[int, GpuInfo] = {}  # each GPU as last read whole: what one unreadable now was
        self.last_error = ""
        self._timeout = timeout  # seconds one snapshot may take before the driver counts as hung
        self._worker = NvmlWorker()
        # Minors of GPUs NVML cannot identify, read on a worker of its own: the nvidia module
        # answers /proc/driver/nvidia/gpus under its own locks.
        self._driver_gpus_dir = driver_gpus_dir
        self._driver_worker = NvmlWorker("gpuguard-nvidia-procfs")
        self._driver_gpus: list[driverinfo.DriverGpu] | None = None
        # The last GPU count and driver NVML gave: what a hung snapshot still knows.
        self._last_count: int | None = None
        self._last_driver = ""
        self._paused = ""  # why NVML is closed for a GPU reset (pause()); "" while it is not
        self._sysfs = sysfs  # where runtime PM is read ([Devices] SysfsPath): a GPU asleep is not asked
        self._released = False  # closed as every GPU slept: what was seen of them still holds

    def _ensure_init(self) -> bool:
        if self._initialized:
            return True
        if pynvml is None:
            self.last_error = "NVML: the Python module pynvml (package nvidia-ml-py) is not installed"
            return False
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as exc:
            self.last_error = _error_text(exc)
            return False
        self._initialized = True
        self._identity.clear()
        if not self._released:
            self._seen.clear()
        self._released = False
        self.last_error = ""
        return True

    def _close(self) -> None:  # the caller holds the lock
        if self._initialized:
            self._initialized = False
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()

    def shutdown(self) -> None:
        def job() -> None:
            with self._lock:
                self._close()
        with contextlib.suppress(NvmlHung):  # exiting anyway: the process takes the stuck call with it
            self._worker.run(job, _SHUTDOWN_TIMEOUT_SEC, "nvmlShutdown")

    def device_call(self, index: int, call: Callable[[Any], Any], what: str) -> Any:
        """`call(handle)` for GPU `index` on the worker thread, within the timeout."""
        def job() -> Any:
            with self._lock:
                if not self._ensure_init():
                    raise NvmlCallFailed(self.last_error)
                try:
                    return call(pynvml.nvmlDeviceGetHandleByIndex(index))
                except pynvml.NVMLError as exc:
                    raise NvmlCallFailed(_error_text(exc), _unsupported(exc)) from None
        return self._worker.run(job, self._timeout(), what)

    def pause(self, reason: str) -> None:
        """Close NVML (its handles keep the GPUs' nodes open, and a reset refuses a GPU anyone has
        open): until resume(), snapshots give every GPU unknown for `reason`."""
        def job() -> None:
            with self._lock:
                self._paused = reason
                self._close()
        self._worker.run(job, self._timeout(), "nvmlShutdown")

    def resume(self) -> None:
        with self._lock:
            self._paused = ""  # the next call initialises NVML again

    def _unknown(self, message: str, count: int, driver: str, done: dict[int, GpuInfo]) -> NvmlSnapshot:
        """Every GPU not in `done` unknown for `message`, as NVML last said it was."""
        gpus = [done[index] if index in done else self._recall(GpuInfo(index=index, unknown=True, error=message))
                for index in range(count)]
        return NvmlSnapshot(available=True, error=message, driver_version=driver, gpus=gpus)

    def snapshot(self, with_processes: bool = True) -> NvmlSnapshot:
        """GPUs, memory and process lists, within `timeout` seconds whatever the driver does: a
        GPU not read in time is `unknown`, with what NVML last said it is."""
        progress = _Progress()

        def job() -> NvmlSnapshot:
            _job.progress = progress
            try:
                return self._snapshot(with_processes, progress)
            finally:
                _job.progress = None
        try:
            snap = self._worker.run(job, self._timeout(), progress)  # type: ignore[arg-type]
        except NvmlHung as hung:
            self.last_error = message = hung.describe()
            snap = NvmlSnapshot(available=False, error=message) if self._last_count is None else self._unknown(
                message, self._last_count, self._last_driver, {g.index: g for g in list(progress.done)})
        if any(gpu.minor is None and (gpu.lost or gpu.unknown or gpu.suspended) for gpu in snap.gpus):
            driverinfo.fill_from_driver(snap.gpus, self._read_driver_gpus())
        return snap

    def _recall(self, gpu: GpuInfo) -> GpuInfo:
        """Give a GPU that cannot be read now its identity and MIG instances as NVML said before
        (their figures unknown), so its nodes, holders and MIG UUIDs still map to it."""
        identity = self._identity.get(gpu.index)
        if identity is not None:
            gpu.uuid, gpu.name, gpu.minor, gpu.pci_bus_id = identity
        seen = self._seen.get(gpu.index)
        if seen is not None and seen.uuid == gpu.uuid:
            _copy_mig(seen, gpu, figures=False)
        return gpu

    def _read_driver_gpus(self) -> list[driverinfo.DriverGpu]:
        if not self._driver_gpus:  # else fixed while the driver stays loaded
            with contextlib.suppress(NvmlHung):
                self._driver_gpus = self._driver_worker.run(
                    lambda: driverinfo.read_driver_gpus(self._driver_gpus_dir), self._timeout(), self._driver_gpus_dir)
        return self._driver_gpus or []

    def _snapshot(self, with_processes: bool, progress: _Progress) -> NvmlSnapshot:
        with self._lock:
            if self._paused:
                return self._unknown(self._paused, self._last_count or 0, self._last_driver, {})
            sysfs = self._sysfs()
            # Only the nvidia driver's own devices: an unrelated device that happens to sit
            # at a bus id (a test's fake GPU on a real machine) says nothing of a GPU.
            bound = driverinfo.nvidia_bus_ids(sysfs)
            if bound and self._last_count in (None, len(bound)) and all(driverinfo.asleep(sysfs, bus) for bus in bound):
                return self._all_asleep(bound)
            if not self._ensure_init():
                return NvmlSnapshot(available=False, error=self.last_error)
            try:
                driver = _text(pynvml.nvmlSystemGetDriverVersion())
                count = pynvml.nvmlDeviceGetCount()
            except pynvml.NVMLError as exc:
                # The driver went away under us (unloaded, reset): start over next time.
                self._close()
                self.last_error = _error_text(exc)
                return NvmlSnapshot(available=False, error=self.last_error)
            self._last_driver, self._last_count = driver, count
            self.last_error = ""
            gpus = progress.done  # what a hang leaves read, too
            for index in range(count):
                progress.gpu = index
                # Its bus id as NVML last gave it; before that, the nvidia driver's i-th device
                # (bus order is NVML's), only where both count the same GPUs.
                identity = self._identity.get(index)
                bus_id = driverinfo.bus_key(identity[3]) if identity is not None else (
                    bound[index] if len(bound) == count else "")
                # No NVML call names a GPU asleep, not even for its handle: any could resume it.
                asleep = bus_id in bound and driverinfo.asleep(sysfs, bus_id)
                gpu = self._asleep(index, bus_id) if asleep else self._gpu(index, with_processes)
                gpus.append(gpu)
                if not (gpu.unknown or gpu.lost or gpu.suspended):
                    self._seen[index] = gpu
            return NvmlSnapshot(available=True, driver_version=driver, gpus=gpus)

    def _all_asleep(self, bound: list[str]) -> NvmlSnapshot:
        """Every GPU is asleep: the NVML session is closed (an open session keeps a GPU from
        suspending: btop issue 1831) and the GPUs are given in bus order (NVML's), as last read."""
        if self._initialized:
            self._released = True
            self._close()
        self._last_count = len(bound)
        driver = self._last_driver or driverinfo.driver_version(self._sysfs())
        return NvmlSnapshot(available=True, driver_version=driver,
                            gpus=[self._asleep(index, bus) for index, bus in enumerate(bound)])

    def _asleep(self, index: int, bus_id: str) -> GpuInfo:
        """A runtime-suspended GPU as last read (found by its bus id), its process lists empty."""
        domain, _, rest = bus_id.partition(":")
        # NVML's spelling ("00000000:01:00.0") until NVML itself has named it.
        gpu = GpuInfo(index=index, suspended=True, pci_bus_id=f"{int(domain, 16):08X}:{rest.upper()}")
        seen = next((g for g in self._seen.values() if driverinfo.bus_key(g.pci_bus_id) == bus_id), None)
        if seen is not None:
            gpu.uuid, gpu.name, gpu.minor, gpu.pci_bus_id = seen.uuid, seen.name, seen.minor, seen.pci_bus_id
            gpu.memory_total, gpu.memory_used = seen.memory_total, seen.memory_used
            _copy_mig(seen, gpu, figures=True)
        return gpu

    def _gpu(self, index: int, with_processes: bool) -> GpuInfo:
        gpu = GpuInfo(index=index)
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as exc:
            # GPU_IS_LOST, UNKNOWN, NO_PERMISSION (dcgm-exporter issue 604): nothing can be
            # read, but the GPU is still there, and so are its device nodes and their holders.
            gpu.error = _error_text(exc)
            gpu.lost = isinstance(exc, pynvml.NVMLError_GpuIsLost)
            gpu.unknown = not gpu.lost
            return self._recall(gpu)

        def query(call: Callable[[Any], Any]) -> Any | None:
            try:
                return call(handle)
            except pynvml.NVMLError as exc:
                gpu.lost = gpu.lost or isinstance(exc, pynvml.NVMLError_GpuIsLost)
                _note(gpu, exc)
                return None

        identity = self._identity.get(index)
        if identity is None:
            uuid, name, minor, pci = (query(get) for get in (
                pynvml.nvmlDeviceGetUUID, pynvml.nvmlDeviceGetName, pynvml.nvmlDeviceGetMinorNumber,
                pynvml.nvmlDeviceGetPciInfo_v3))
            identity = (_text(uuid) if uuid is not None else "", _text(name) if name is not None else "",
                        int(minor) if minor is not None else None, _text(pci.busId) if pci is not None else "")
            # NVML numbers devices once per initialisation, so what a GPU is does not change
            # until the next nvmlInit: read it once instead of on every poll.
            if None not in (uuid, name, minor, pci):
                self._identity[index] = identity
        gpu.uuid, gpu.name, gpu.minor, gpu.pci_bus_id = identity
        memory = query(self._memory)
        if memory is not None:
            gpu.memory_total, gpu.memory_used = memory
        elif not gpu.lost:
            gpu.unknown = True  # no memory figure: neither idle nor leaked can be said
        if not gpu.lost:
            gpu.processes = self._processes(handle, gpu) if with_processes else {}
            self._mig(handle, gpu, with_processes)
        return gpu

    def _mig(self, handle: Any, gpu: GpuInfo, with_processes: bool) -> None:
        """The MIG devices of a GPU in MIG mode, each with its memory and processes: the
        parent's process lists are empty for all but privileged callers (nvml.h)."""
        try:
            if pynvml.nvmlDeviceGetMigMode(handle)[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
                return
            gpu.mig_mode = True
            slots = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        except pynvml.NVMLError as exc:
            if gpu.mig_mode or not _unsupported(exc):  # no MIG mode: a GPU (or driver) without MIG
                _note(gpu, exc)
            return
        for slot in range(slots):
            try:
                mig_handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except pynvml.NVMLError as exc:
                if not isinstance(exc, pynvml.NVMLError_NotFound):  # an empty slot
                    _note(gpu, exc)
                continue
            self._instance(mig_handle, gpu, with_processes)

    def _instance(self, mig_handle: Any, gpu: GpuInfo, with_processes: bool) -> None:
        try:
            instance = MigInstance(uuid=_text(pynvml.nvmlDeviceGetUUID(mig_handle)),
                                   gpu_instance_id=int(pynvml.nvmlDeviceGetGpuInstanceId(mig_handle)),
                                   compute_instance_id=int(pynvml.nvmlDeviceGetComputeInstanceId(mig_handle)))
        except pynvml.NVMLError as exc:
            _note(gpu, exc)  # without its UUID and ids nobody can name or find the instance
            return
        try:
            instance.memory_total, instance.memory_used = self._memory(mig_handle)
        except pynvml.NVMLError as exc:
            instance.error = _error_text(exc)
        if with_processes:
            listed = GpuInfo(index=gpu.index)  # collects the lists' errors for this instance
            instance.processes = self._processes(mig_handle, listed)
            instance.error = instance.error or listed.error
            for pid, used in instance.processes.items():
                # The parent's aggregate list (privileged callers) has them already: once.
                gpu.processes.setdefault(pid, used)
        gpu.mig.append(instance)

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
        lists, errors = nvmlprocs.read_lists(handle)
        for exc in errors:
            _note(gpu, exc)
        if errors and not lists:
            gpu.unknown = True  # who uses it, and so whether its memory leaks, is unknown
        found, gpu.warnings = nvmlprocs.merge(lists, gpu.index)
        return found


def _copy_mig(seen: GpuInfo, gpu: GpuInfo, figures: bool) -> None:
    """Give `gpu` the MIG instances it was `seen` with, their figures or else the GPU's error."""
    gpu.mig_mode = seen.mig_mode
    gpu.mig = [MigInstance(uuid=m.uuid, gpu_instance_id=m.gpu_instance_id, compute_instance_id=m.compute_instance_id,
                           memory_total=m.memory_total if figures else 0,
                           memory_used=m.memory_used if figures else 0, error="" if figures else gpu.error)
               for m in seen.mig]
