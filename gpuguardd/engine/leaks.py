"""Ghost memory, classified: what kind of leak a GPU (or MIG instance) shows.

Memory that stays in use when nothing computes has three faces on real hosts, and an operator
acts on each differently (docs/recovery.md):
  * no-process: NVML lists no process at all, yet memory is in use (rocm-systems 8263: 46 GB
    stranded). Nothing is left to end; a reset (or a reboot) frees it.
  * dead-pids: NVML attributes the memory to PIDs that do not exist (vllm-dashboard 182:
    160 GiB on 25 dead PIDs). Only said where NVML's PIDs are this /proc's
    (NvmlSnapshot.pids_local): from another PID namespace a PID missing here may be alive
    elsewhere, and such a GPU stays "in-use".
  * stuck-in-driver: processes a sweep could not end because they sleep uninterruptibly in
    the driver (D state in nvidia_uvm, vllm 25127); only a sweep's report can say "past the
    sweep", so only reports carry this kind.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from gpuguardd.engine import procfs
from gpuguardd.records.enums import LeakKind
from gpuguardd.records.models import GpuInfo, MigInstance


def pid_exists(pid: int) -> bool:
    return os.path.exists(f"{procfs.PROC}/{pid}")


def kind_of(memory: GpuInfo | MigInstance, pids_local: bool) -> LeakKind | None:
    """The leak kind of memory in use on `memory` (whose figures the caller found above the
    threshold), or None when a listed process still lives (or may, in another namespace)."""
    if not memory.processes:
        return LeakKind.NO_PROCESS
    if pids_local and not any(pid_exists(pid) for pid in memory.processes):
        return LeakKind.DEAD_PIDS
    return None


def stuck_kind(listed: Iterable[int], stuck_pids: Iterable[int]) -> LeakKind | None:
    """STUCK when a process NVML still lists there outlived the sweep in D state."""
    return LeakKind.STUCK if set(listed) & set(stuck_pids) else None
