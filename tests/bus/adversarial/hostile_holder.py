"""Holders whose names are chosen by a hostile user: bytes that are not UTF-8 in their argv and
in their executable's path, and argv as long as the kernel allows.

tests/holder.py does the holding; it is run through `python -c` so that anything can follow
its own arguments in /proc/<pid>/cmdline, and optionally by a copy of the interpreter under a
directory whose name is not UTF-8, so that /proc/<pid>/exe has such bytes too.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from tests.conftest import HOLDER, GpuHost, Proc
from tests.dbus_harness import COMM, PRIVATE_MINOR, private_gpu

# python -c CODE HOLDER ARGS... -- JUNK...: sys.argv is ['-c', HOLDER, ARGS..., '--', JUNK...].
RUN_HOLDER = ("import runpy, sys; a = sys.argv[1:]; "
              "sys.argv = a[:a.index('--')] if '--' in a else a; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")

# The kernel's limit for one argument (MAX_ARG_STRLEN, 32 pages) less the NUL.
ARG_MAX_ONE = 32 * 4096 - 1


def odd_interpreter(where: Path, name: bytes = b"bin-\xff\xfe") -> bytes:
    """A copy of this interpreter under `where`/`name` (bytes: need not be UTF-8)."""
    directory = os.path.join(os.fsencode(where), name)
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, b"python3")
    if not os.path.exists(target):
        shutil.copy2(os.fsencode(os.path.realpath(sys.executable)), target)
    return target


def spawn(host: GpuHost, junk: list[bytes], exe: bytes | None = None, used: int = 1 << 30,
          comm: str = COMM, hold: str = "") -> Proc:
    """A compute holder (listed by the fake NVML with `used` bytes) of `hold` (default: the
    private GPU's node), with `junk` after its own arguments."""
    index = private_gpu(host)
    node = hold or str(host.dev / f"nvidia{PRIVATE_MINOR}")
    argv: list[bytes] = [exe or os.fsencode(sys.executable), b"-c", RUN_HOLDER.encode(),
                         os.fsencode(str(HOLDER)), b"--hold", node.encode(), b"--comm",
                         comm.encode(), b"--", *junk]
    proc = host.start(argv)
    host.state.add_proc(index, proc.pid, used)
    host.publish()
    return proc
