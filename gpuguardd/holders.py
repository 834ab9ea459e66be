"""Discovery: every process that holds a watched device, by fd, by mmap, or in NVML's lists.

psutil's open_files() reports regular files only, so device fds are found here, from
/proc/<pid>/fd. One stat() per fd (following the link) gives the node's identity; no readlink
is needed because the identity, not the name, decides. Maps are read as bytes and parsed only
when one of the watched nodes' tokens occurs in them, which keeps a scan of thousands of
processes close to fuser's cost.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat as stat_mod
from dataclasses import dataclass, field

import psutil

from . import procfs
from .attribution import attribute
from .devices import DeviceMap
from .models import KIND_COMPUTE, KIND_MANAGEMENT, DeviceNode, Holder, NvmlSnapshot
from .process import ProcessHandle

PROC = procfs.PROC


@dataclass
class RawHolding:
    """What the fast pass saw of one process, before details are read."""

    pid: int
    nodes: dict[str, DeviceNode] = field(default_factory=dict)
    how: set[str] = field(default_factory=set)


def _scan_fds(pid: int, device_map: DeviceMap, raw: RawHolding) -> None:
    with os.scandir(f"{PROC}/{pid}/fd") as entries:
        for entry in entries:
            try:
                st = entry.stat()  # follows the link to the open file itself
            except OSError:
                continue  # closed meanwhile, or a file we may not stat
            if not stat_mod.S_ISCHR(st.st_mode):
                continue
            node = device_map.by_inode.get((st.st_dev, st.st_ino)) or \
                device_map.node_for_rdev(st.st_rdev)
            if node is not None:
                raw.nodes[node.path] = node
                raw.how.add("fd")


def _scan_maps(pid: int, device_map: DeviceMap, raw: RawHolding) -> None:
    try:
        with open(f"{PROC}/{pid}/maps", "rb") as handle:
            data = handle.read()
    except OSError:
        return
    if not any(token in data for token in device_map.maps_tokens):
        return
    for line in data.splitlines():
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
                node = None
        if node is not None:
            raw.nodes[node.path] = node
            raw.how.add("mmap")


def scan_raw(device_map: DeviceMap, pids: list[int] | None = None
             ) -> tuple[dict[int, RawHolding], list[int]]:
    """The fast pass over /proc: {pid: what it holds} and the pids whose fds we could not read."""
    found: dict[int, RawHolding] = {}
    unreadable: list[int] = []
    for pid in procfs.list_pids() if pids is None else pids:
        raw = RawHolding(pid)
        try:
            _scan_fds(pid, device_map, raw)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                unreadable.append(pid)
            continue  # ENOENT: exited; ESRCH: exiting
        _scan_maps(pid, device_map, raw)
        if raw.nodes:
            found[pid] = raw
    return found, unreadable


def _fill_details(holder: Holder, user_cache: dict[int, str]) -> None:
    """exe, cmdline and user through psutil; each may be denied or vanish independently."""
    try:
        proc = psutil.Process(holder.pid)
    except psutil.Error:
        return
    with proc.oneshot():
        try:
            exe = proc.exe()
            # A binary replaced on disk while running reads "path (deleted)"; the path decides.
            holder.exe = exe.removesuffix(" (deleted)")
        except psutil.Error:
            pass
        try:
            holder.cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            pass
        try:
            holder.uid = proc.uids().real
        except psutil.Error:
            return
    if holder.uid not in user_cache:
        try:
            user_cache[holder.uid] = pwd.getpwuid(holder.uid).pw_name
        except KeyError:
            user_cache[holder.uid] = str(holder.uid)
    holder.user = user_cache[holder.uid]


def _gpus_for(nodes: list[DeviceNode], nvml: NvmlSnapshot) -> list[int]:
    gpus: set[int] = set()
    for node in nodes:
        if node.role != "gpu" or node.minor is None:
            continue
        if nvml.available:
            index = nvml.index_for_minor(node.minor)
            if index is not None:
                gpus.add(index)
        else:
            # Without NVML the minor is the best name we have; the CLI says so.
            gpus.add(node.minor)
    return sorted(gpus)


def describe(pid: int, nvml: NvmlSnapshot,
             device_map: DeviceMap, user_cache: dict[int, str],
             use_pidfd: bool = True) -> tuple[Holder, ProcessHandle] | None:
    """Read a holder's details, race-free: the pidfd is taken first and the process is checked
    to be alive after everything was read, so the details can't belong to a recycled PID."""
    handle = ProcessHandle.open(pid, use_pidfd=use_pidfd)
    if handle is None:
        return None
    stat = procfs.read_stat(pid)
    if stat is None or stat.start_time != handle.start_time:
        handle.close()
        return None
    # The fast pass ran before the pidfd existed; look again now that the PID is pinned.
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
    gpus = set(_gpus_for(nodes, nvml))
    memory = 0
    for gpu in nvml.gpus:
        if pid in gpu.processes:
            how.add("nvml")
            gpus.add(gpu.index)
            memory += gpu.processes[pid] or 0
    holder.how = [h for h in ("fd", "mmap", "nvml") if h in how]
    holder.gpus = sorted(gpus)
    holder.gpu_memory = memory
    holder.kind = KIND_COMPUTE if ("uvm" in holder.roles or "nvml" in how) else KIND_MANAGEMENT
    if not holder.how or not handle.alive():
        handle.close()
        return None
    return holder, handle


def find_holders(device_map: DeviceMap, nvml: NvmlSnapshot, use_pidfd: bool = True
                 ) -> tuple[list[tuple[Holder, ProcessHandle]], list[int]]:
    """All holders with open handles on them (the caller closes them), and unreadable pids."""
    raw, unreadable = scan_raw(device_map)
    candidates = set(raw)
    for gpu in nvml.gpus:
        candidates.update(gpu.processes)
    user_cache: dict[int, str] = {}
    result: list[tuple[Holder, ProcessHandle]] = []
    for pid in sorted(candidates):
        described = describe(pid, nvml, device_map, user_cache, use_pidfd)
        if described is not None:
            result.append(described)
    return result, unreadable
