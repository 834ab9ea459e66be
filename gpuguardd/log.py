"""Logging to stderr with sd-daemon priority prefixes, so journald keeps each line's level. Both
formatters escape the formatted message: a process named "x\\n<3>forged" stays one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from typing import Any

from gpuguardd.escaping import escape_text

_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


def _escape_exception_texts(described: traceback.TracebackException, seen: set[int]) -> None:
    if id(described) in seen:
        return
    seen.add(id(described))
    described._str = escape_text(described._str)  # type: ignore[attr-defined]
    for linked in (described.__cause__, described.__context__):
        if linked is not None:
            _escape_exception_texts(linked, seen)


class SdDaemonFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_text(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        # Each traceback line gets the prefix; an exception's text, escaped, cannot add lines.
        try:
            described = traceback.TracebackException(*ei[:3])
            _escape_exception_texts(described, set())
            text = "".join(described.format())
        except Exception:  # _str is CPython's; without it each line is still escaped
            text = super().formatException(ei)
        return "\n".join(escape_text(line) for line in text.rstrip("\n").split("\n"))

    def format(self, record: logging.LogRecord) -> str:
        priority = _PRIORITY.get(record.levelno, 6)
        text = super().format(record)
        # Every line of a multi-line message keeps the prefix, or journald would demote it.
        return "\n".join(f"<{priority}>{line}" for line in text.splitlines() or [""])


class PlainFormatter(logging.Formatter):
    def __init__(self, program: str) -> None:
        super().__init__()
        self.program = program

    def format(self, record: logging.LogRecord) -> str:
        label = {logging.WARNING: "warning: ", logging.ERROR: "error: ",
                 logging.CRITICAL: "error: "}.get(record.levelno, "")
        return f"{self.program}: {label}{escape_text(record.getMessage())}"


def under_journald() -> bool:
    """True when stderr is connected to the journal (systemd sets JOURNAL_STREAM to match)."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return stream == f"{st.st_dev}:{st.st_ino}"


def setup_logging(program: str, level: int = logging.INFO, sd_daemon: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SdDaemonFormatter("%(message)s") if sd_daemon or under_journald() else PlainFormatter(program))
    root = logging.getLogger("gpuguard")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


JOURNAL_SOCKET = "/run/systemd/journal/socket"


def journal_too(program: str, level: int, message: str) -> None:
    """Also journal `message` when stderr goes elsewhere (a daemon vanishing mid-sweep); best effort."""
    if under_journald() or not os.path.exists(JOURNAL_SOCKET):
        return
    import socket

    text = (f"PRIORITY={_PRIORITY.get(level, 6)}\nSYSLOG_IDENTIFIER={program}\n"
            f"MESSAGE={escape_text(message)}\n")
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(text.encode("utf-8", "backslashreplace"), JOURNAL_SOCKET)
