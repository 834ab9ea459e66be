"""Discovery: every process that holds a watched device, by fd, by mmap, or in NVML's lists.

psutil's open_files() reports regular files only, so device fds are found here, from
/proc/<pid>/fd. One stat() per fd (following the link, relative to the open fd directory)
gives the node's identity; no readlink is needed because the identity, not the name, decides.
Maps are read as bytes, and only the lines holding one of DeviceMap.maps_prefilter's few
substrings are parsed. Each process is pinned by a pidfd before it is read, so a holder's
details need no second look; a big scan is shared with helper processes (scan_raw), whose
holders describe() pins and reads again. bench/bench_scan.py measures all this against fuser
and lsof.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuguardd import safetext
from gpuguardd.engine import procfs
from gpuguardd.engine.attribution import attribute
from gpuguardd.engine.devices import DeviceMap
from gpuguardd.engine.enums import GpusFrom, HolderKind
from gpuguardd.engine.mig import instances_for_caps
from gpuguardd.engine.models import DeviceNode, Holder, NvmlSnapshot
from gpuguardd.engine.process import ProcessHandle

PROC = procfs.PROC
log = logging.getLogger("gpuguard.engine")


@dataclass
class RawHolding:
    """What the fast pass saw of one process, before details are read."""

    pid: int
    nodes: dict[str, DeviceNode] = field(default_factory=dict)
    how: set[str] = field(default_factory=set)
    # Opened before /proc/<pid> was read: while it shows the process alive, what was read was
    # that process's, since a PID is reused only after its process is reaped.
    pidfd: int | None = None

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _scan_fds(pid: int, device_map: DeviceMap, raw: RawHolding) -> None:
    _match_fds(procfs.char_device_fds(pid), device_map, raw)


def _match_fds(stats: Iterable[Sequence[int]], device_map: DeviceMap, raw: RawHolding) -> None:
    """Note in `raw` the watched nodes among (st_dev, st_ino, st_rdev) of open fds."""
    by_inode = device_map.by_inode
    for dev, ino, rdev in stats:
        node = by_inode.get((dev, ino)) or device_map.node_for_rdev(rdev)
        if node is not None:
            raw.nodes[node.path] = node
            raw.how.add("fd")


def _maps_tokens(device_map: DeviceMap) -> tuple[bytes, ...]:
    return device_map.maps_prefilter or device_map.maps_tokens


def _scan_maps(pid: int, device_map: DeviceMap, raw: RawHolding) -> None:
    _match_maps(procfs.maps_lines(pid, _maps_tokens(device_map)), device_map, raw)


def _match_maps(lines: Iterable[bytes], device_map: DeviceMap, raw: RawHolding) -> None:
    for line in lines:
        node = _maps_line_node(line, device_map)
        if node is not None:
            raw.nodes[node.path] = node
            raw.how.add("mmap")


def _maps_line_node(line: bytes, device_map: DeviceMap) -> DeviceNode | None:
    parts = line.split(None, 5)
    if len(parts) < 5:
        return None
    path = parts[5].decode("utf-8", "replace").strip() if len(parts) == 6 else ""
    node = device_map.by_path.get(path)
    if node is None:
        try:
            major_text, minor_text = parts[3].split(b":")
            dev = os.makedev(int(major_text, 16), int(minor_text, 16))
            node = device_map.by_inode.get((dev, int(parts[4])))
        except ValueError:
            node = None
    return node


def _scan_one(pid: int, device_map: DeviceMap, use_pidfd: bool) -> RawHolding | int | None:
    """What `pid` holds (a RawHolding, its pidfd open when use_pidfd), -pid when its fds
    could not be read, or None (it holds nothing, or exited)."""
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


def _scan_share(pids: Iterable[int], device_map: DeviceMap, use_pidfd: bool
                ) -> list[RawHolding | int]:
    found: list[RawHolding | int] = []
    try:
        for pid in pids:
            result = _scan_one(pid, device_map, use_pidfd)
            if result is not None:
                found.append(result)
    except BaseException:
        _close_all(found)  # a bug, not a race (those are OSError, handled): leak no pidfd
        raise
    return found


def _close_all(results: Iterable[RawHolding | int]) -> None:
    for item in results:
        if isinstance(item, RawHolding):
            item.close()


# -- helpers: the scan on every idle core ----------------------------------------------------
#
# The scan is kernel work: a stat() per open fd, and the kernel writing out each maps file
# (half the cost: a path per mapped file). Threads would share the GIL, which every one of
# those calls drops and takes back, and each hand-over waits for the other thread to be
# scheduled: two threads measured slower than one. So a big scan is split between this process
# and helper processes (engine/scanworker.py, the standard library and procfs only), one for
# each idle core: each reads its share of /proc and reports the char-device fds and maps lines
# that may concern the watched nodes; this process matches them. A holder a helper found has no
# pidfd: describe() pins it and reads it again, as any holder found before it was pinned. A
# helper that cannot start or fails is replaced by this process scanning its share.
# Cores busy with other work gain nothing from more processes (measured: on a saturated
# machine two took longer than one, helper start included), so only idle cores count
# (others_load): a busy host scans in one process, as before.
WORKERS_MAX = 4
# Below this many processes one process is quicker than starting a helper (~20 ms of CPU).
WORKER_MIN_PIDS = 400
WORKER_TIMEOUT_SEC = 300.0


def others_load(loadavg: str) -> float:
    """How many cores other work keeps busy, from /proc/loadavg's text: the 1-minute load
    average, but no more than the runnable tasks now less this one. The load average alone
    counts this process too once it has been busy (a daemon scanning a big host every second,
    a benchmark's loop), and would keep the second core of an otherwise idle host unused; the
    runnable count alone is a single sample. The smaller of the two errs towards idle only
    where both say so."""
    fields = loadavg.split()
    load = float(fields[0])
    running = int(fields[3].split("/")[0]) - 1  # the reader itself is running
    return max(0.0, min(load, float(running)))


def scan_workers() -> int:
    """Processes a big scan is split between: one for each idle core this process may run on
    (cores minus others_load(), rounded), at least 1, at most WORKERS_MAX (more only queue
    on the same /proc locks)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except OSError:
        cores = os.cpu_count() or 1
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            idle = cores - others_load(f.read())
    except (OSError, ValueError, IndexError):
        idle = 1.0
    return max(1, min(WORKERS_MAX, cores, int(idle + 0.5)))


def _worker_spec(pids: list[int], device_map: DeviceMap) -> bytes:
    """What a helper needs to keep only what may concern the watched nodes."""
    return json.dumps({
        "pids": pids,
        "inodes": sorted(device_map.by_inode),
        "rdevs": sorted(device_map.by_rdev),
        "majors": sorted(device_map.majors),
        "tokens": [t.decode("latin-1") for t in _maps_tokens(device_map)],
    }).encode()


_helper_warned = False


def _helper_failed(message: str, *args: object) -> None:
    """Say why a helper failed: a warning the first time (its share is scanned here, so the
    answer stands, but every big scan would take one process from then on), then debug."""
    global _helper_warned
    level = logging.DEBUG if _helper_warned else logging.WARNING
    _helper_warned = True
    log.log(level, "scan helper " + message + "; its share is scanned in this process", *args)


def _worker_env() -> dict[str, str]:
    """This process's environment, with the directory gpuguardd was imported from first on the
    path: `make install` puts the package where only the entry point's sys.path finds it."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _start_worker(pids: list[int], device_map: DeviceMap) -> subprocess.Popen[bytes] | None:
    try:
        proc = subprocess.Popen([sys.executable, "-m", "gpuguardd.engine.scanworker"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, close_fds=True, env=_worker_env())
    except OSError as exc:
        _helper_failed("did not start: %s", exc)
        return None
    try:
        assert proc.stdin is not None
        proc.stdin.write(_worker_spec(pids, device_map))  # read whole before it answers
        proc.stdin.close()
        proc.stdin = None  # sent: communicate() then only reads the answer
    except OSError as exc:
        _helper_failed("%d did not take its share: %s", proc.pid, exc)
        _end_worker(proc)
        return None
    return proc


def _end_worker(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _worker_results(proc: subprocess.Popen[bytes], device_map: DeviceMap
                    ) -> list[RawHolding | int] | None:
    """A helper's share as _scan_share gives it (holders without pidfds); None if it failed."""
    try:
        out, _ = proc.communicate(timeout=WORKER_TIMEOUT_SEC)
        entries = json.loads(out) if proc.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, OSError) as exc:
        _helper_failed("%d failed: %s", proc.pid, exc)
        return None
    finally:
        _end_worker(proc)
    if not isinstance(entries, list):
        _helper_failed("%d failed (exit %s)", proc.pid, proc.returncode)
        return None
    found: list[RawHolding | int] = []
    try:
        for entry in entries:
            pid = int(entry[0])
            if pid <= 0:
                raise ValueError(f"pid {pid}")
            if entry[1] == "unreadable":
                found.append(-pid)
                continue
            raw = RawHolding(pid)
            _match_fds(entry[1], device_map, raw)
            _match_maps((line.encode("latin-1") for line in entry[2]), device_map, raw)
            if raw.nodes:
                found.append(raw)
    except (TypeError, ValueError, IndexError, UnicodeError) as exc:  # a helper's bug: not ours to pass on
        _helper_failed("%d answered what it should not: %s", proc.pid, exc)
        return None
    return found


def scan_raw(device_map: DeviceMap, pids: list[int] | None = None, use_pidfd: bool = False,
             workers: int | None = None) -> tuple[dict[int, RawHolding], list[int]]:
    """The fast pass over /proc: {pid: what it holds} and the pids whose fds we could not read.

    With use_pidfd each process this one reads is pinned before it is read, and a holder keeps
    its pidfd in RawHolding.pidfd for describe() (or the caller's RawHolding.close()); holders
    a helper found have none. `workers`: how many processes share the scan (default: one a
    core for WORKER_MIN_PIDS processes or more); the answer does not depend on it."""
    todo = procfs.list_pids() if pids is None else list(pids)
    if workers is None:
        workers = scan_workers() if len(todo) >= WORKER_MIN_PIDS else 1
    workers = max(1, min(workers, len(todo)))
    # Interleaved shares: PIDs in a row are often alike (a service's workers, one user's shell).
    shares = [todo[n::workers] for n in range(workers)]
    helpers = [_start_worker(share, device_map) for share in shares[1:]]
    results: list[RawHolding | int] = []
    try:
        results = _scan_share(shares[0], device_map, use_pidfd)
        for share, helper in zip(shares[1:], helpers):
            got = _worker_results(helper, device_map) if helper is not None else None
            if got is None:
                got = _scan_share(share, device_map, use_pidfd)
            results.extend(got)
    except BaseException:
        _close_all(results)
        for helper in helpers:
            if helper is not None:
                _end_worker(helper)
        raise
    found = {item.pid: item for item in results if isinstance(item, RawHolding)}
    unreadable = sorted(-item for item in results if isinstance(item, int))
    return found, unreadable


def _fill_details(holder: Holder, user_cache: dict[int, str]) -> None:
    """exe, cmdline and user; each may be denied or vanish independently. Text is made valid
    UTF-8 and bounded (safetext): a process chooses these bytes. Read from /proc directly:
    three small reads, where psutil would add its import and a stat() per process."""
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


def _mig_for(pid: int, nodes: list[DeviceNode], nvml: NvmlSnapshot,
             device_map: DeviceMap) -> tuple[set[int], list[str]]:
    """The MIG instances a holder runs in: NVML's per-instance lists where they list it (and
    its pids are this /proc's), else the instances whose caps nodes it holds; with the GPUs
    those caps nodes belong to (node evidence, like /dev/nvidiaN)."""
    listed = {i.uuid for gpu in nvml.gpus if nvml.pids_local
              for i in gpu.mig if pid in i.processes}
    if listed:
        return set(), sorted(listed)
    gpus, migs = instances_for_caps(nodes, device_map.mig_caps, nvml)
    return gpus, sorted(migs)


def describe(pid: int, nvml: NvmlSnapshot,
             device_map: DeviceMap, user_cache: dict[int, str],
             use_pidfd: bool = True, raw: RawHolding | None = None
             ) -> tuple[Holder, ProcessHandle] | None:
    """Read a holder's details, race-free: the process is pinned (pidfd, or start time) before
    its holdings are read and checked to be alive after everything was read, so the details
    can't belong to a recycled PID. A `raw` from scan_raw(use_pidfd=True) was read after
    pinning: it is taken over, pidfd included. Otherwise the holdings are read again here."""
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
    holder.node_gpus = _gpus_for(nodes, nvml)
    memory = 0
    nvml_gpus: set[int] = set()
    # NVML's pids name local processes only where they are this /proc's (nvmlprocs).
    for gpu in nvml.gpus if nvml.pids_local else ():
        if pid in gpu.processes:
            how.add("nvml")
            nvml_gpus.add(gpu.index)
            memory += gpu.processes[pid] or 0
    caps_gpus, holder.mig = _mig_for(pid, nodes, nvml, device_map)
    holder.node_gpus = sorted(set(holder.node_gpus) | caps_gpus)
    holder.how = [h for h in ("fd", "mmap", "nvml") if h in how]
    holder.nvml_gpus = sorted(nvml_gpus)
    # Which GPU a process computes on only NVML knows: every CUDA process holds every GPU's
    # node. The nodes stand in, for display, for a process NVML does not list; the sweep's
    # scope rule (sweep.gpu_scope) treats the two sources differently.
    if holder.nvml_gpus:
        holder.gpus, holder.gpus_from = holder.nvml_gpus, GpusFrom.NVML
    elif holder.node_gpus:
        holder.gpus, holder.gpus_from = list(holder.node_gpus), GpusFrom.NODES
    holder.gpu_memory = memory
    holder.kind = HolderKind.COMPUTE if ("uvm" in holder.roles or "nvml" in how) else HolderKind.MANAGEMENT
    if not holder.how or not handle.alive():
        handle.close()
        return None
    return holder, handle


def find_holders(device_map: DeviceMap, nvml: NvmlSnapshot, use_pidfd: bool = True,
                 workers: int | None = None) -> tuple[list[tuple[Holder, ProcessHandle]], list[int]]:
    """All holders with open handles on them (the caller closes them), and unreadable pids.
    `workers`: as scan_raw's."""
    raw, unreadable = scan_raw(device_map, use_pidfd=use_pidfd, workers=workers)
    candidates = set(raw)
    if nvml.pids_local:
        for gpu in nvml.gpus:
            # Checked again though nvmlprocs.merge dropped non-pids: pidfd_open(4294967295)
            # raises OverflowError, not OSError.
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
