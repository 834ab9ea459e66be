"""Anyone can keep the daemon busy: 2,000 ListHolders(fresh=true) calls by
nobody held a core at 95 % (a /proc walk each) and wrote 6,895 "denied" lines.

Now concurrent fresh scans share one scan, a non-root caller gets at most one fresh scan a
second (sooner calls are served by the last, still fresh, scan), and refusals and polkit
denials are logged once per uid and action (with the count held back), in bounded memory.
The daemon runs with --debug, which logs each holder scan: the tests count scans and lines.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from gpuguardd.bus.auth import POLKIT_DECISION_SEC
from gpuguardd.bus.names import ACTION_VIEW_DETAILS
from tests.conftest import GiB
from tests.dbus_harness import (
    FAST_POLL,
    NOBODY,
    PYTHON,
    ROOT,
    BusDaemon,
    FakePolkit,
    GuardDaemon,
    private_holder,
)

pytest_plugins = ["tests.dbus_harness"]

SCAN_LINE = "holder scan took"


def flood(guard: GuardDaemon, member: str, count: int, connections: int) -> str:
    result = subprocess.run([*NOBODY, PYTHON, "-m", "tests.bus.adversarial.flood", guard.address,
                             member, str(count), str(connections)], capture_output=True,
                            text=True, timeout=300, check=False, cwd=str(ROOT))
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_fresh_scans_by_nobody_are_coalesced_and_rate_limited(daemon: GuardDaemon) -> None:
    daemon.host.write_config(FAST_POLL)
    daemon.start("--debug")
    # A holder of root's: nobody may not see its command line, so every call asks polkit
    # (which is not running here: only root may) and is denied.
    private_holder(daemon.host, GiB)
    time.sleep(0.5)
    before = daemon.stderr().count(SCAN_LINE)
    started = time.monotonic()
    out = flood(daemon, "ListHolders", 300, 10)
    took = time.monotonic() - started
    assert out.split() == ["replies", "300", "errors", "0"], out
    scans = daemon.stderr().count(SCAN_LINE) - before
    # At most one fresh scan a second for nobody, plus the daemon's own (NVML saw the holder).
    # At least nobody's first fresh scan is seen (the count cannot pass by seeing nothing).
    assert 1 <= scans <= took + 3, (scans, took)  # before: 60 scans in 3.9 s
    denials = [line for line in daemon.stderr().splitlines() if "denied to uid 65534" in line]
    assert len(denials) == 1, denials


def test_refusals_are_logged_once_per_caller(guard: GuardDaemon) -> None:
    out = flood(guard, "Sweep", 100, 4)
    assert out.split() == ["replies", "0", "errors", "100"], out
    log = guard.stderr()
    refused = [line for line in log.splitlines() if "Sweep refused" in line]
    assert len(refused) == 1, refused
    assert len([line for line in log.splitlines() if "denied to uid 65534" in line]) == 1


def test_polkit_is_asked_once_per_connection_and_action(guard: GuardDaemon, system_bus: BusDaemon,
                                                        tmp_path: Path) -> None:
    """A flood of ListHolders by nobody, with root's holder listed, asks polkit about
    view-details once per connection for POLKIT_DECISION_SEC, not once per call."""
    polkit = FakePolkit(system_bus.address, tmp_path, {}, challenge=True)
    try:
        private_holder(guard.host, GiB)
        connections = 4
        started = time.monotonic()
        out = flood(guard, "ListHolders", 200, connections)
        took = time.monotonic() - started
        assert out.split() == ["replies", "200", "errors", "0"], out
        asked = [r for r in polkit.requests() if r["action"] == ACTION_VIEW_DETAILS]
        assert all(r["uid"] == 65534 and not r["granted"] for r in asked)
        # Each connection asks at least once (polkit is really consulted), then again only
        # when its answer has aged. Before: 200 requests, one per call.
        windows = int(took // POLKIT_DECISION_SEC) + 1
        assert connections <= len(asked) <= connections * windows, (len(asked), took)
        assert len({r["name"] for r in asked}) == connections
    finally:
        polkit.close()
