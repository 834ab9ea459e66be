"""The sweep history through the daemon: restarted, killed mid-write, fed a corrupt file, or on
a full disk, gpuguardd keeps serving it over D-Bus (the file itself: tests/unit/daemon/test_history.py,
tests/host/test_history_disk.py)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from gpuguardd.daemon.history import FILE_NAME, RETRY_SEC
from tests.dbus_harness import (
    FAST_POLL,
    MANAGER,
    MANAGER_PATH,
    GuardDaemon,
    dry_sweep,
    private_gpu,
    private_holder,
    wait_until,
)
from tests.fulldisk import PAGE, fill, tiny_tmpfs

pytest_plugins = ["tests.dbus_harness"]



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


def file_ids(path: Path) -> list[str]:
    """The id of each line of the history file (every line must be a whole record)."""
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def test_power_loss_garbage_and_a_torn_tail_keep_the_rest(guard: GuardDaemon) -> None:
    """What a power cut can leave in the file (a block of zeros and junk where
    a record was, the last record cut short in zeros): the readable reports are served, and
    the next record is a line of its own."""
    ids = [dry_sweep(guard, f"kept {n}") for n in range(3)]
    assert guard.proc is not None
    guard.proc.send_signal(signal.SIGKILL)
    assert guard.stop() == -signal.SIGKILL
    path = state_file(guard)
    lines = path.read_bytes().splitlines(keepends=True)
    assert len(lines) == 3
    path.write_bytes(lines[0] + b"\0" * 300 + b"\xff\xfe\x89 junk\n" + lines[1] + lines[2]
                     + b'{"id": "' + b"\0" * 100)
    guard.start()
    assert [r["id"] for r in guard.manager("GetHistory", "u", "0")[0]] == ids[::-1]
    logs = guard.stderr()
    assert "skipped 1 unreadable line(s) (line 2)" in logs, logs
    assert "dropped an incomplete last record" in logs, logs
    newest = dry_sweep(guard, "after the power cut")
    assert file_ids(path) == [*ids, newest]


def test_a_full_state_disk_ends_the_holders_and_keeps_the_record_for_later(
        daemon: GuardDaemon) -> None:
    """The sweep still ends its holders and replies, the daemon says it could
    not keep the record, serves it meanwhile, and writes it once there is room."""
    host = daemon.host
    state = Path(host.root) / "state"
    path = state / FILE_NAME
    with tiny_tmpfs(state, 16 * PAGE):
        try:
            fill(state / "filler")
            host.write_config(FAST_POLL)
            daemon.start()
            pid = private_holder(host)
            gpu = str(private_gpu(host))
            report = daemon.manager("Sweep", "a{sv}", "3", "gpus", "au", "1", gpu, "grace_ms", "u",
                                    "500", "reason", "s", "disk full")[0]
            assert report["outcome"] == "freed", report
            assert [t["pid"] for t in report["terminated"]] == [pid]
            wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 5, "the holder gone")
            assert not path.exists()
            assert "cannot write the sweep history" in daemon.stderr()
            assert f"report {report['id'][:8]} is not on disk" in daemon.stderr()
            served = daemon.manager("GetHistory", "u", "0")[0]
            assert [r["id"] for r in served] == [report["id"]]

            (state / "filler").unlink()
            # Written by the daemon's retry, with no other sweep to carry it.
            wait_until(path.exists, 2 * RETRY_SEC + 5, "the record written once there is room")
            assert file_ids(path) == [report["id"]]
            assert "1 report(s) that could not be written earlier are now on disk" in daemon.stderr()
            newest = dry_sweep(daemon, "room again")
            assert file_ids(path) == [report["id"], newest]
        finally:
            if daemon.alive():
                assert daemon.stop() == 0
