"""What both benchmarks share: fake device nodes, a synthetic process population, the peer tools
(fuser, lsof, pkill) with parsers for their output, timing and the result table.

The population is built by a small "leader" process, which is this file run as a script
(`python bench/common.py --leader`, its spec as JSON on stdin; the benchmarks start it). The
leader forks a few workers; each worker opens its share of ordinary files (regular files,
/dev/null, pipes, sockets) and forks light children that inherit them. Children chosen as holders
open or map the fake device nodes themselves, or exec `sleep` with their fds inherited so that
`pkill -f` has a command line to match. Every child reports "<pid> <kind>" on a pipe once it is
set up, so the benchmark knows the exact expected answer before it times anything.

Teardown is certain: workers and children share one process group that the leader kills and
reaps (it is their subreaper) when the benchmark says stop, when the benchmark dies (its end
of a pipe closes), and the benchmark kills that group itself as well, in a finally.
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
COMMON = Path(__file__).resolve()

# Fake device nodes, named as the NVIDIA driver names them. gpuguard recognises a device by its
# number (st_rdev), wherever the node lives, so the numbers must be this run's alone: a sweep
# matching tests/conftest.py's (120, n) nodes would end another checkout's test holders, and one
# matching another benchmark run's would end that run's. So major 121 (reserved for local use,
# no driver: only O_PATH opens work, which look the same in /proc/<pid>/fd) with minors drawn at
# random per run.
#
# A holder that maps nvidia-uvm needs a node that can really be mapped: a node with /dev/zero's
# numbers (UVM_ZERO, as tests/conftest.py does; gpuguard refuses a regular file as a device, and
# accepts majors 1 and 121 only because the benchmark's configuration says AllowMajors).
# That makes every process on the host that holds /dev/zero a holder in gpuguard's eyes,
# and the benchmark's holders holders of every other fake (1, 5) node on the host, such as a
# concurrent test run's; alias_holders() accounts for the first.
BENCH_MAJOR = 121
NODE_NAMES = ("nvidia0", "nvidia1", "nvidiactl", "nvidia-modeset", "nvidia-uvm")
ZERO = (1, 5)
UVM_PATH = "o_path"  # a major-121 node like the others: fds only
UVM_ZERO = "zero"
# [Devices] AllowMajors for the benchmark's nodes: no NVIDIA driver registers these.
ALLOW_MAJORS = (BENCH_MAJOR, ZERO[0])

# What a child of the population holds. Fork-mode holders rotate through 1-4; exec-mode holders
# (sweep benchmark) are 5 or 6, by the GPU they hold.
KIND_PLAIN = 0
KIND_FD_MMAP = 1  # nvidiaN + nvidiactl + nvidia-uvm fds, and a mapping of nvidia-uvm
KIND_MMAP_ONLY = 2  # a mapping of nvidia-uvm, no fd at all
KIND_MANAGEMENT = 3  # nvidiaN + nvidiactl fds (like nvidia-smi)
KIND_MODESET = 4  # nvidia-modeset fd only
KIND_COMPUTE_GPU0 = 5  # nvidia0 + nvidiactl + nvidia-uvm fds, then exec
KIND_COMPUTE_GPU1 = 6  # nvidia1 + nvidiactl + nvidia-uvm fds, then exec
KIND_NAMES = {KIND_PLAIN: "plain", KIND_FD_MMAP: "fd+mmap", KIND_MMAP_ONLY: "mmap only",
              KIND_MANAGEMENT: "fd (management)", KIND_MODESET: "fd (modeset)",
              KIND_COMPUTE_GPU0: "fd compute gpu0", KIND_COMPUTE_GPU1: "fd compute gpu1"}
_WORKER = 255  # record from a worker: its pid
_GROUP = 254  # record from the leader: the population's process group

_RECORD = struct.Struct("=iB")


class BenchError(Exception):
    """The benchmark cannot go on (missing tool, population failed, tools disagree)."""


# -- environment -------------------------------------------------------------------------------


def require_environment(tools: Iterable[str]) -> None:
    if sys.platform != "linux":
        raise BenchError("Linux only")
    if os.geteuid() != 0:
        raise BenchError("run as root: the benchmark creates device nodes (mknod) and signals processes")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise BenchError("missing tools: " + " ".join(missing) + " (apt-get install psmisc lsof procps)")


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C does, so every finally (teardown) runs."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)


# --amd: the same roles as AMD's nodes: two GPUs' render nodes, a primary node each for
# management clients and modesetting, and /dev/kfd (which ROCm processes map, as CUDA's
# nvidia-uvm) in nvidia-uvm's place.
AMD_NAMES = {"nvidia0": "renderD0", "nvidia1": "renderD1", "nvidiactl": "card0",
             "nvidia-modeset": "card1", "nvidia-uvm": "kfd"}


def make_nodes(dev: Path, uvm: str = UVM_PATH, names: Mapping[str, str] | None = None) -> dict[str, str]:
    """The fake nodes in `dev`, on a tmpfs of their own when root may mount one.

    Real nodes live on devtmpfs, whose device number nothing else on the host shares; nodes on
    the root filesystem would share it with every binary and library in /proc/<pid>/maps.
    uvm: what nvidia-uvm is (UVM_PATH or UVM_ZERO, see above).
    names: the file each role's node gets (AMD_NAMES), else the NVIDIA driver's names.
    Call unmount_nodes(dev) when done.
    """
    dev.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=755", "gpuguard-bench",
                              str(dev)], capture_output=True, check=False).returncode == 0
    if not mounted:
        print(f"note: could not mount a tmpfs on {dev}; the nodes share the host's root filesystem")
    base = secrets.randbelow((1 << 20) - 4096) + 1024
    paths: dict[str, str] = {}
    for offset, name in enumerate(NODE_NAMES):
        path = dev / (names or {}).get(name, name)
        paths[name] = str(path)
        major, minor = ZERO if name == "nvidia-uvm" and uvm == UVM_ZERO else (BENCH_MAJOR, base + offset)
        os.mknod(path, 0o666 | 0o020000, os.makedev(major, minor))
    return paths


def unmount_nodes(dev: Path) -> None:
    if os.path.ismount(dev) and subprocess.run(["umount", str(dev)], capture_output=True,
                                               check=False).returncode != 0:
        subprocess.run(["umount", "-l", str(dev)], capture_output=True, check=False)


# -- the population ----------------------------------------------------------------------------


@dataclass
class Population:
    """`procs` children with `files` open files each, `holders` of them holding device nodes.

    exec_argv: holders exec this (keeping their fds) once set up; plain children never do.
    plain_exec: plain children exec this (keeping their fds) once set up: a small program costs
    a third of the memory of a forked Python process (about 0.2 MiB against 0.7 MiB, most of
    that the pages Python's own refcounting copies), which a population of ten thousand
    needs; its /proc/<pid>/maps is shorter too (37 lines for sleep).
    orphan_cleanup: (mount point, directory) the leader unmounts and removes if the benchmark
    dies without stopping the population (SIGKILL), after killing the population.
    """

    workdir: Path
    nodes: dict[str, str]
    procs: int
    files: int
    holders: int
    workers: int = 4
    exec_argv: Sequence[str] | None = None
    plain_exec: Sequence[str] | None = None
    start_timeout: float = 120.0
    orphan_cleanup: tuple[Path, Path] | None = None
    members: dict[int, int] = field(default_factory=dict)  # pid -> kind
    worker_pids: list[int] = field(default_factory=list)
    pgid: int = 0
    startup_sec: float = 0.0
    _popen: subprocess.Popen[bytes] | None = None
    _watch: int = -1
    _log: Path | None = None

    @property
    def holder_pids(self) -> set[int]:
        return {pid for pid, kind in self.members.items() if kind != KIND_PLAIN}

    def start(self) -> None:
        if self.holders > self.procs:
            raise BenchError(f"--holders {self.holders} is more than --procs {self.procs}")
        started = time.perf_counter()
        self.workdir.mkdir(parents=True, exist_ok=True)
        ready_r, ready_w = os.pipe()
        watch_r, watch_w = os.pipe()
        self._watch = watch_w
        spec = {"workdir": str(self.workdir), "nodes": self.nodes, "procs": self.procs,
                "files": self.files, "holders": self.holders,
                "workers": max(1, min(self.workers, self.procs)),
                "exec": list(self.exec_argv) if self.exec_argv else None,
                "plain_exec": list(self.plain_exec) if self.plain_exec else None,
                "ready_fd": ready_w, "watch_fd": watch_r,
                "orphan_cleanup": [str(p) for p in self.orphan_cleanup] if self.orphan_cleanup else None}
        self._log = self.workdir / f"leader-{time.monotonic_ns()}.log"
        with open(self._log, "wb") as log:
            # Spec on stdin, not argv: `pkill -f` must match the holders only, never the leader.
            self._popen = subprocess.Popen(
                [sys.executable, str(COMMON), "--leader"], stdin=subprocess.PIPE, stdout=log,
                stderr=log, pass_fds=(ready_w, watch_r), start_new_session=True)
        os.close(ready_w)
        os.close(watch_r)
        try:
            assert self._popen.stdin is not None
            self._popen.stdin.write(json.dumps(spec).encode())
            self._popen.stdin.close()
            self._read_records(ready_r)
        finally:
            os.close(ready_r)
        if self.exec_argv:
            self._wait_for_exec(self.holder_pids, list(self.exec_argv))
        if self.plain_exec:
            self._wait_for_exec(set(self.members) - self.holder_pids, list(self.plain_exec))
        self.startup_sec = time.perf_counter() - started

    def _read_records(self, ready_r: int) -> None:
        deadline = time.monotonic() + self.start_timeout
        buffer = b""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"population not ready after {self.start_timeout:.0f} s "
                                 f"({len(self.members)}/{self.procs} children){self._log_tail()}")
            ready, _, _ = select.select([ready_r], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(ready_r, 65536)
            if not chunk:
                break  # every writer (leader, workers, children) is done
            buffer += chunk
            whole = len(buffer) - len(buffer) % _RECORD.size
            for pid, kind in _RECORD.iter_unpack(buffer[:whole]):
                if kind == _GROUP:
                    self.pgid = pid
                elif kind == _WORKER:
                    self.worker_pids.append(pid)
                else:
                    self.members[pid] = kind
            buffer = buffer[whole:]
        if len(self.members) != self.procs or not self.pgid:
            raise BenchError(f"population failed: {len(self.members)}/{self.procs} children "
                             f"reported{self._log_tail()}")

    def _wait_for_exec(self, pids: set[int], argv: list[str]) -> None:
        """Children report before they exec; `pkill -f` needs the new command line, and a scan
        the program the benchmark says it measures."""
        want = ("\0".join(argv) + "\0").encode()
        pending = set(pids)
        deadline = time.monotonic() + self.start_timeout
        while pending:
            for pid in list(pending):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as handle:
                        if handle.read() == want:
                            pending.discard(pid)
                except OSError as exc:
                    raise BenchError(f"child {pid} died before exec{self._log_tail()}") from exc
            if pending and time.monotonic() > deadline:
                raise BenchError(f"{len(pending)} children did not exec {argv}{self._log_tail()}")
            if pending:
                time.sleep(0.001)

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        try:
            text = self._log.read_text(errors="replace").strip()
        except OSError:
            return ""
        return f"\nleader log ({self._log}):\n{text[-2000:]}" if text else ""

    def stop(self) -> None:
        """Kill and reap every process of the population. Safe to call twice."""
        if self.pgid:
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._watch >= 0:
            # "q", then EOF: the leader kills the group too, reaps everything and exits. EOF
            # alone means the benchmark died, and the leader cleans up after it as well.
            try:
                os.write(self._watch, b"q")
            except OSError:
                pass  # the leader is gone already
            os.close(self._watch)
            self._watch = -1
        popen = self._popen
        if popen is not None:
            try:
                popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(timeout=30)
            self._popen = None
        self.pgid = 0


# -- the leader, worker and children (run with `--leader`) -------------------------------------


def _open_files(count: int, workdir: Path, tag: str) -> list[int]:
    """`count` fds of the kinds real processes hold: ~60% regular files, the rest /dev/null
    (a character device, like the nodes scanned for), pipes and sockets."""
    fds: list[int] = []
    slot = 0
    files_dir = workdir / "files"
    files_dir.mkdir(exist_ok=True)
    while len(fds) < count:
        which = slot % 10
        if which == 6:
            fds.append(os.open(os.devnull, os.O_RDWR))
        elif which == 7:
            fds.extend(os.pipe())
        elif which == 9:
            left, right = socket.socketpair()
            fds.extend((left.detach(), right.detach()))
        else:
            path = files_dir / f"{tag}-{slot}"
            fds.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        slot += 1
    while len(fds) > count:
        os.close(fds.pop())
    return fds


def _open_node(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR)
    except OSError:
        return os.open(path, os.O_PATH)  # no driver behind BENCH_MAJOR: O_PATH is all there is


_libc_mmap: Callable[[int], None] | None = None


def _mmap_node(path: str) -> None:
    """Map a page of `path` and close the fd: only /proc/<pid>/maps shows the node then.

    Python's mmap module keeps a dup() of the fd, which would make every mapping an fd holder
    too, so the mapping is made through libc.
    """
    fd = os.open(path, os.O_RDWR)
    try:
        assert _libc_mmap is not None
        _libc_mmap(fd)
    finally:
        os.close(fd)


def _setup_libc() -> None:
    import ctypes

    global _libc_mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    prot_read, map_private = 1, 2

    def do_mmap(fd: int) -> None:
        address = libc.mmap(None, 4096, prot_read, map_private, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), "mmap failed")

    _libc_mmap = do_mmap
    pr_set_child_subreaper = 36
    if libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_CHILD_SUBREAPER failed")


def _child(kind: int, ordinal: int, nodes: dict[str, str], ready_fd: int,
           exec_path: str, exec_argv: list[str] | None, plain_path: str, plain_argv: list[str] | None
           ) -> None:
    gpu = nodes["nvidia0"] if ordinal % 2 == 0 else nodes["nvidia1"]
    held: list[int] = []
    if kind == KIND_FD_MMAP:
        held += [_open_node(gpu), _open_node(nodes["nvidiactl"]), _open_node(nodes["nvidia-uvm"])]
        _mmap_node(nodes["nvidia-uvm"])
    elif kind == KIND_MMAP_ONLY:
        _mmap_node(nodes["nvidia-uvm"])
    elif kind == KIND_MANAGEMENT:
        held += [_open_node(gpu), _open_node(nodes["nvidiactl"])]
    elif kind == KIND_MODESET:
        held.append(_open_node(nodes["nvidia-modeset"]))
    elif kind in (KIND_COMPUTE_GPU0, KIND_COMPUTE_GPU1):
        node = nodes["nvidia0"] if kind == KIND_COMPUTE_GPU0 else nodes["nvidia1"]
        held += [_open_node(node), _open_node(nodes["nvidiactl"]), _open_node(nodes["nvidia-uvm"])]
    os.write(ready_fd, _RECORD.pack(os.getpid(), kind))
    os.close(ready_fd)
    if exec_argv and kind != KIND_PLAIN:
        for fd in held:
            os.set_inheritable(fd, True)
        os.execv(exec_path, exec_argv)
    if plain_argv and kind == KIND_PLAIN:
        os.execv(plain_path, plain_argv)
    while True:
        signal.pause()


def _kind_of(index: int, spec: dict[str, object]) -> tuple[int, int]:
    """(kind, holder ordinal) of child `index`: holders spread evenly over the population."""
    procs, holders = int(str(spec["procs"])), int(str(spec["holders"]))
    if holders == 0:
        return KIND_PLAIN, -1
    # index is a holder iff some k has k * procs // holders == index
    ordinal = -(-index * holders // procs)  # ceil(index * holders / procs)
    if ordinal >= holders or ordinal * procs // holders != index:
        return KIND_PLAIN, -1
    if spec["exec"]:
        return (KIND_COMPUTE_GPU0 if ordinal % 2 == 0 else KIND_COMPUTE_GPU1), ordinal
    return 1 + ordinal % 4, ordinal


def _worker(number: int, spec: dict[str, object], ready_fd: int) -> None:
    workdir = Path(str(spec["workdir"]))
    fds = _open_files(int(str(spec["files"])), workdir, f"w{number}")
    if spec["exec"] or spec["plain_exec"]:
        for fd in fds:
            os.set_inheritable(fd, True)  # exec'd children keep their ordinary files too
    nodes = spec["nodes"]
    assert isinstance(nodes, dict)
    exec_argv = spec["exec"]
    assert exec_argv is None or isinstance(exec_argv, list)
    exec_path = (shutil.which(exec_argv[0]) or exec_argv[0]) if exec_argv else ""
    plain_argv = spec["plain_exec"]
    assert plain_argv is None or isinstance(plain_argv, list)
    plain_path = (shutil.which(plain_argv[0]) or plain_argv[0]) if plain_argv else ""
    os.write(ready_fd, _RECORD.pack(os.getpid(), _WORKER))
    workers = int(str(spec["workers"]))
    for index in range(number, int(str(spec["procs"])), workers):
        kind, ordinal = _kind_of(index, spec)
        pid = os.fork()
        if pid == 0:
            try:
                _child(kind, ordinal, nodes, ready_fd, exec_path, exec_argv, plain_path, plain_argv)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
    os.close(ready_fd)
    # Reap at once, so kill(pid, 0) and the fake NVML see an ended holder gone.
    _reap_children()
    while True:
        signal.pause()


def _reap_children() -> None:
    """Wait for every child until none is left."""
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue


def leader_main() -> None:
    spec = json.loads(sys.stdin.read())
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.close(devnull)
    _setup_libc()
    ready_fd, watch_fd = int(spec["ready_fd"]), int(spec["watch_fd"])
    group = 0
    for number in range(int(spec["workers"])):
        pid = os.fork()
        if pid == 0:
            try:
                os.close(watch_fd)
                os.setpgid(0, group)  # 0 for the first worker: it founds the group
                _worker(number, spec, ready_fd)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        try:
            os.setpgid(pid, group or pid)  # from both sides, whichever runs first
        except OSError:
            pass
        group = group or pid
    os.write(ready_fd, _RECORD.pack(group, _GROUP))
    os.close(ready_fd)
    while True:
        try:
            told = os.read(watch_fd, 1)
            break  # b"q": stop; b"": the benchmark died
        except InterruptedError:
            continue
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _reap_children()  # workers, and the children orphaned to us (we are their subreaper)
    cleanup = spec.get("orphan_cleanup")
    if not told and cleanup:
        mount_point, directory = cleanup
        unmount_nodes(Path(mount_point))
        shutil.rmtree(directory, ignore_errors=True)


# -- peer tools --------------------------------------------------------------------------------


@dataclass
class ToolRun:
    seconds: float  # wall clock, fork and exec included
    cpu: float  # user + system time of the tool
    pids: set[int]
    stdout: str
    stderr: str
    returncode: int


def children_cpu() -> float:
    """User + system time of this process's reaped children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(argv: list[str]) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    cpu = children_cpu()
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    return time.perf_counter() - started, children_cpu() - cpu, proc


def parse_fuser(stdout: str) -> set[int]:
    """fuser writes the PIDs alone on stdout (names, access letters and -v's table go to
    stderr), e.g. " 8721 8722m": the digits are the answer."""
    pids: set[int] = set()
    for token in stdout.split():
        match = re.match(r"(\d+)", token)
        if match:
            pids.add(int(match.group(1)))
    return pids


def parse_lsof(stdout: str) -> set[int]:
    """lsof's table: COMMAND PID USER FD TYPE DEVICE SIZE/OFF NODE NAME; one line per file."""
    pids: set[int] = set()
    for line in stdout.splitlines():
        fields = line.split()
        if not fields or fields[0] == "COMMAND":
            continue
        # fields[1], unless a command name with a blank in it shifted it: the first number
        numbers = [f for f in fields[1:] if f.isdigit()]
        if numbers:
            pids.add(int(numbers[0]))
    return pids


def run_fuser(paths: Sequence[str], *extra: str) -> ToolRun:
    seconds, cpu, proc = _run(["fuser", *extra, *paths])
    if proc.returncode not in (0, 1):
        raise BenchError(f"fuser failed ({proc.returncode}): {proc.stderr[-500:]}")
    return ToolRun(seconds, cpu, parse_fuser(proc.stdout), proc.stdout, proc.stderr, proc.returncode)


def run_lsof(paths: Sequence[str]) -> ToolRun:
    seconds, cpu, proc = _run(["lsof", "-w", "-n", "-P", "--", *paths])
    if proc.returncode not in (0, 1):
        raise BenchError(f"lsof failed ({proc.returncode}): {proc.stderr[-500:]}")
    return ToolRun(seconds, cpu, parse_lsof(proc.stdout), proc.stdout, proc.stderr, proc.returncode)


def run_pkill(pattern: str) -> ToolRun:
    """pkill -e echoes "<name> killed (pid N)" for each process it signals."""
    seconds, cpu, proc = _run(["pkill", "-e", "-f", pattern])
    if proc.returncode not in (0, 1):
        raise BenchError(f"pkill failed ({proc.returncode}): {proc.stderr[-500:]}")
    pids = {int(m) for m in re.findall(r"\(pid (\d+)\)", proc.stdout)}
    return ToolRun(seconds, cpu, pids, proc.stdout, proc.stderr, proc.returncode)


# -- reporting ---------------------------------------------------------------------------------


def describe_pids(pids: Iterable[int], members: dict[int, int], limit: int = 8) -> str:
    items = sorted(pids)
    parts = []
    for pid in items[:limit]:
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as handle:
                comm = handle.read().strip()
        except OSError:
            comm = "gone"
        kind = KIND_NAMES.get(members[pid], "?") if pid in members else "not in the population"
        parts.append(f"{pid} ({comm}, {kind})")
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(parts) + more


def alias_holders(pids: Iterable[int], nodes: dict[str, str], driver_majors: Iterable[int] = ()
                  ) -> dict[int, str]:
    """Of `pids` (reported by gpuguard, outside the population), those that hold none of the
    nodes themselves but a device with the same number (or a driver's major) elsewhere, e.g.
    /dev/zero for a nvidia-uvm node made with (1, 5). gpuguard matches device numbers, which is
    how it sees a container's GPU at another path; fuser and lsof match the node's inode.
    pid -> what it holds. A process that exited before it could be looked at counts as one."""
    inodes: set[tuple[int, int]] = set()
    rdevs: dict[int, str] = {}
    for path in nodes.values():
        st = os.stat(path)
        inodes.add((st.st_dev, st.st_ino))
        rdevs[st.st_rdev] = path
    majors = set(driver_majors)
    found: dict[int, str] = {}
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fd_dir)
        except FileNotFoundError:
            found[pid] = "exited before it could be looked at"
            continue
        except OSError:
            continue
        reason = ""
        for name in names:
            try:
                st = os.stat(f"{fd_dir}/{name}")
                target = os.readlink(f"{fd_dir}/{name}")
            except OSError:
                continue
            if (st.st_mode & 0o170000) != 0o020000:
                continue
            if (st.st_dev, st.st_ino) in inodes:
                reason = ""
                break  # holds one of our nodes: not an alias, a real disagreement
            if st.st_rdev in rdevs:
                reason = (f"{target} ({os.major(st.st_rdev)},{os.minor(st.st_rdev)}, "
                          f"the numbers of {os.path.basename(rdevs[st.st_rdev])})")
            elif os.major(st.st_rdev) in majors and not reason:
                reason = f"{target} (an NVIDIA driver's major {os.major(st.st_rdev)})"
        if reason:
            found[pid] = reason
    return found


def check_same(answers: dict[str, set[int]], expected: set[int], members: dict[int, int]) -> str:
    """Raise BenchError naming the differences unless every answer equals `expected`."""
    problems = []
    for name, pids in answers.items():
        missing, extra = expected - pids, pids - expected
        if missing:
            problems.append(f"{name} missed {len(missing)}: {describe_pids(missing, members)}")
        if extra:
            problems.append(f"{name} reported {len(extra)} that are not population holders: "
                            f"{describe_pids(extra, members)}")
    if problems:
        raise BenchError("the tools disagree on who holds the devices:\n  " + "\n  ".join(problems))
    return " = ".join(answers)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def fmt_seconds(value: float) -> str:
    return f"{value * 1000:9.1f} ms"


def table(rows: Sequence[tuple[str, Sequence[float]]], extra: Mapping[str, str] | None = None,
          cpu: Mapping[str, Sequence[float]] | None = None) -> str:
    """Median, min and max wall time per row (and median CPU time where given)."""
    width = max(len(name) for name, _ in rows)
    cpu_head = f" {'cpu median':>12}" if cpu else ""
    lines = [f"{'':{width}}  {'median':>12} {'min':>12} {'max':>12}{cpu_head}  runs"]
    for name, values in rows:
        note = f"  {extra[name]}" if extra and name in extra else ""
        cpu_cell = ""
        if cpu:
            cpu_cell = f" {fmt_seconds(median(cpu[name])):>12}" if name in cpu else f" {'':>12}"
        lines.append(f"{name:{width}}  {fmt_seconds(median(values)):>12} {fmt_seconds(min(values)):>12} "
                     f"{fmt_seconds(max(values)):>12}{cpu_cell}  {len(values):>4}{note}")
    return "\n".join(lines)


def write_json(path: str | None, data: dict[str, object]) -> None:
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"results written to {target}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--leader"]:
        leader_main()
    else:
        sys.exit("common.py is run by the benchmarks (bench_scan.py, bench_sweep.py)")
