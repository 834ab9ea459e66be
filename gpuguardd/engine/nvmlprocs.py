"""NVML's per-GPU process lists, read so that a driver's ABI slip never names a wrong process.

Which call, and how wide its entries are:
  1. nvmlDeviceGetRunningProcessDetailList where the driver exports it (535.104 and later):
     a versioned struct the driver checks, so no guessing.
  2. Otherwise _v3, sized as nvitop does (its PR 89, issues 75 and 88): drivers 535.43 to
     535.86 export nvmlDeviceGetConfComputeMemSizeInfo but not the detail list, and write
     32-byte entries where pynvml reads 24 (pids 0 and 4294967295 come back); others write 24.
  3. Otherwise _v2 (24 bytes), otherwise the unversioned call (16 bytes).
pynvml's list wrappers are not used: they hard-code 24 bytes, and its detail-list wrapper
assigns None to a ctypes integer field when memory is "not available".

What comes back is untrusted: every pid is checked (merge), and NVML's pids are host pids,
meaningless in another PID namespace (pids_are_local).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

try:
    import pynvml
except ImportError:  # nvml.py reports the missing module; nothing here runs without it
    pynvml = None

from gpuguardd.engine import procfs
from gpuguardd.numbers import parse_uint

# The three lists NVML keeps per GPU, as (name of the old calls, detail-list mode).
KINDS = (("nvmlDeviceGetComputeRunningProcesses", 0),
         ("nvmlDeviceGetGraphicsRunningProcesses", 1),
         ("nvmlDeviceGetMPSComputeRunningProcesses", 2))
_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE as an unsigned long long
_SUCCESS = 0
_INSUFFICIENT_SIZE = 7
_RETRIES = 3  # the list may grow between the size query and the read
PID_MAX_LIMIT = 4 * 1024 * 1024  # the kernel's ceiling for pid_max on 64-bit
PROC_PID_INIT_INO = 0xEFFFFFFC  # the initial PID namespace's inode (linux/proc_ns.h), fixed since 3.8


class _Info16(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class _Info24(_Info16):  # a subclass's fields follow its base's
    _fields_ = [("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class _Info32(_Info24):  # nvmlProcessDetail_v1_t, and what drivers 535.43-535.86 write via _v3
    _fields_ = [("usedGpuCcProtectedMemory", ctypes.c_ulonglong)]


class _DetailList(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("mode", ctypes.c_uint),
                ("numProcArrayEntries", ctypes.c_uint), ("procArray", ctypes.POINTER(_Info32))]


# NVML_STRUCT_VERSION(ProcessDetailList, 1): pynvml's nvmlProcessDetailList_v1, 0x1000018.
_DETAIL_LIST_V1 = ctypes.sizeof(_DetailList) | (1 << 24)

Entry = tuple[int, int | None]  # (pid as NVML wrote it, bytes or None where not available)


def _function(name: str) -> Any | None:
    try:
        return pynvml._nvmlGetFunctionPointer(name)
    except pynvml.NVMLError_FunctionNotFound:
        return None


def _read(handle: Any, name: str, mode: int) -> list[Entry] | None:
    """The list the old calls call `name` (None where the driver lacks it), read with NVML's
    two-call protocol: ask how many (no array), then read into an array."""
    detail = _function("nvmlDeviceGetRunningProcessDetailList")
    struct: type[ctypes.Structure] = _Info32
    if detail is not None:
        def call(array: Any, capacity: int) -> tuple[int, int]:
            query = _DetailList(version=_DETAIL_LIST_V1, mode=mode, numProcArrayEntries=capacity,
                                procArray=ctypes.cast(array, ctypes.POINTER(_Info32)))
            return detail(handle, ctypes.byref(query)), query.numProcArrayEntries
    else:
        if _function("nvmlDeviceGetComputeRunningProcesses_v3") is not None:
            early_535 = _function("nvmlDeviceGetConfComputeMemSizeInfo") is not None
            struct, suffix = (_Info32 if early_535 else _Info24), "_v3"
        elif _function("nvmlDeviceGetComputeRunningProcesses_v2") is not None:
            struct, suffix = _Info24, "_v2"
        else:
            struct, suffix = _Info16, ""
        function = _function(name + suffix)
        if function is None:
            return None

        def call(array: Any, capacity: int) -> tuple[int, int]:
            count = ctypes.c_uint(capacity)
            ret = function(handle, ctypes.byref(count), array)
            # A size query these calls answer with success has nothing to list.
            return ret, 0 if ret == _SUCCESS and array is None else count.value
    ret, count = call(None, 0)
    for _ in range(_RETRIES):
        if ret == _SUCCESS and not count:
            return []
        if ret not in (_SUCCESS, _INSUFFICIENT_SIZE):
            break
        # Twice what was asked for: room for new processes, and for entries wider than we think.
        capacity = count * 2 + 5
        array = (struct * capacity)()
        ret, count = call(array, capacity)
        if ret == _SUCCESS:
            return [(int(e.pid), None if e.usedGpuMemory == _NOT_AVAILABLE else int(e.usedGpuMemory))
                    for e in array[:min(count, capacity)]]
    raise pynvml.NVMLError(ret)


def read_lists(handle: Any) -> tuple[list[list[Entry]], list[BaseException]]:
    """Every list of one GPU (or MIG instance) handle, and the errors of the lists that could
    not be read (but for NOT_SUPPORTED: a list this GPU does not keep)."""
    found: list[list[Entry]] = []
    errors: list[BaseException] = []
    for name, mode in KINDS:
        try:
            entries = _read(handle, name, mode)
        except pynvml.NVMLError_NotSupported:
            continue
        except pynvml.NVMLError as exc:
            errors.append(exc)
            continue
        if entries is not None:
            found.append(entries)
    return found, errors


def pid_max() -> int:
    try:
        with open(f"{procfs.PROC}/sys/kernel/pid_max", encoding="ascii") as handle:
            return parse_uint(handle.read().strip(), "pid_max", PID_MAX_LIMIT, minimum=1)
    except (OSError, ValueError):
        return PID_MAX_LIMIT


def merge(lists: list[list[Entry]], index: int) -> tuple[dict[int, int | None], list[str]]:
    """{pid: bytes} over GPU `index`'s lists, and a warning per entry that is no pid. A process
    in two lists (OpenGL+CUDA) has one amount of memory, reported in both: the larger, not the sum."""
    found: dict[int, int | None] = {}
    warnings: list[str] = []
    limit = pid_max()
    for entries in lists:
        for pid, used in entries:
            if not 0 < pid <= limit:
                warnings.append(f"GPU {index}: NVML listed pid {pid}, which is no process id "
                                f"(pid_max {limit}); ignored (a driver/NVML struct mismatch?)")
                continue
            if used is None:
                found.setdefault(pid, None)
            else:
                found[pid] = max(found.get(pid) or 0, used)
    return found, warnings


@functools.cache  # a namespace never changes
def pids_are_local() -> bool:
    """Whether NVML's pids (the initial PID namespace's) are those of the /proc read here: when
    its PID 1 (else our own process) is in the initial namespace. Unreadable answers False."""
    for who in ("1", "self"):
        try:
            return os.stat(f"{procfs.PROC}/{who}/ns/pid").st_ino == PROC_PID_INIT_INO
        except OSError:
            continue
    return False


NOT_LOCAL = ("NVML reports host PIDs, and gpuguard runs in another PID namespace (a container?): "
             "NVML's PIDs are not used to find or attribute processes here, only device files")
