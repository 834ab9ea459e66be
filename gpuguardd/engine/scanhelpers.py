"""A big /proc scan shared between this process and helper processes (holders.scan_raw).

The scan is kernel work: a stat() per open fd, and the kernel writing out each maps file (half
the cost: a path per mapped file). Threads would share the GIL, which every one of those calls
drops and takes back, and each hand-over waits for the other thread to be scheduled: two
threads measured slower than one. So a big scan is shared with helper processes
(engine/scanworker.py, the standard library and procfs only), one for each idle core:
  * the work is a queue (WorkQueue): chunks of the PID list, handed out through a pipe that
    every process takes the next chunk from, so a helper that starts late or a share that is
    slower to read costs no one a wait (fixed shares left this process reading alone for the
    last tenth of the scan);
  * a helper pins each process by a pidfd before reading it, as this process does, and passes
    the pidfds of what it reports over a socket (SCM_RIGHTS): its holders need no second read;
  * a helper that cannot start or fails is replaced by this process scanning the chunks it did
    not report.
Cores busy with other work gain nothing from more processes (measured: on a saturated machine
two took longer than one, helper start included), so only idle cores count (others_load): a
busy host scans in one process.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuguardd.engine.scanworker import RECORD, next_chunk

log = logging.getLogger("gpuguard.engine")

WORKERS_MAX = 4
# Below this many processes one process is quicker than starting a helper (~20 ms of CPU).
WORKER_MIN_PIDS = 400
WORKER_TIMEOUT_SEC = 300.0
# Chunks: small enough that the last ones even out the processes' finish, few enough that the
# whole queue fits the smallest pipe (one page) before anyone reads it.
CHUNK_MIN_PIDS = 16
CHUNKS_MAX = 4096 // RECORD.size


def others_load(loadavg: str) -> float:
    """How many cores other work keeps busy, from /proc/loadavg's text: the 1-minute load
    average, but no more than the runnable tasks now less this one. The load average alone
    counts this process too once it has been busy (a daemon scanning a big host every second,
    a benchmark's loop), and would keep the second core of an otherwise idle host unused; the
    runnable count alone is a single sample. The smaller of the two errs towards idle only
    where both say so."""
    fields = loadavg.split()
    load = float(fields[0])
    running = int(fields[3].split("/")[0]) - 1  # the reader itself is running
    return max(0.0, min(load, float(running)))


def scan_workers() -> int:
    """Processes a big scan is shared between: one for each idle core this process may run on
    (cores minus others_load(), rounded), at least 1, at most WORKERS_MAX (more only queue
    on the same /proc locks)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except OSError:
        cores = os.cpu_count() or 1
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            idle = cores - others_load(f.read())
    except (OSError, ValueError, IndexError):
        idle = 1.0
    return max(1, min(WORKERS_MAX, cores, int(idle + 0.5)))


class WorkQueue:
    """The PID list in chunks, their numbers in a pipe written whole before anyone reads (at most
    one page: it never blocks) and read without blocking: whoever reads next gets the next
    chunk, and an empty pipe means every chunk is taken."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.size = max(CHUNK_MIN_PIDS, -(-len(pids) // CHUNKS_MAX))
        self.count = -(-len(pids) // self.size)
        read_fd, write_fd = os.pipe()
        try:
            records = b"".join(RECORD.pack(index) for index in range(self.count))
            if os.write(write_fd, records) != len(records):
                raise OSError("the scan's work queue took less than it was given")
            os.set_blocking(read_fd, False)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.fd = read_fd

    def next(self) -> int | None:
        return next_chunk(self.fd)

    def chunk(self, index: int) -> list[int]:
        return self.pids[index * self.size:(index + 1) * self.size]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class HelperEntry:
    """One PID a helper reported: unreadable, or its candidate fds and maps lines, with the
    pidfd it was pinned by before it was read (None: not pinned, read it again)."""

    pid: int
    unreadable: bool = False
    fds: tuple[tuple[int, int, int], ...] = ()
    lines: tuple[bytes, ...] = ()
    pidfd: int | None = None


_helper_warned = False


def helper_failed(message: str, *args: object) -> None:
    """Say why a helper failed: a warning the first time (its chunks are scanned here, so the
    answer stands, but every big scan would take one process from then on), then debug."""
    global _helper_warned
    level = logging.DEBUG if _helper_warned else logging.WARNING
    _helper_warned = True
    log.log(level, "scan helper " + message + "; its share is scanned in this process", *args)


def _worker_env() -> dict[str, str]:
    """This process's environment, with the directory gpuguardd was imported from first on the
    path: `make install` puts the package where only the entry point's sys.path finds it (and
    the helper runs without site, -S: it needs nothing from site-packages)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


class Helper:
    """One helper process taking chunks from `queue`; `match` is what it keeps (scanworker)."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket | None) -> None:
        self.proc = proc
        self.sock = sock

    @classmethod
    def start(cls, queue: WorkQueue, match: dict[str, Any], pin: bool) -> Helper | None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) if pin else (None, None)
        spec = {**match, "pids": queue.pids, "chunk": queue.size, "queue_fd": queue.fd,
                "pidfd_socket": theirs.fileno() if theirs is not None else -1}
        passed = (queue.fd,) + ((theirs.fileno(),) if theirs is not None else ())
        try:
            proc = subprocess.Popen([sys.executable, "-S", "-m", "gpuguardd.engine.scanworker"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, close_fds=True, pass_fds=passed,
                                    env=_worker_env())
        except OSError as exc:
            helper_failed("did not start: %s", exc)
            if ours is not None:
                ours.close()
            return None
        finally:
            if theirs is not None:
                theirs.close()  # the helper's now: its end of file is the end of the pidfds
        helper = cls(proc, ours)
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(spec).encode())  # read whole before it scans
            proc.stdin.close()
            proc.stdin = None  # sent: communicate() then only reads the answer
        except OSError as exc:
            helper_failed("%d did not take its spec: %s", proc.pid, exc)
            helper.end()
            return None
        return helper

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.sock is not None:
            self.sock.close()

    def _pidfds(self, deadline: float) -> dict[int, int]:
        """{pid: pidfd} the helper sent, until it closed the socket."""
        received: dict[int, int] = {}
        if self.sock is None:
            return received
        try:
            while True:
                self.sock.settimeout(max(0.001, deadline - time.monotonic()))
                data, fds, _, _ = socket.recv_fds(self.sock, 65536, 256, socket.MSG_CMSG_CLOEXEC)
                if not data and not fds:
                    return received  # closed: all sent
                try:
                    pids = [int(p) for p in json.loads(data)]
                except (ValueError, TypeError) as exc:
                    raise ValueError(f"pidfds for {data[:80]!r}") from exc
                # Fewer fds than PIDs only if the kernel cut them (no room here): the first ones.
                for pid, fd in zip(pids, fds):
                    if pid in received:
                        os.close(received[pid])
                    received[pid] = fd
                for fd in fds[len(pids):]:
                    os.close(fd)
        except BaseException:
            for fd in received.values():
                os.close(fd)
            raise

    def results(self) -> tuple[list[int], list[HelperEntry]] | None:
        """(the chunks it scanned, what it reported), its pidfds now this process's; None if
        it failed (its chunks are then not done). Ends the helper."""
        deadline = time.monotonic() + WORKER_TIMEOUT_SEC
        pidfds: dict[int, int] = {}
        try:
            pidfds = self._pidfds(deadline)
            out, _ = self.proc.communicate(timeout=max(0.001, deadline - time.monotonic()))
            answer = json.loads(out) if self.proc.returncode == 0 else None
            if not isinstance(answer, dict):
                helper_failed("%d failed (exit %s)", self.proc.pid, self.proc.returncode)
                return None
            return _parse(answer, pidfds)
        except (subprocess.TimeoutExpired, ValueError, OSError) as exc:
            helper_failed("%d failed: %s", self.proc.pid, exc)
            return None
        except (TypeError, KeyError, IndexError, UnicodeError) as exc:  # a helper's bug: not ours to pass on
            helper_failed("%d answered what it should not: %s", self.proc.pid, exc)
            return None
        finally:
            for fd in pidfds.values():
                os.close(fd)  # those _parse did not hand on
            self.end()


def _parse(answer: dict[str, Any], pidfds: dict[int, int]) -> tuple[list[int], list[HelperEntry]]:
    """A helper's answer as records, each pidfd taken out of `pidfds` by the entry it pins."""
    chunks = [int(index) for index in answer["chunks"]]
    entries: list[HelperEntry] = []
    try:
        for item in answer["entries"]:
            pid = int(item[0])
            if pid <= 0:
                raise ValueError(f"pid {pid}")
            if item[1] == "unreadable":
                entries.append(HelperEntry(pid, unreadable=True))
                continue
            fds = tuple((int(a), int(b), int(c)) for a, b, c in item[1])
            lines = tuple(str(line).encode("latin-1") for line in item[2])
            entries.append(HelperEntry(pid, fds=fds, lines=lines, pidfd=pidfds.pop(pid, None)))
    except BaseException:
        for entry in entries:
            if entry.pidfd is not None:
                os.close(entry.pidfd)
        raise
    return chunks, entries
