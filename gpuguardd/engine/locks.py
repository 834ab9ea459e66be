"""One sweep per GPU at a time, across threads of the daemon and `gpuguardctl --local` runs.

flock() locks belong to an open file description, so two opens of the same lock file conflict
within one process as well as between processes: one mechanism serves both.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterable

from gpuguardd.safefiles import open_nofollow

UNKNOWN_GPU = "unknown"  # the lock of holders whose GPU nobody can name (control devices only, no NVML)


class GpuLocks:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._fds: list[int] = []
        self.waited = False  # the last acquire() waited for another sweep: an earlier scan is stale
        self.busy = False  # the last acquire(wait=False) found a GPU locked

    def acquire(self, gpus: Iterable[object], wait: bool = True) -> str | None:
        """In a fixed order (no deadlock); a warning if locking is off. wait=False: `busy`, not a wait."""
        try:
            os.makedirs(self.directory, mode=0o755, exist_ok=True)
        except OSError as exc:
            return f"cannot create lock directory {self.directory}: {exc.strerror}; sweeps are not serialized"
        self.waited = self.busy = False
        for name in sorted({str(g) for g in gpus}):
            path = os.path.join(self.directory, f"gpu-{name}.lock")
            try:
                # Never through a symbolic link: as root that would create or lock any file.
                fd = open_nofollow(path, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as exc:
                self.release()
                why = "a symbolic link, not followed" if exc.errno == errno.ELOOP else exc.strerror
                return f"cannot open {path}: {why}; sweeps are not serialized"
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    os.close(fd)
                    self.release()
                    self.busy = True
                    return None
                self.waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            self._fds.append(fd)
        return None

    def release(self) -> None:
        while self._fds:
            fd = self._fds.pop()
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
