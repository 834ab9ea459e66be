"""sd_notify(3) for systemd's Type=notify: readiness, status line, watchdog, stopping."""

from __future__ import annotations

import os
import time

import sdnotify

from gpuguardd.numbers import is_digits


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None without a watchdog."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not is_digits(usec) or len(usec) > 20 or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None  # meant for another process (we were started by a wrapper)
    return int(usec) / 2 / 1_000_000


class Notifier:
    def __init__(self) -> None:
        self._notifier = sdnotify.SystemdNotifier()
        sock = getattr(self._notifier, "socket", None)
        if sock is not None:
            # A datagram send blocks while the receiver's queue is full (systemd busy, or a
            # test that stopped reading), and it runs on the event loop: drop the update
            # instead (sdnotify swallows the EAGAIN). The next STATUS= supersedes it anyway.
            sock.setblocking(False)
        self._status = ""

    def send(self, *lines: str) -> None:
        self._notifier.notify("\n".join(lines))

    def ready(self, status: str) -> None:
        self._status = _one_line(status)
        self.send("READY=1", f"STATUS={self._status}")

    def status(self, status: str) -> None:
        text = _one_line(status)
        if text != self._status:
            self._status = text
            self.send(f"STATUS={text}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def reloading(self) -> None:
        # MONOTONIC_USEC lets Type=notify-reload (systemd 253+) match this to its SIGHUP.
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def reloaded(self) -> None:
        self.send("READY=1", f"STATUS={self._status}")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=stopping")

    def extend_timeout(self, seconds: float) -> None:
        """`seconds` more before systemd's stop timeout fires (systemd 236+)."""
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")


def _one_line(text: str) -> str:
    # sdnotify encodes as Latin-1 and a newline would start a new assignment.
    return "".join(c if c.isprintable() and ord(c) < 256 else "?" for c in text)
