"""Reading /proc. Every reader may race with the process exiting; callers get None, not errors."""

from __future__ import annotations

import os
from dataclasses import dataclass

PROC = "/proc"
PF_KTHREAD = 0x00200000


@dataclass(frozen=True)
class ProcStat:
    pid: int
    comm: str
    state: str
    ppid: int
    flags: int
    start_time: int

    @property
    def is_kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)


def list_pids() -> list[int]:
    return [int(name) for name in os.listdir(PROC) if name.isdigit()]


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
    comm = data[open_paren + 1:close_paren].decode("utf-8", "replace")
    fields = data[close_paren + 2:].split()
    try:
        return ProcStat(pid=pid, comm=comm, state=fields[0].decode(), ppid=int(fields[1]),
                        flags=int(fields[6]), start_time=int(fields[19]))
    except (IndexError, ValueError):
        return None


def read_cgroup(pid: int) -> str | None:
    try:
        with open(f"{PROC}/{pid}/cgroup", encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def ancestors(pid: int) -> list[int]:
    """pid and its parents up to PID 1, for "never signal the sweeper's own chain"."""
    chain: list[int] = []
    current = pid
    while current > 0 and current not in chain:
        chain.append(current)
        stat = read_stat(current)
        if stat is None:
            break
        current = stat.ppid
    return chain
