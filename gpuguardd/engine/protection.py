"""Who a sweep must never signal, and why, decided on the holder before any signal.

A protected executable is known by file identity: /proc/PID/exe's text is a path in the
process's own mount namespace (`unshare -Urm` makes it say anything); stat() through the link
reaches the file it runs, compared by (st_dev, st_ino) with ProtectedExecutables in ours.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from collections.abc import Iterable
from dataclasses import dataclass

from gpuguardd.config import Config
from gpuguardd.engine import procfs
from gpuguardd.records.enums import SpareReason
from gpuguardd.records.models import Holder

_DELETED = " (deleted)"
FileId = tuple[int, int]


@dataclass(frozen=True)
class ProtectedFiles:
    """The files ProtectedExecutables names, looked up for every scan (an upgrade changes them)."""

    by_id: dict[FileId, str]
    # Configured paths and globs, for a process in our own mount namespace and root whose
    # executable was replaced since it started (an upgrade): only root can put a file there.
    patterns: tuple[str, ...]

    @classmethod
    def resolve(cls, config: Config) -> ProtectedFiles:
        by_id: dict[FileId, str] = {}
        for pattern in config.protected_executables:
            paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
            for path in paths:
                try:
                    st = os.stat(path)  # follows symlinks: /usr/bin/X -> /usr/lib/x/X
                except OSError:
                    continue
                by_id.setdefault((st.st_dev, st.st_ino), path)
        return cls(by_id=by_id, patterns=tuple(config.protected_executables))

    def match(self, pid: int) -> str | None:
        try:
            st = os.stat(f"/proc/{pid}/exe")
        except OSError:
            # Gone, or on a filesystem that refuses us: sparing it would let a FUSE mount shield any holder.
            return None
        return self.by_id.get((st.st_dev, st.st_ino)) or self._replaced_in_our_namespace(pid)

    def _replaced_in_our_namespace(self, pid: int) -> str | None:
        link = procfs.read_exe(pid)
        if link is None or not link.endswith(_DELETED) or not _same_namespace_and_root(pid):
            return None
        original = link.removesuffix(_DELETED)
        for pattern in self.patterns:
            if fnmatch.fnmatchcase(original, pattern) or fnmatch.fnmatchcase(original, os.path.realpath(pattern)):
                return f"{pattern}, replaced on disk since the process started"
        return None


def _same_namespace_and_root(pid: int) -> bool:
    try:
        theirs = (os.stat(f"/proc/{pid}/ns/mnt"), os.stat(f"/proc/{pid}/root"))
        ours = (os.stat("/proc/self/ns/mnt"), os.stat("/proc/self/root"))
    except OSError:
        return False
    return all((a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) for a, b in zip(theirs, ours, strict=True))


def protection(holder: Holder, config: Config, own_chain: Iterable[int],
               protected: ProtectedFiles | None = None) -> tuple[SpareReason, str] | None:
    if holder.pid == 1:
        return SpareReason.INIT, "PID 1 (init)"
    # The kernel-thread flag, not PID 2: in a PID namespace PID 2 is an ordinary process.
    stat = procfs.read_stat(holder.pid)
    if stat is not None and stat.is_kernel_thread:
        return SpareReason.KERNEL_THREAD, "kernel thread"
    if holder.pid == os.getpid():
        return SpareReason.SELF, "gpuguard itself"
    if holder.pid in own_chain:
        return SpareReason.ANCESTOR, "an ancestor of the sweeping process"
    if holder.state == "Z":
        return None  # runs no code, holds no files: reported as a survivor with its parent
    if not holder.exe:
        # Without the real executable we cannot rule out a protected daemon; comm proves nothing.
        return (SpareReason.EXECUTABLE_UNKNOWN,
                f"executable unknown (cannot read /proc/{holder.pid}/exe)")
    # The holder is pinned by a pidfd: a recycled PID's newcomer gets no signal either way.
    path = (protected or ProtectedFiles.resolve(config)).match(holder.pid)
    if path is not None:
        return (SpareReason.PROTECTED_EXECUTABLE, f"protected executable {holder.exe}"
                + (f" (same file as {path})" if path != holder.exe else ""))
    if not holder.container and config.is_protected_unit(holder.unit) is not None:
        return SpareReason.PROTECTED_UNIT, f"protected unit {holder.unit}"
    return None


def mark_protection(holder: Holder, config: Config, own_chain: Iterable[int],
                    protected: ProtectedFiles | None = None) -> None:
    holder.protected_code, holder.protected_why = protection(holder, config, own_chain, protected) or (None, "")
    holder.protected = holder.protected_code is not None
