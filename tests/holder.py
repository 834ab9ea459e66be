"""A real process that holds test GPU device nodes the way CUDA programs and tools do.

Run by the tests (never imported): opens and maps the nodes named on the command line, prints
"ready <pid>" on stdout, and sleeps until killed. Nodes whose major has no driver on the test
machine can only be opened O_PATH; the fd in /proc/<pid>/fd looks the same to a scanner.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import re
import signal
import sys
import time


def set_comm(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_NAME = 15
    libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def open_node(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR)
    except OSError:
        return os.open(path, os.O_PATH)


def cuda_nodes(devdir: str) -> list[str]:
    """What a CUDA process holds whichever GPU it computes on: every GPU's node, nvidiactl and
    nvidia-uvm (cupy issue 1930: a process on GPU 0 of eight holds /dev/nvidia0 ... 7). Which
    GPU it really uses only NVML's per-GPU lists say."""
    gpus = sorted(name for name in os.listdir(devdir) if re.fullmatch(r"nvidia[0-9]+", name))
    return [os.path.join(devdir, name) for name in [*gpus, "nvidiactl", "nvidia-uvm"]]


def map_and_close(path: str) -> int:
    """mmap through libc: Python's mmap object keeps a dup of the fd, and the point here is a
    process that holds the device by its mapping alone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    fd = os.open(path, os.O_RDWR)
    address = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    os.close(fd)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap {path}")
    return int(address)


def fork_then_exit(signum: int, frame: object) -> None:
    """The child inherits every fd and mapping, and ends on the next SIGTERM."""
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sys.stdout.write(f"child {os.getpid()}\n")
        sys.stdout.flush()
        return  # back to the parent's sleep, holding what it held
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold", action="append", default=[], help="keep an fd on this node")
    parser.add_argument("--mmap", action="append", default=[], help="map this node, close the fd")
    parser.add_argument("--cuda", metavar="DEVDIR", default="",
                        help="hold every GPU node in DEVDIR, nvidiactl and nvidia-uvm, as CUDA does")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--setsid", action="store_true")
    parser.add_argument("--comm", default="")
    parser.add_argument("--spawn-zombie", action="store_true",
                        help="fork a child that exits at once and is never reaped; print its pid")
    parser.add_argument("--fork-on-term", action="store_true",
                        help="on SIGTERM, fork a child that keeps holding (printing \"child <pid>\"), "
                             "then exit: a dying worker that leaves a holder behind")
    args = parser.parse_args()
    if args.setsid:
        os.setsid()
    if args.comm:
        set_comm(args.comm)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.fork_on_term:
        signal.signal(signal.SIGTERM, fork_then_exit)
    fds = [open_node(path) for path in [*args.hold, *(cuda_nodes(args.cuda) if args.cuda else [])]]
    maps = [map_and_close(path) for path in args.mmap]
    extra = ""
    if args.spawn_zombie:
        child = os.fork()
        if child == 0:
            os._exit(0)
        extra = f" zombie={child}"
    sys.stdout.write(f"ready {os.getpid()}{extra}\n")
    sys.stdout.flush()
    # fds and maps stay referenced for the life of the process: that is the point.
    while fds is not None and maps is not None:
        time.sleep(3600)


if __name__ == "__main__":
    main()
