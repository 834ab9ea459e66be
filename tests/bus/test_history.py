"""The sweep history through the daemon: restarted, killed mid-write, or fed a corrupt file,
gpuguardd keeps serving it over D-Bus (the file itself: tests/unit/test_history.py)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from gpuguardd.daemon.history import FILE_NAME
from tests.dbus_harness import MANAGER, MANAGER_PATH, GuardDaemon

pytest_plugins = ["tests.dbus_harness"]


def dry_sweep(guard: GuardDaemon, reason: str) -> str:
    result = guard.manager("Sweep", "a{sv}", "2", "dry_run", "b", "true", "reason", "s", reason)
    report_id: str = result[0]["id"]
    return report_id


def state_file(guard: GuardDaemon) -> Path:
    return Path(guard.host.root) / "state" / FILE_NAME


def test_history_is_kept_across_a_restart(guard: GuardDaemon) -> None:
    ids = [dry_sweep(guard, f"before restart {n}") for n in range(3)]
    assert guard.stop() == 0
    guard.start()
    reports = guard.manager("GetHistory", "u", "10")[0]
    assert [r["id"] for r in reports] == ids[::-1]
    assert reports[0]["reason"] == "before restart 2"
    assert guard.get_property(MANAGER_PATH, MANAGER, "LastSweep")["id"] == ids[-1]


def test_kill_9_mid_write_loses_only_the_record_in_flight(guard: GuardDaemon) -> None:
    ids = [dry_sweep(guard, f"kept {n}") for n in range(2)]
    assert guard.proc is not None
    guard.proc.send_signal(signal.SIGKILL)
    assert guard.stop() == -signal.SIGKILL
    path = state_file(guard)
    # What a write cut short by the kill leaves behind: the start of a record, no newline.
    with open(path, "ab") as handle:
        handle.write(b'{"id": "torn", "outcome": "fre')
    guard.start()
    reports = guard.manager("GetHistory", "u", "0")[0]
    assert [r["id"] for r in reports] == ids[::-1]
    assert "dropped an incomplete last record" in guard.stderr()
    newest = dry_sweep(guard, "after the crash")
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == [*ids, newest]


def test_corrupt_history_does_not_stop_the_daemon(guard: GuardDaemon) -> None:
    kept = dry_sweep(guard, "good")
    assert guard.stop() == 0
    path = state_file(guard)
    with open(path, "ab") as handle:
        handle.write(b"\xde\xad\xbe\xef garbage\n")
    guard.start()
    assert [r["id"] for r in guard.manager("GetHistory", "u", "0")[0]] == [kept]
    assert "moved to" in guard.stderr() and ".corrupt-" in guard.stderr()
    assert len(list(path.parent.glob(f"{FILE_NAME}.corrupt-*"))) == 1
    assert os.path.exists(path)
