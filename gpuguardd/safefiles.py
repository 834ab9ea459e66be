"""Opening files in directories someone else might write to, as root, without following links.

The daemon runs as root and writes its history and locks in directories a configuration names.
Should anyone be able to put a symbolic link there (a world-writable RuntimeDirectory=, a
mistake in permissions), following it would let them truncate or append to any file on the
host. So the last component is never followed (O_NOFOLLOW), and temporary files get a fresh
unpredictable name created exclusively (O_EXCL), as mkstemp() does.
"""

from __future__ import annotations

import os
import secrets

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def open_nofollow(path: str, flags: int, mode: int = 0o600) -> int:
    """os.open() that fails with ELOOP, instead of following, when `path` is a symbolic link."""
    return os.open(path, flags | NOFOLLOW, mode)


def create_temporary(directory: str, prefix: str, mode: int = 0o600) -> tuple[int, str]:
    """A new file in `directory` for writing: (fd, path). Never an existing file or link."""
    for _ in range(100):
        path = os.path.join(directory, prefix + secrets.token_hex(8))
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, mode), path
        except FileExistsError:
            continue
    raise FileExistsError(f"no unused temporary name in {directory}")
