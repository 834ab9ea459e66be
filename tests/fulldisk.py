"""A full disk for the tests: a tiny tmpfs mounted on a directory (root only), filled to the
last page, and always unmounted again (a test run leaves no mounts: tests/leftovers.py).

tmpfs gives files whole 4 KiB pages: a write into the free end of a file's last page succeeds
on a full file system, a write that needs one more page fails with ENOSPC.
"""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PAGE = 4096


@contextmanager
def tiny_tmpfs(path: Path, size: int) -> Iterator[Path]:
    """`path` (made if missing) with a tmpfs of `size` bytes on it, for the with block."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "gpuguard-test",
                    str(path)], check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], check=False).returncode != 0:
            # Something still has a file open there: detach it now, freed when closed.
            subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(path: Path, limit: int | None = None) -> int:
    """Write `path` until the file system is full (or `limit` bytes); the bytes written."""
    written = 0
    with open(path, "wb", buffering=0) as handle:
        while limit is None or written < limit:
            try:
                written += handle.write(b"\0" * min(PAGE, PAGE if limit is None else limit - written))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    return written
