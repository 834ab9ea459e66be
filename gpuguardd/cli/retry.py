"""A sweep that outlives gpuguardd: the caller finishes what the daemon's death cut short.

When gpuguardd dies during a sweep (a crash, an OOM kill, an upgrade), the stop hook would
exit with the unit's GPUs still held. Instead the request is sent again once the daemon is
back: a sweep is safe to repeat, and the restarted daemon, which finishes its predecessor's
sweep itself (daemon/resume.py), lets the second call join it. If none answers within
RETRY_SEC, root sweeps with the local engine. The words also go to the journal, which an
admin's terminal does not reach.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from collections.abc import Callable

from gpuguardd.cli.backend import Backend, LocalBackend, local
from gpuguardd.errors import DaemonUnavailable
from gpuguardd.log import journal_too
from gpuguardd.records.models import SweepRequest
from gpuguardd.records.report import Report

log = logging.getLogger("gpuguard.cli")

# Under the drop-in's 80 s timeout even after a long sweep; systemd's Restart=on-failure
# (RestartSec=1s) brings the daemon back in a second or two.
RETRY_SEC = 30.0
RETRY_INTERVAL_SEC = 0.5


def _say(level: int, message: str) -> None:
    log.log(level, "%s", message)
    journal_too("gpuguardctl", level, message)


def sweep(first: Callable[[], Report], again: Callable[[], Report],
          local: Callable[[], Report], request: SweepRequest,
          retry_sec: float = RETRY_SEC) -> Report:
    """`first()` the sweep through the daemon; if the daemon vanishes during it, `again()`
    (a new connection) until it answers or `retry_sec` pass, then `local()` as root."""
    try:
        return first()
    except DaemonUnavailable as exc:
        what = f"the sweep of {request.unit or 'its scope'}"
        _say(logging.WARNING, f"gpuguardd stopped during {what} ({exc}); retrying")
    deadline = time.monotonic() + retry_sec
    last: Exception | None = None
    while time.monotonic() < deadline:
        time.sleep(RETRY_INTERVAL_SEC)
        try:
            report = again()
        except DaemonUnavailable as exc:
            last = exc
            continue
        _say(logging.WARNING, f"gpuguardd stopped during {what}; the restarted gpuguardd "
                              f"finished it: sweep {report.id[:8]}, {report.outcome}")
        return report
    gone = f"gpuguardd stopped during {what} and did not come back within {retry_sec:.0f} s ({last})"
    if os.geteuid() != 0:
        raise DaemonUnavailable(f"{gone}; as root, sweep again with --local")
    _say(logging.WARNING, f"{gone}; sweeping with the local engine")
    report = local()
    _say(logging.WARNING, f"gpuguardd stopped during {what}; finished locally: {report.outcome}")
    return report


def sweep_through_restarts(backend: Backend, request: SweepRequest,
                           args: argparse.Namespace) -> Report:
    """backend.sweep, finished even when gpuguardd dies during it."""
    if isinstance(backend, LocalBackend):
        return backend.sweep(request)
    from gpuguardd.cli.client import DBusBackend

    return sweep(lambda: backend.sweep(request),
                 lambda: DBusBackend(bus_address=args.bus_address).sweep(dataclasses.replace(request)),
                 lambda: local(args).sweep(dataclasses.replace(request)), request)
