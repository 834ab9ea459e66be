"""Handles on processes that can never hit a recycled PID.

A pidfd names one process, not a number: once it is gone, signalling through the pidfd fails
with ESRCH even if the PID was reused. Without pidfds (before 5.3) the start time is checked
right before each kill: a window of microseconds, not seconds, and the report says so.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuguardd.engine import procfs
from gpuguardd.records.enums import SurvivorReason


def pidfds_supported() -> bool:
    if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        return False
    try:
        fd = os.pidfd_open(os.getpid())
    except OSError:
        return False
    os.close(fd)
    return True


class ProcessHandle:
    def __init__(self, pid: int, start_time: int, pidfd: int | None) -> None:
        self.pid = pid
        self.start_time = start_time
        self.pidfd = pidfd

    @classmethod
    def open(cls, pid: int, use_pidfd: bool = True) -> ProcessHandle | None:
        pidfd: int | None = None
        if use_pidfd:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                return None
        stat = procfs.read_stat(pid)
        handle = cls(pid, -1 if stat is None else stat.start_time, pidfd)
        if stat is None or not handle.alive():
            handle.close()
            return None
        return handle

    def dup(self) -> ProcessHandle:
        return ProcessHandle(self.pid, self.start_time, None if self.pidfd is None else os.dup(self.pidfd))

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass

    def alive(self) -> bool:
        """True while the process exists (a zombie keeps its PID)."""
        try:
            return self.send(0)
        except PermissionError:
            return True

    def send(self, sig: int) -> bool:
        """Deliver `sig` to exactly this process; False if it is gone."""
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, sig)
            elif (stat := procfs.read_stat(self.pid)) is not None and stat.start_time == self.start_time:
                os.kill(self.pid, sig)
            else:
                return False
        except ProcessLookupError:
            return False
        return True

    def exited(self) -> bool:
        """By /proc, for a handle without a pidfd (wait_for_exit polls pidfds)."""
        stat = procfs.read_stat(self.pid)
        return stat is None or stat.start_time != self.start_time or stat.state in ("Z", "X")


def wait_for_exit(handles: Iterable[ProcessHandle], timeout: float, on_exit: Callable[[int, float], None]) -> None:
    """Until every process has exited or `timeout` passes, `on_exit(pid, seen_at)` as each is seen."""
    pending = {h.pid: h for h in handles}
    done: set[int] = set()
    deadline = time.monotonic() + timeout
    poller = select.poll()
    by_fd = {h.pidfd: h.pid for h in pending.values() if h.pidfd is not None}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    fallback = [h for h in pending.values() if h.pidfd is None]

    def seen(pid: int, at: float) -> None:
        done.add(pid)
        on_exit(pid, at)
    while len(done) < len(pending):
        for handle in fallback:
            if handle.pid not in done and handle.exited():
                seen(handle.pid, time.monotonic())
        remaining = deadline - time.monotonic()
        if len(done) >= len(pending) or remaining <= 0:
            break
        wait = min(remaining, 0.01) if any(h.pid not in done for h in fallback) else remaining
        try:
            events = poller.poll(wait * 1000.0) if by_fd else []
        except InterruptedError:
            continue
        if not by_fd:
            time.sleep(wait)
        at = time.monotonic()
        for fd, _ in events:
            poller.unregister(fd)
            seen(by_fd.pop(fd), at)


def survivor_reason(pid: int) -> tuple[str, SurvivorReason, str]:
    stat = procfs.read_stat(pid)
    if stat is None:
        return "", SurvivorReason.EXITED, "exited"
    if stat.state == "Z":
        return stat.state, SurvivorReason.ZOMBIE, f"zombie: parent {stat.ppid} has not reaped it"
    if stat.state == "D":
        wchan = (procfs.read_wchan(pid) or "").strip()
        where = f" in {wchan}" if wchan and wchan != "0" else ""
        return (stat.state, SurvivorReason.UNINTERRUPTIBLE,
                f"uninterruptible (D state){where}: SIGKILL is pending until it wakes")
    return stat.state, SurvivorReason.STILL_RUNNING, f"still running after SIGKILL (state {stat.state})"


def ignores_sigterm(pid: int) -> bool:
    """Ignored, or a PID namespace's init with no handler (which drops an outer namespace's SIGTERM)."""
    status = procfs.read_status(pid)
    try:
        ignored, caught = (int(status.get(key, b"0").strip(), 16) for key in (b"SigIgn", b"SigCgt"))
        nspids = [int(p) for p in status.get(b"NSpid", b"").split()]  # from the outermost namespace
    except ValueError:
        return False
    bit = 1 << (signal.SIGTERM - 1)
    return bool(ignored & bit) or (len(nspids) > 1 and nspids[-1] == 1 and not caught & bit)


@dataclass(frozen=True)
class ExitStatus:
    killed_by: str = ""  # the signal's name ("SIGKILL", or "signal 42"); "" for an exit
    status: int = 0  # the exit status, when it exited

    def __str__(self) -> str:
        return f"killed by {self.killed_by}" if self.killed_by else f"exited with status {self.status}"


def exit_status(stat: procfs.ProcStat | None) -> ExitStatus | None:
    """How an exited, not yet reaped process ended (None once reaped: the kernel forgot)."""
    if stat is None or stat.state != "Z" or stat.exit_code is None:
        return None
    code = stat.exit_code
    if not os.WIFSIGNALED(code):
        return ExitStatus(status=os.WEXITSTATUS(code))
    try:
        return ExitStatus(killed_by=signal.Signals(os.WTERMSIG(code)).name)
    except ValueError:
        return ExitStatus(killed_by=f"signal {os.WTERMSIG(code)}")


def ended_by(last_sent: str, status: ExitStatus | None, sigterm_ignored: bool) -> str:
    """The signal of ours that ended it, as far as is known; `last_sent`: the last before it was seen gone."""
    sent = {"": set(), "SIGTERM": {"SIGTERM"}, "SIGKILL": {"SIGTERM", "SIGKILL"}}.get(last_sent, set())
    if status is not None and status.killed_by:
        return status.killed_by if status.killed_by in sent else ""
    if status is not None:
        # A normal exit answers a caught SIGTERM; after SIGKILL or an ignored SIGTERM it was its own.
        return last_sent if last_sent == "SIGTERM" and not sigterm_ignored else ""
    return "" if last_sent == "SIGTERM" and sigterm_ignored else last_sent
