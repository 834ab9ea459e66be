"""Sweep reports kept across restarts: one JSON object a line in StateDirectory/history.jsonl.

Crash safety comes from the order of writes, not from luck:
  * a report is appended as one line with a single write() and fsync()ed before the sweep's
    D-Bus reply is sent, so a report the caller saw is on disk;
  * a daemon killed mid-write leaves at most a torn last line; loading drops it (it is the
    sweep that was in flight) and rewrites the file, so the next append starts on a fresh line;
  * whole-file rewrites (compaction, repair) go to a temporary file that is fsynced and renamed
    over the old one, then the directory is fsynced: readers see the old or the new file.
Lines that cannot be read are skipped and logged; a file with any such line is first renamed
aside to history.jsonl.corrupt-<timestamp>, so nothing is thrown away unseen.
The file is bounded: the newest `max_entries` are served, and the file is compacted once it
holds a tenth more than that (amortised: not a rewrite per sweep).
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger("gpuguard.history")

FILE_NAME = "history.jsonl"
FILE_MODE = 0o600


def _valid(entry: object) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("id"), str) and bool(entry["id"])


def _fsync_directory(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _encode(report: dict[str, Any]) -> bytes:
    # ensure_ascii keeps each record a single line whatever a process called itself.
    return (json.dumps(report, sort_keys=True, ensure_ascii=True, default=str) + "\n").encode("ascii")


class History:
    """Thread-safe: appends run in an executor thread, reads on the event loop."""

    def __init__(self, directory: str, max_entries: int) -> None:
        self.directory = directory
        self.path = os.path.join(directory, FILE_NAME)
        self.max_entries = max(1, max_entries)
        self._lock = threading.Lock()
        self._entries: collections.deque[dict[str, Any]] = collections.deque()
        self._lines_in_file = 0
        # False after a failed write: the file may end mid-line, so the next write rewrites it.
        self._file_clean = True
        self.persistent = True

    # -- loading -------------------------------------------------------------------------

    def load(self) -> None:
        with self._lock:
            self._load_locked()

    def _load_locked(self) -> None:
        try:
            os.makedirs(self.directory, mode=0o755, exist_ok=True)
            with open(self.path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            self._entries.clear()
            self._lines_in_file = 0
            return
        except OSError as exc:
            log.error("cannot read the sweep history %s: %s; history is kept in memory only "
                      "until the next restart", self.path, exc.strerror or exc)
            self.persistent = False
            return
        good, garbled, torn, unterminated = self._parse(data)
        if garbled:
            shown = ", ".join(str(n) for n in garbled[:10]) + (" ..." if len(garbled) > 10 else "")
            log.warning("sweep history %s: skipped %d unreadable line(s) (line %s)",
                        self.path, len(garbled), shown)
            why = (f"no readable report in it ({len(garbled)} unreadable line(s))" if not good
                   else f"{len(garbled)} unreadable line(s)")
            if not self._set_aside(why):
                # Rewriting would destroy what could not be moved away: leave the file alone.
                self.persistent = False
        if torn:
            log.warning("sweep history %s: dropped an incomplete last record (the daemon stopped "
                        "while writing it)", self.path)
        self._entries = collections.deque(good[-self.max_entries:])
        self._lines_in_file = len(good)
        if self.persistent and (garbled or torn or unterminated or len(good) > self.max_entries):
            self._rewrite_locked()

    def _parse(self, data: bytes) -> tuple[list[dict[str, Any]], list[int], bool, bool]:
        good: list[dict[str, Any]] = []
        garbled: list[int] = []
        lines = data.split(b"\n")
        # The piece after the last newline is empty in a clean file; otherwise it is a record
        # whose write was cut short, unless it happens to be complete (cut before the newline).
        tail = lines.pop()
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            entry = self._decode(line)
            if entry is None:
                garbled.append(number)
            else:
                good.append(entry)
        torn = unterminated = False
        if tail.strip():
            entry = self._decode(tail)
            if entry is None:
                torn = True
            else:
                # Complete, but the file needs its newline back before anything is appended.
                good.append(entry)
                unterminated = True
        return good, garbled, torn, unterminated

    @staticmethod
    def _decode(line: bytes) -> dict[str, Any] | None:
        try:
            entry = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return None
        return entry if _valid(entry) else None

    def _set_aside(self, why: str) -> bool:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = f"{self.path}.corrupt-{stamp}"
        suffix = 1
        while os.path.exists(target):
            suffix += 1
            target = f"{self.path}.corrupt-{stamp}.{suffix}"
        try:
            os.rename(self.path, target)
            _fsync_directory(self.directory)
        except OSError as exc:
            log.error("sweep history %s is damaged (%s) and could not be set aside: %s; new "
                      "reports are kept in memory only", self.path, why, exc.strerror or exc)
            return False
        log.error("sweep history %s is damaged (%s): moved to %s; readable reports are kept",
                  self.path, why, target)
        return True

    # -- writing -------------------------------------------------------------------------

    def append(self, report: dict[str, Any]) -> None:
        """Store one report durably (blocks on fsync: call from an executor)."""
        with self._lock:
            self._entries.append(report)
            while len(self._entries) > self.max_entries:
                self._entries.popleft()
            if not self.persistent:
                return
            if not self._file_clean or self._lines_in_file >= self._compact_at():
                self._rewrite_locked()
                return
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                             FILE_MODE)
            except OSError as exc:
                self._write_failed(exc)
                return
            try:
                created = self._lines_in_file == 0
                data = _encode(report)
                written = os.write(fd, data)
                if written != len(data):
                    raise OSError(f"short write ({written} of {len(data)} bytes)")
                os.fsync(fd)
                self._lines_in_file += 1
                if created:
                    _fsync_directory(self.directory)
            except OSError as exc:
                self._write_failed(exc)
            finally:
                os.close(fd)

    def _compact_at(self) -> int:
        return self.max_entries + max(10, self.max_entries // 10)

    def _write_failed(self, exc: OSError) -> None:
        self._file_clean = False
        log.error("cannot write the sweep history %s: %s (the report is kept in memory)",
                  self.path, exc.strerror or exc)

    def _rewrite_locked(self) -> None:
        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            os.makedirs(self.directory, mode=0o755, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
            try:
                with os.fdopen(fd, "wb", closefd=False) as handle:
                    for entry in self._entries:
                        handle.write(_encode(entry))
                    handle.flush()
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self.path)
            _fsync_directory(self.directory)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._write_failed(exc)
            return
        self._lines_in_file = len(self._entries)
        self._file_clean = True

    # -- reading -------------------------------------------------------------------------

    def newest(self, count: int) -> list[dict[str, Any]]:
        """Up to `count` reports, newest first (0: all that are kept)."""
        with self._lock:
            if count <= 0 or count >= len(self._entries):
                return list(reversed(self._entries))
            return list(itertools.islice(reversed(self._entries), count))

    def last(self) -> dict[str, Any] | None:
        with self._lock:
            return self._entries[-1] if self._entries else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def set_max_entries(self, max_entries: int) -> None:
        with self._lock:
            self.max_entries = max(1, max_entries)
            while len(self._entries) > self.max_entries:
                self._entries.popleft()
