"""Sweep reports kept across restarts: one JSON object a line in StateDirectory/history.jsonl.

Crash safety is the order of writes: a report is appended in one write() and fsync()ed before
the sweep's D-Bus reply; a torn last line is dropped at load; whole-file rewrites (compaction a
tenth over `max_entries`, repair) go through a temporary renamed over the file. A file with
unreadable lines is first renamed aside (history.jsonl.corrupt-<timestamp>), never lost unseen.

A report that cannot be written (full disk, I/O error) is served from memory and written later;
a failed append is cut back off (ftruncate), so a full disk needs room only for missing lines.
"""

from __future__ import annotations

import collections
import errno
import itertools
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import BinaryIO

from gpuguardd import safetext
from gpuguardd.records.codec import Wire
from gpuguardd.records.report import Report
from gpuguardd.safefiles import fsync_directory, open_nofollow, write_atomic

log = logging.getLogger("gpuguard.history")

FILE_NAME = "history.jsonl"
FILE_MODE = 0o600
# A longer line is no report gpuguard wrote: skipped as unreadable, never held in memory.
MAX_LINE = 64 * 1024 * 1024
_PIECE = 1024 * 1024
# Only non-ASCII bytes or JSON escapes of surrogates or NUL can be bad UTF-8: others skip repair.
_MAY_NEED_REPAIR = re.compile(rb"[\x80-\xff]|\\u[dD][89a-fA-F]|\\u0000")
# After a failed write: the first retry, and the longest wait between retries (doubling).
RETRY_SEC = 2.0
RETRY_MAX_SEC = 60.0


def _read_line(handle: BinaryIO) -> bytes | None:
    """The next line; None at the end; b"" for a line over MAX_LINE (read in pieces, never held)."""
    piece = handle.readline(_PIECE)
    if not piece:
        return None
    if piece.endswith(b"\n") or len(piece) < _PIECE:
        return piece
    pieces, size = [piece], len(piece)
    while piece and not piece.endswith(b"\n"):
        piece = handle.readline(_PIECE)
        size += len(piece)
        if size > MAX_LINE:
            pieces.clear()
        elif pieces:
            pieces.append(piece)
    return b"".join(pieces)


@dataclass
class _Scan:
    entries: collections.deque[Wire]
    good: int = 0  # readable reports in the file (entries keeps only the newest)
    garbled: list[int] = field(default_factory=list)  # the first unreadable line numbers
    garbled_count: int = 0
    torn: bool = False
    unterminated: bool = False
    repaired: int = 0

    def garble(self, number: int) -> None:
        self.garbled_count += 1
        if len(self.garbled) < 10:
            self.garbled.append(number)


def _write_all(fd: int, data: bytes) -> None:
    """A short write is followed by another, which fails with the reason (ENOSPC, EDQUOT, EIO)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, f"write() wrote nothing ({len(view)} bytes left)")
        view = view[written:]


def _encode(report: Wire) -> bytes:
    # ensure_ascii keeps each record a single line whatever a process called itself.
    return (json.dumps(report, sort_keys=True, ensure_ascii=True, default=str) + "\n").encode("ascii")


class History:
    """Thread-safe: appends run in an executor thread, reads on the event loop."""

    def __init__(self, directory: str, max_entries: int) -> None:
        self.directory = directory
        self.path = os.path.join(directory, FILE_NAME)
        self.max_entries = max(1, max_entries)
        self._lock = threading.Lock()
        # Records as stored (their wire form): a record of any shape is served as it was read.
        self._entries: collections.deque[Wire] = collections.deque(maxlen=self.max_entries)
        self._last: tuple[Wire, Report] | None = None  # the newest entry, and it typed
        self._lines_in_file = 0
        # False after a failed write that could not be cut back off: the next write rewrites.
        self._file_clean = True
        # The newest this many entries are not in the file yet (writes failed).
        self._unwritten = 0
        self._retry: threading.Timer | None = None
        self._retry_sec = RETRY_SEC
        self.persistent = True

    def load(self) -> None:
        with self._lock:
            scan = _Scan(collections.deque(maxlen=self.max_entries))
            try:
                os.makedirs(self.directory, mode=0o755, exist_ok=True)
                with os.fdopen(open_nofollow(self.path, os.O_RDONLY), "rb") as handle:
                    scan = self._scan(handle)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    log.error("cannot read the sweep history %s: %s; history is kept in memory only "
                              "until the next restart", self.path, exc.strerror or exc)
                    self.persistent = False
                    return
                # Never followed: the next write replaces the link itself (rename), not its target.
                log.error("sweep history %s is a symbolic link: not followed, and replaced by a "
                          "new file at the next report", self.path)
                self._file_clean = False
            if scan.garbled:
                count = scan.garbled_count
                shown = ", ".join(map(str, scan.garbled)) + (" ..." if count > 10 else "")
                log.warning("sweep history %s: skipped %d unreadable line(s) (line %s)", self.path, count, shown)
                why = f"no readable report in it ({count} unreadable line(s))" if not scan.good \
                    else f"{count} unreadable line(s)"
                if not self._set_aside(why):
                    # Rewriting would destroy what could not be moved away: leave the file alone.
                    self.persistent = False
            if scan.torn:
                log.warning("sweep history %s: dropped an incomplete last record (the daemon stopped "
                            "while writing it)", self.path)
            if scan.repaired:
                log.warning("sweep history %s: %d report(s) held text that is not valid UTF-8; "
                            "repaired (bad bytes written as \\xNN escapes)", self.path, scan.repaired)
            self._entries = scan.entries
            self._lines_in_file = scan.good
            if self.persistent and (scan.garbled or scan.torn or scan.unterminated or scan.repaired
                                    or scan.good > self.max_entries):
                self._rewrite_locked()

    def _scan(self, handle: BinaryIO) -> _Scan:
        scan = _Scan(collections.deque(maxlen=self.max_entries))
        number = 0
        while True:
            line = _read_line(handle)
            if line is None:
                break
            number += 1
            if not line:  # no report is this big: skipped without being held
                scan.garble(number)
                continue
            last = not line.endswith(b"\n")  # torn, unless complete
            if not line.strip():
                continue
            entry = self._decode(line)
            if entry is None:
                if last:
                    scan.torn = True
                else:
                    scan.garble(number)
                continue
            if _MAY_NEED_REPAIR.search(line):
                entry, changed = safetext.repair(entry)
                scan.repaired += changed
            scan.entries.append(entry)
            scan.good += 1
            # Complete, but the file needs its newline back before anything is appended.
            scan.unterminated = last
        return scan

    @staticmethod
    def _decode(line: bytes) -> Wire | None:
        try:
            # surrogateescape: a raw bad byte is repaired with the rest, not a lost record.
            entry = json.loads(line.decode("utf-8", "surrogateescape"))
        except (ValueError, RecursionError):
            return None
        valid = isinstance(entry, dict) and isinstance(entry.get("id"), str) and bool(entry["id"])
        return entry if valid else None

    def _set_aside(self, why: str) -> bool:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = f"{self.path}.corrupt-{stamp}"
        suffix = 1
        while os.path.exists(target):
            suffix += 1
            target = f"{self.path}.corrupt-{stamp}.{suffix}"
        try:
            os.rename(self.path, target)
            fsync_directory(self.directory)
        except OSError as exc:
            log.error("sweep history %s is damaged (%s) and could not be set aside: %s; new "
                      "reports are kept in memory only", self.path, why, exc.strerror or exc)
            return False
        log.error("sweep history %s is damaged (%s): moved to %s; readable reports are kept", self.path, why, target)
        return True

    def append(self, record: Report) -> None:
        """Blocks on fsync: call from an executor."""
        report, _ = safetext.repair(record.to_dict())  # what is read back must be sendable as it is
        with self._lock:
            self._entries.append(report)
            self._last = (report, record)
            if not self.persistent:
                return
            self._unwritten = min(self._unwritten + 1, len(self._entries))
            if not self._write_locked() and self._unwritten:
                log.error("sweep history %s: report %s is not on disk (kept in memory and "
                          "served; written once the file can be written, retried in the "
                          "background)", self.path, str(report.get("id", ""))[:8])

    def flush(self) -> bool:
        """Write what earlier writes could not; True when nothing is left unwritten."""
        with self._lock:
            return self._write_locked()

    def _write_locked(self) -> bool:
        if not self.persistent or (self._file_clean and not self._unwritten):
            return True
        retried = self._retry is not None or self._retry_sec > RETRY_SEC
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        # The entries not yet in the file; older ones beyond max_entries are dropped anyway.
        count = min(self._unwritten, len(self._entries))
        compact_at = self.max_entries + max(10, self.max_entries // 10)
        if not self._file_clean or self._lines_in_file == 0 or self._lines_in_file + count >= compact_at:
            written = self._rewrite_locked()
        else:
            written = self._append_locked(count)
        if not written:
            self._schedule_retry()
            return False
        if retried:
            log.warning("sweep history %s written again: %d report(s) that could not be "
                        "written earlier are now on disk", self.path, count)
        self._unwritten = 0
        self._retry_sec = RETRY_SEC
        return True

    def _append_locked(self, count: int) -> bool:
        """One write; a failure cuts it back off."""
        try:
            fd = open_nofollow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        except OSError as exc:
            self._write_failed(exc)
            return False
        try:
            size = os.fstat(fd).st_size
            data = b"".join(_encode(entry) for entry in
                            itertools.islice(self._entries, len(self._entries) - count, None))
            try:
                _write_all(fd, data)
                os.fsync(fd)
            except OSError as exc:
                try:  # the file as it was, or else marked for a rewrite
                    os.ftruncate(fd, size)
                    os.fsync(fd)
                except OSError:
                    self._file_clean = False
                self._write_failed(exc)
                return False
        finally:
            os.close(fd)
        self._lines_in_file += count
        return True

    def _write_failed(self, exc: OSError) -> None:
        # The first failure is an error; the background retries' failures are not news.
        level = logging.DEBUG if self._retry_sec > RETRY_SEC else logging.ERROR
        log.log(level, "cannot write the sweep history %s: %s", self.path, exc.strerror or exc)

    def _schedule_retry(self) -> None:
        self._retry = threading.Timer(self._retry_sec, self._retry_now)
        self._retry.daemon = True  # never holds up the daemon's exit
        self._retry.start()
        self._retry_sec = min(self._retry_sec * 2, RETRY_MAX_SEC)

    def _retry_now(self) -> None:
        with self._lock:
            if self._retry is None:
                return  # cancelled, or written by an append meanwhile
            self._retry = None
            self._write_locked()

    def _rewrite_locked(self) -> bool:
        try:
            os.makedirs(self.directory, mode=0o755, exist_ok=True)
            write_atomic(self.path, (_encode(entry) for entry in self._entries),
                         prefix=f"{FILE_NAME}.tmp-", mode=FILE_MODE, fsync_dir=True)
        except OSError as exc:
            self._write_failed(exc)
            self._file_clean = False
            return False
        self._lines_in_file = len(self._entries)
        self._file_clean = True
        return True

    def newest(self, count: int) -> list[Wire]:
        """Up to `count` reports as stored, newest first (0: all that are kept)."""
        with self._lock:
            return list(itertools.islice(reversed(self._entries), count if count > 0 else None))

    def last(self) -> Report | None:
        """Typed once per newest entry (the status line asks often; a report may hold 40,000 targets)."""
        with self._lock:
            if not self._entries:
                return None
            newest = self._entries[-1]
            if self._last is None or self._last[0] is not newest:
                self._last = (newest, Report.from_dict(newest))
            return self._last[1]

    def set_max_entries(self, max_entries: int) -> None:
        with self._lock:
            self.max_entries = max(1, max_entries)
            self._entries = collections.deque(self._entries, maxlen=self.max_entries)
            self._unwritten = min(self._unwritten, len(self._entries))
