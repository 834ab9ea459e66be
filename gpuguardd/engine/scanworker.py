"""A helper process of a big holder scan (engine/scanhelpers.py): chunks of /proc, read here.

    python -S -m gpuguardd.engine.scanworker   (a JSON spec on stdin, JSON on stdout)

The spec names the PIDs, the chunk size, the fd of the work queue (a pipe of chunk numbers that
this process and the scanning one both take from, so that neither waits for the other), the fd
of a socket for pidfds (-1: none), and what concerns the watched nodes: their (st_dev, st_ino),
their device numbers, the drivers' majors and the maps tokens (DeviceMap). For each PID of each
chunk taken this reports what the scanning process needs to decide, and nothing else:
[pid, "unreadable"] when its fds may not be read, else [pid, fds, maps lines] when it has an fd
or a maps line that may be a watched node ((st_dev, st_ino, st_rdev) each; lines as latin-1
text). With a socket each process is pinned by a pidfd before it is read, as in the scanning
process, and the pidfds of those reported are sent there (SCM_RIGHTS, a message of PIDs and
their pidfds per batch), before the answer on stdout: {"chunks": [...], "entries": [...]}.
Matching is holders.py's business, so the rules live in one place. Imports only the standard
library and procfs: a helper starts in ~20 ms.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import sys
from typing import Any

from gpuguardd.engine import procfs

# The work queue: chunk numbers of this size, all written before anyone reads, so a read of one
# record always gets a whole one and an empty queue means the work is handed out.
RECORD = struct.Struct("=I")
# SCM_RIGHTS carries at most 253 fds a message (the kernel's SCM_MAX_FD).
PIDFD_BATCH = 200


def next_chunk(queue_fd: int) -> int | None:
    """The next chunk's number from the (non-blocking) queue, or None when none is left."""
    try:
        data = os.read(queue_fd, RECORD.size)
    except BlockingIOError:
        return None
    if len(data) != RECORD.size:
        return None
    index: int = RECORD.unpack(data)[0]
    return index


def _scan_pid(pid: int, match: tuple[set[tuple[int, int]], set[int], set[int], list[bytes]],
              pin: bool) -> tuple[list[Any] | None, int | None]:
    """This PID's entry (None: nothing to report) and its pidfd when it is reported pinned."""
    inodes, rdevs, majors, tokens = match
    pidfd = None
    if pin:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None, None  # exited
        except OSError:
            pidfd = None  # e.g. EMFILE: the scanning process pins it later and reads it again
    try:
        fds = [list(fd) for fd in procfs.char_device_fds(pid)
               if (fd[0], fd[1]) in inodes or fd[2] in rdevs or os.major(fd[2]) in majors]
    except OSError as exc:
        if pidfd is not None:
            os.close(pidfd)
        # ENOENT, ESRCH: exited
        return ([pid, "unreadable"] if exc.errno in (errno.EACCES, errno.EPERM) else None), None
    lines = procfs.maps_lines(pid, tokens)
    if fds or lines:
        return [pid, fds, [line.decode("latin-1") for line in lines]], pidfd
    if pidfd is not None:
        os.close(pidfd)
    return None, None


def scan(spec: dict[str, Any], pidfd_socket: socket.socket | None = None) -> dict[str, Any]:
    match = ({(int(dev), int(ino)) for dev, ino in spec["inodes"]},
             {int(rdev) for rdev in spec["rdevs"]},
             {int(major) for major in spec["majors"]},
             [str(token).encode("latin-1") for token in spec["tokens"]])
    pids = [int(pid) for pid in spec["pids"]]
    size = int(spec["chunk"])
    chunks: list[int] = []
    entries: list[list[Any]] = []
    pinned: list[tuple[int, int]] = []
    try:
        while (index := next_chunk(int(spec["queue_fd"]))) is not None:
            chunks.append(index)
            for pid in pids[index * size:(index + 1) * size]:
                entry, pidfd = _scan_pid(pid, match, pidfd_socket is not None)
                if entry is not None:
                    entries.append(entry)
                if pidfd is not None:
                    pinned.append((pid, pidfd))
        if pidfd_socket is not None:
            send_pidfds(pidfd_socket, pinned)
    finally:
        for _, pidfd in pinned:
            os.close(pidfd)
    return {"chunks": chunks, "entries": entries}


def send_pidfds(sock: socket.socket, pinned: list[tuple[int, int]]) -> None:
    """Send the pidfds, a batch a message; stop at the first refusal (e.g. ETOOMANYREFS, too
    many fds in flight): the scanning process pins the rest itself."""
    for start in range(0, len(pinned), PIDFD_BATCH):
        batch = pinned[start:start + PIDFD_BATCH]
        try:
            socket.send_fds(sock, [json.dumps([pid for pid, _ in batch]).encode()],
                            [pidfd for _, pidfd in batch])
        except OSError:
            return


def main() -> None:
    spec = json.load(sys.stdin)
    fd = int(spec.get("pidfd_socket", -1))
    sock = socket.socket(fileno=fd) if fd >= 0 else None
    try:
        answer = scan(spec, sock)
    finally:
        if sock is not None:
            sock.close()  # end of pidfds: the scanning process then reads the answer
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
