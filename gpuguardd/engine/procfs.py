"""Reading /proc. Every reader may race with the process exiting; callers get None, not errors.

Text comes back through safetext: valid UTF-8 whatever bytes a process chose, and bounded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from gpuguardd import safetext

PROC = "/proc"
PF_KTHREAD = 0x00200000
_S_IFMT = 0o170000
_S_IFCHR = 0o020000


@dataclass(frozen=True)
class ProcStat:
    pid: int
    comm: str
    state: str
    ppid: int
    flags: int
    start_time: int
    # How it ended, as waitpid() would say (field 52), None where the kernel does not show it.
    exit_code: int | None = None

    @property
    def is_kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)


def list_pids() -> list[int]:
    return [int(name) for name in os.listdir(PROC) if name.isdigit()]


def pid_exists(pid: int) -> bool:
    return os.path.exists(f"{PROC}/{pid}")


def read_stat(pid: int) -> ProcStat | None:
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    # comm may contain spaces and parentheses; it ends at the last ')'.
    open_paren = data.find(b"(")
    close_paren = data.rfind(b")")
    if open_paren < 0 or close_paren < 0:
        return None
    comm = safetext.text(data[open_paren + 1:close_paren], safetext.NAME_MAX)
    fields = data[close_paren + 2:].split()
    try:
        return ProcStat(pid=pid, comm=comm, state=fields[0].decode(), ppid=int(fields[1]),
                        flags=int(fields[6]), start_time=int(fields[19]),
                        exit_code=int(fields[49]) if len(fields) > 49 else None)
    except (IndexError, ValueError):
        return None


CGROUP_READ_MAX = 64 * 1024  # far above a real file (a PATH_MAX line per hierarchy); bounds a hostile one


def _read_bounded(path: str, limit: int) -> tuple[bytes, bool] | None:
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except OSError:
        return None
    return data[:limit], len(data) > limit


def read_cgroup(pid: int) -> str | None:
    read = _read_bounded(f"{PROC}/{pid}/cgroup", CGROUP_READ_MAX)
    if read is None:
        return None
    # Not cut by safetext: a marker inside would make a wrong cgroup path of the last line.
    return safetext.text(read[0], limit=4 * CGROUP_READ_MAX)


def read_cmdline(pid: int) -> str | None:
    """The arguments joined by spaces, at most safetext.CMDLINE_MAX bytes (only that is read)."""
    read = _read_bounded(f"{PROC}/{pid}/cmdline", safetext.CMDLINE_MAX)
    if read is None:
        return None
    data, more = read
    if not more and data.endswith(b"\0"):
        data = data[:-1]
    return safetext.text(data.replace(b"\0", b" "), safetext.CMDLINE_MAX, already_cut=more)


def char_device_fds(pid: int) -> list[tuple[int, int, int, str]]:
    """(st_dev, st_ino, st_rdev, fd) of `pid`'s character device fds; OSError if it cannot be read."""
    dir_fd = os.open(f"{PROC}/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    found: list[tuple[int, int, int, str]] = []
    try:
        for name in os.listdir(dir_fd):
            try:
                st = os.stat(name, dir_fd=dir_fd)
            except OSError:
                continue  # closed meanwhile, or a file we may not stat
            if st.st_mode & _S_IFMT == _S_IFCHR:
                found.append((st.st_dev, st.st_ino, st.st_rdev, name))
    finally:
        os.close(dir_fd)
    return found


MAPS_READ = 256 * 1024  # a read() of a maps file: most fit in one


def _read_whole(path: str) -> bytes | None:
    """A /proc file read whole with plain reads (a buffered file's open() also asks isatty() and
    fstat(): 20 % more CPU for a scan's maps), None when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, MAPS_READ):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def maps_lines(pid: int, tokens: Sequence[bytes]) -> list[bytes]:
    """The lines of /proc/<pid>/maps holding one of `tokens`, each once: searched, never parsed whole."""
    data = _read_whole(f"{PROC}/{pid}/maps")
    if data is None:
        return []
    lines: list[bytes] = []
    seen: set[int] = set()
    for token in tokens:
        found = data.find(token)
        while found >= 0:
            start = data.rfind(b"\n", 0, found) + 1
            end = data.find(b"\n", found)
            if end < 0:
                end = len(data)
            found = data.find(token, end)
            if start not in seen:
                seen.add(start)
                lines.append(data[start:end])
    return lines


def read_exe(pid: int) -> str | None:
    """As the kernel prints it (a replaced binary's ends in " (deleted)"); None for a kernel thread or zombie."""
    try:
        return os.readlink(f"{PROC}/{pid}/exe")
    except OSError:
        return None


STATUS_HEAD_MAX = 4096  # holds the Uid: line; four times it, the signal masks and NSpid


def read_status(pid: int, limit: int = 4 * STATUS_HEAD_MAX) -> dict[bytes, bytes]:
    read = _read_bounded(f"{PROC}/{pid}/status", limit)
    return {} if read is None else dict(line.split(b":", 1) for line in read[0].splitlines() if b":" in line)


def read_uid(pid: int) -> int | None:
    try:
        return int(read_status(pid, STATUS_HEAD_MAX)[b"Uid"].split()[0])
    except (KeyError, IndexError, ValueError):
        return None


def read_wchan(pid: int) -> str | None:
    read = _read_bounded(f"{PROC}/{pid}/wchan", safetext.NAME_MAX)
    return None if read is None else safetext.text(read[0], safetext.NAME_MAX, read[1])


def ancestors(pid: int) -> list[int]:
    chain: list[int] = []
    current = pid
    while current > 0 and current not in chain:
        chain.append(current)
        stat = read_stat(current)
        if stat is None:
            break
        current = stat.ppid
    return chain
