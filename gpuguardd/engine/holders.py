"""Discovery: every process that holds a watched device, by fd, by mmap, or in NVML's lists.

A device fd is known by one stat() of its /proc/<pid>/fd link (the node's identity, not its
name); maps are searched as bytes for DeviceMap.maps_prefilter. Each process is pinned by a pidfd
before it is read. bench/bench_scan.py measures this against fuser and lsof.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass, field

from gpuguardd import safetext
from gpuguardd.engine import procfs
from gpuguardd.engine.amd import drm_vram
from gpuguardd.engine.attribution import attribute
from gpuguardd.engine.devices import DeviceMap, instances_for_caps
from gpuguardd.engine.process import ProcessHandle
from gpuguardd.records.enums import GpusFrom, HolderKind, Vendor
from gpuguardd.records.models import DeviceNode, Holder, NvmlSnapshot
from gpuguardd.records.selectors import pci_key

log = logging.getLogger("gpuguard.engine")


@dataclass
class RawHolding:
    pid: int
    nodes: dict[str, DeviceNode] = field(default_factory=dict)
    how: set[str] = field(default_factory=set)
    # Opened before /proc/<pid> was read: while it shows the process alive, what was read is its.
    pidfd: int | None = None
    # The fds on an AMD GPU's render or card node: the only fdinfo files worth reading.
    drm_fds: list[str] = field(default_factory=list)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _scan_fds(pid: int, device_map: DeviceMap, raw: RawHolding) -> None:
    by_inode = device_map.by_inode
    for dev, ino, rdev, fd in procfs.char_device_fds(pid):
        node = by_inode.get((dev, ino)) or device_map.node_for_rdev(rdev)
        if node is not None:
            raw.nodes[node.path] = node
            raw.how.add("fd")
            if node.role in ("render", "card"):
                raw.drm_fds.append(fd)


def _scan_maps(pid: int, device_map: DeviceMap, raw: RawHolding) -> None:
    for line in procfs.maps_lines(pid, device_map.maps_prefilter):
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        path = parts[5].decode("utf-8", "replace").strip() if len(parts) == 6 else ""
        node = device_map.by_path.get(path)
        if node is None:
            try:
                major_text, minor_text = parts[3].split(b":")
                dev = os.makedev(int(major_text, 16), int(minor_text, 16))
                node = device_map.by_inode.get((dev, int(parts[4])))
            except ValueError:
                continue
        if node is not None:
            raw.nodes[node.path] = node
            raw.how.add("mmap")


def _scan_one(pid: int, device_map: DeviceMap, use_pidfd: bool) -> RawHolding | int | None:
    """What `pid` holds (pinned when use_pidfd), -pid when its fds are unreadable, or None."""
    raw = RawHolding(pid)
    if use_pidfd:
        try:
            raw.pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None  # exited
        except OSError:
            pass  # e.g. EMFILE: describe() pins it later and reads it again
    try:
        _scan_fds(pid, device_map, raw)
        _scan_maps(pid, device_map, raw)
    except OSError as exc:
        raw.close()
        # ENOENT: exited; ESRCH: exiting
        return -pid if exc.errno in (errno.EACCES, errno.EPERM) else None
    except BaseException:
        raw.close()
        raise
    if raw.nodes:
        return raw
    raw.close()
    return None


def scan_raw(device_map: DeviceMap, pids: list[int] | None = None, use_pidfd: bool = False
             ) -> tuple[dict[int, RawHolding], list[int]]:
    """The fast pass over /proc, and the unreadable pids; use_pidfd: each keeps its pin for describe()."""
    found: dict[int, RawHolding] = {}
    unreadable: set[int] = set()
    try:
        for pid in procfs.list_pids() if pids is None else pids:
            result = _scan_one(pid, device_map, use_pidfd)
            if isinstance(result, RawHolding):
                if result.pid in found:
                    result.close()  # listed twice: one pin is enough
                else:
                    found[result.pid] = result
            elif result is not None:
                unreadable.add(-result)
    except BaseException:
        for raw in found.values():
            raw.close()  # a bug, not a race (those are OSError, handled): leak no pidfd
        raise
    return found, sorted(unreadable)


def _fill_details(holder: Holder, user_cache: dict[int, str]) -> None:
    """exe, cmdline and user, each of which may be denied or vanish (bytes the process chose: safetext)."""
    exe = procfs.read_exe(holder.pid)
    if exe is not None:
        # A binary replaced on disk while running reads "path (deleted)"; the path decides.
        holder.exe = safetext.clean(exe.removesuffix(" (deleted)"), safetext.PATH_MAX)
    holder.cmdline = procfs.read_cmdline(holder.pid) or ""
    uid = procfs.read_uid(holder.pid)
    if uid is None:
        return
    holder.uid = uid
    if holder.uid not in user_cache:
        user_cache[holder.uid] = safetext.user_name(holder.uid)
    holder.user = user_cache[holder.uid]


def _gpus_for(nodes: list[DeviceNode], nvml: NvmlSnapshot) -> list[int]:
    """A holder of /dev/kfd alone may be on any AMD GPU (ROCm opens its GPUs' render nodes)."""
    gpus: set[int] = set()
    amd = [g.index for g in nvml.gpus if g.vendor == Vendor.AMD]
    for node in nodes:
        if node.minor is None:
            continue
        if node.role in ("render", "card"):
            index = nvml.index_for_minor(node.minor, Vendor.AMD)
        elif node.role != "gpu":
            continue
        elif nvml.available:
            index = nvml.index_for_minor(node.minor)
        else:
            # Without NVML the minor is the best name we have (the CLI says so), unless AMD's
            # GPUs took those numbers: then the GPU is unknown, and counts on every GPU.
            index = None if amd else node.minor
        if index is not None:
            gpus.add(index)
    if not gpus and any(n.role == "kfd" for n in nodes):
        gpus.update(amd)
    return sorted(gpus)


def _drm_listed(pid: int, fds: list[str], nvml: NvmlSnapshot) -> dict[int, int]:
    """AMD GPU index -> VRAM its DRM clients (`fds`) hold there, by fdinfo: clients KFD does not
    list (Vulkan, Mesa's OpenCL, a compositor)."""
    if not fds:
        return {}
    by_pci = {pci_key(g.pci_bus_id): g.index for g in nvml.gpus if g.vendor == Vendor.AMD and g.pci_bus_id}
    listed: dict[int, int] = {}
    for pdev, vram in drm_vram(pid, fds).items():
        index = by_pci.get(pci_key(pdev))
        if index is not None and vram > 0:
            listed[index] = listed.get(index, 0) + vram
    return listed


def _mig_for(pid: int, nodes: list[DeviceNode], nvml: NvmlSnapshot,
             device_map: DeviceMap) -> tuple[set[int], list[str]]:
    """By NVML's per-instance lists, else by the caps nodes it holds (then with their GPUs)."""
    listed = {i.uuid for gpu in nvml.gpus if nvml.pids_local for i in gpu.mig if pid in i.processes}
    if listed:
        return set(), sorted(listed)
    gpus, migs = instances_for_caps(nodes, device_map.mig_caps, nvml)
    return gpus, sorted(migs)


def describe(pid: int, nvml: NvmlSnapshot, device_map: DeviceMap, user_cache: dict[int, str], use_pidfd: bool = True,
             raw: RawHolding | None = None) -> tuple[Holder, ProcessHandle] | None:
    """A holder's details, pinned (pidfd, or start time) before its holdings are read and alive
    after: nothing read is a recycled PID's. A pinned `raw` is taken over; else they are read again."""
    if raw is not None and raw.pidfd is not None:
        stat = procfs.read_stat(pid)
        if stat is None:
            raw.close()
            return None
        handle = ProcessHandle(pid, stat.start_time, raw.pidfd)
        raw.pidfd = None
    else:
        opened = ProcessHandle.open(pid, use_pidfd=use_pidfd)
        if opened is None:
            return None
        handle = opened
        stat = procfs.read_stat(pid)
        if stat is None or stat.start_time != handle.start_time:
            handle.close()
            return None
        # The fast pass ran before the process was pinned; look again now that it is.
        raw = RawHolding(pid)
        try:
            _scan_fds(pid, device_map, raw)
        except OSError:
            pass
        _scan_maps(pid, device_map, raw)
    holder = Holder(pid=pid, comm=stat.comm, state=stat.state, ppid=stat.ppid,
                    start_time=stat.start_time, uid=-1)
    _fill_details(holder, user_cache)
    where = attribute(procfs.read_cgroup(pid))
    holder.cgroup, holder.unit, holder.container = where.cgroup, where.unit, where.container
    nodes = sorted(raw.nodes.values(), key=lambda n: n.path)
    holder.devices = [n.path for n in nodes]
    holder.roles = sorted({n.role for n in nodes})
    how = set(raw.how)
    memory = 0
    nvml_gpus: set[int] = set()
    # Driver pids name local processes only where they are this /proc's (nvmlprocs); counted once a GPU.
    for gpu in nvml.gpus if nvml.pids_local else ():
        if pid in gpu.processes:
            how.add("kfd" if gpu.vendor == Vendor.AMD else "nvml")
            nvml_gpus.add(gpu.index)
            memory += gpu.processes[pid] or 0
    for index, vram in _drm_listed(pid, raw.drm_fds, nvml).items():
        if index not in nvml_gpus:
            how.add("fdinfo")
            nvml_gpus.add(index)
            memory += vram
    caps_gpus, holder.mig = _mig_for(pid, nodes, nvml, device_map)
    holder.node_gpus = sorted(set(_gpus_for(nodes, nvml)) | caps_gpus)
    holder.how = [h for h in ("fd", "mmap", "nvml", "kfd", "fdinfo") if h in how]
    holder.nvml_gpus = sorted(nvml_gpus)
    # Only NVML knows where a process computes (every CUDA process holds every GPU's node):
    # nodes stand in for one NVML does not list; scope.gpu_scope tells the two apart.
    if holder.nvml_gpus:
        on_amd = any(g.index in nvml_gpus and g.vendor == Vendor.AMD for g in nvml.gpus)
        holder.gpus, holder.gpus_from = holder.nvml_gpus, GpusFrom.KFD if on_amd else GpusFrom.NVML
    elif holder.node_gpus:
        holder.gpus, holder.gpus_from = list(holder.node_gpus), GpusFrom.NODES
    holder.gpu_memory = memory
    # A context: CUDA's (nvidia-uvm, or NVML lists it), ROCm's (/dev/kfd, or KFD's), or a DRM client's VRAM.
    compute = {"uvm", "kfd"} & set(holder.roles) or {"nvml", "kfd", "fdinfo"} & how
    holder.kind = HolderKind.COMPUTE if compute else HolderKind.MANAGEMENT
    if not holder.how or not handle.alive():
        handle.close()
        return None
    return holder, handle


def clock_ticks() -> int:
    """Now, in clock ticks since boot: the unit of a process's start time."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def started_since(ticks: int) -> list[int]:
    """Those started at `ticks` or later (a recycled PID is new), and those whose start is unreadable."""
    return [pid for pid in procfs.list_pids() if (stat := procfs.read_stat(pid)) is None or stat.start_time >= ticks]


def find_holders(device_map: DeviceMap, nvml: NvmlSnapshot, use_pidfd: bool = True,
                 pids: list[int] | None = None) -> tuple[list[tuple[Holder, ProcessHandle]], list[int]]:
    """Holders with open handles (the caller closes them); `pids`: only these and those NVML lists."""
    raw, unreadable = scan_raw(device_map, pids=pids, use_pidfd=use_pidfd)
    candidates = set(raw)
    if nvml.pids_local:
        for gpu in nvml.gpus:
            # pidfd_open(4294967295) raises OverflowError, not OSError.
            candidates.update(p for p in gpu.processes if 0 < p < 2**31)
    user_cache: dict[int, str] = {}
    result: list[tuple[Holder, ProcessHandle]] = []
    try:
        for pid in sorted(candidates):
            described = describe(pid, nvml, device_map, user_cache, use_pidfd, raw.get(pid))
            if described is not None:
                result.append(described)
    finally:
        for holding in raw.values():
            holding.close()  # those describe() did not take over
    return result, unreadable
