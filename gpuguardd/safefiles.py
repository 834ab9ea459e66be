"""Files root opens in directories a configuration names: a link planted there (a world-writable
RuntimeDirectory=) would let anyone truncate any file. So the last component is never followed
(O_NOFOLLOW), and temporaries get a fresh random name, created exclusively (O_EXCL).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def open_nofollow(path: str, flags: int, mode: int = 0o600) -> int:
    """os.open() that fails with ELOOP when `path` is a symbolic link."""
    return os.open(path, flags | NOFOLLOW, mode)


def fsync_directory(path: str) -> None:
    """Make a rename in `path` durable (best effort: some file systems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: str, chunks: Iterable[bytes], prefix: str, mode: int = 0o644,
                 fsync: bool = True, fsync_dir: bool = False) -> None:
    """Replace `path` at once, readers seeing the old file or the new, with exactly `mode` (not the
    umask's). A failure leaves `path` and no temporary."""
    directory = os.path.dirname(path) or "."
    temporary = os.path.join(directory, prefix + secrets.token_hex(8))
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(fd, mode)
            handle.writelines(chunks)
            handle.flush()
            if fsync:
                os.fsync(fd)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    if fsync_dir:
        fsync_directory(directory)
