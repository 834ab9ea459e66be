"""A helper process of a big holder scan (holders.scan_raw): its share of /proc, read here.

    python -m gpuguardd.engine.scanworker   (a JSON spec on stdin, JSON on stdout)

The spec names the PIDs and what concerns the watched nodes: their (st_dev, st_ino), their
device numbers, the drivers' majors and the maps tokens (DeviceMap). For each PID this prints
what the scanning process needs to decide, and nothing else: [pid, "unreadable"] when its fds
may not be read, else [pid, fds, maps lines] when it has an fd or a maps line that may be a
watched node ((st_dev, st_ino, st_rdev) each; lines as latin-1 text). Matching them against
the device map is holders.py's business, so the rules live in one place. Imports only the
standard library and procfs: a helper starts in ~20 ms.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from typing import Any

from gpuguardd.engine import procfs


def scan(spec: dict[str, Any]) -> list[list[Any]]:
    inodes = {(int(dev), int(ino)) for dev, ino in spec["inodes"]}
    rdevs = {int(rdev) for rdev in spec["rdevs"]}
    majors = {int(major) for major in spec["majors"]}
    tokens = [str(token).encode("latin-1") for token in spec["tokens"]]
    out: list[list[Any]] = []
    for pid in spec["pids"]:
        try:
            fds = [list(fd) for fd in procfs.char_device_fds(int(pid))
                   if (fd[0], fd[1]) in inodes or fd[2] in rdevs or os.major(fd[2]) in majors]
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                out.append([pid, "unreadable"])
            continue  # ENOENT, ESRCH: exited
        lines = procfs.maps_lines(int(pid), tokens)
        if fds or lines:
            out.append([pid, fds, [line.decode("latin-1") for line in lines]])
    return out


def main() -> None:
    json.dump(scan(json.load(sys.stdin)), sys.stdout)


if __name__ == "__main__":
    main()
