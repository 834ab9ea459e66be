"""Forged signals: any user may send any signal straight to a connection's
unique name, with the member, path and interface of its choice; match rules only filter
broadcasts. A NameOwnerChanged("org.freedesktop.systemd1", old, "") from a user made gpuguardd
believe systemd had left: [Watch] Units and escaped-leftover adoption stopped, silently.

Signals count only from their real sender: the bus daemon's (org.freedesktop.DBus, which no
peer can claim) and systemd's current unique name, for gpuguardd; gpuguardd's unique name for
`gpuguardctl watch`. Driven on the tests' real dbus-daemon with a stand-in systemd manager
(fake_systemd.py) and forgeries sent by `nobody` with dbus-send.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from tests.bus.adversarial.fake_systemd import FakeSystemd
from tests.dbus_harness import (
    BUS_NAME,
    MANAGER,
    MANAGER_PATH,
    NOBODY,
    PYTHON,
    ROOT,
    GuardDaemon,
    private_gpu,
    wait_until,
)

pytest_plugins = ["tests.dbus_harness"]

SYSTEMD = "org.freedesktop.systemd1"
UNIT = "gg-forged.service"


def bus_call(address: str, member: str, *args: str) -> str:
    result = subprocess.run(["busctl", f"--address={address}", "call", "org.freedesktop.DBus",
                             "/org/freedesktop/DBus", "org.freedesktop.DBus", member, *args],
                            capture_output=True, text=True, timeout=30, check=True)
    return result.stdout.split('"')[1]


def forge(address: str, destination: str, path: str, member: str, signature: str,
          *body: object) -> None:
    """A signal sent by nobody straight to `destination`, claiming to be `member` at `path`."""
    interface, _, name = member.rpartition(".")
    result = subprocess.run([*NOBODY, PYTHON, "-m", "tests.bus.adversarial.forge", address,
                             destination, path, interface, name, signature, json.dumps(body)],
                            capture_output=True, text=True, timeout=30, check=False, cwd=str(ROOT))
    assert result.returncode == 0, result.stderr


def watch_sweeps(guard: GuardDaemon) -> list[dict[str, object]]:
    result = guard.ctl("history", "--json", "-n", "50")
    assert result.returncode == 0, result.stderr
    return [r for r in json.loads(result.stdout) if r["requested_by"] == f"watch:{UNIT}"]


def test_forged_systemd_signals_change_nothing(daemon: GuardDaemon, systemd: FakeSystemd) -> None:
    daemon.host.write_config(f"[Daemon]\nPollIntervalSec=0.25\n[Watch]\nUnits={UNIT}\n")
    daemon.start()
    wait_until(lambda: "watching systemd units" in daemon.stderr(), 15, "the unit watch on")
    gpuguardd = bus_call(daemon.address, "GetNameOwner", "s", BUS_NAME)
    dbus = "/org/freedesktop/DBus"
    # "systemd came back elsewhere", then the forgery of the issue: "systemd left".
    forge(daemon.address, gpuguardd, dbus, "org.freedesktop.DBus.NameOwnerChanged", "sss",
          SYSTEMD, "", ":1.999999")
    time.sleep(0.5)
    forge(daemon.address, gpuguardd, dbus, "org.freedesktop.DBus.NameOwnerChanged", "sss",
          SYSTEMD, systemd.unique_name, "")
    # systemd's own signals from someone else: a stop that never happened.
    forge(daemon.address, gpuguardd, "/org/freedesktop/systemd1",
          "org.freedesktop.systemd1.Manager.JobRemoved", "uoss", 7,
          "/org/freedesktop/systemd1/job/7", UNIT, "done")
    time.sleep(1.0)
    assert watch_sweeps(daemon) == [], "a forged JobRemoved started a sweep"
    # The real systemd's stop still reaches the watch: it did not believe systemd left.
    systemd.job_removed(UNIT)
    sweeps = wait_until(lambda: watch_sweeps(daemon), 15, "the watch's sweep of the real stop")
    assert len(sweeps) == 1 and sweeps[0]["scope"]["unit"] == UNIT
    assert daemon.alive()


def unique_name_of(address: str, pid: int) -> str:
    names = subprocess.run(["busctl", f"--address={address}", "--json=short", "call",
                            "org.freedesktop.DBus", "/org/freedesktop/DBus",
                            "org.freedesktop.DBus", "ListNames"],
                           capture_output=True, text=True, timeout=30, check=True)
    for name in json.loads(names.stdout)["data"][0]:
        if not name.startswith(":"):
            continue
        owner = subprocess.run(["busctl", f"--address={address}", "call", "org.freedesktop.DBus",
                                "/org/freedesktop/DBus", "org.freedesktop.DBus",
                                "GetConnectionUnixProcessID", "s", name],
                               capture_output=True, text=True, timeout=30, check=False)
        if owner.returncode == 0 and owner.stdout.split() == ["u", str(pid)]:
            return str(name)
    raise AssertionError(f"pid {pid} has no connection on the bus")


def test_watch_shows_only_gpuguardds_signals(guard: GuardDaemon, tmp_path: Path) -> None:
    out_path = tmp_path / "watch.out"
    err_path = tmp_path / "watch.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        watch = subprocess.Popen([PYTHON, "-m", "gpuguardd.cli.main", "watch", "--json"], env=guard.env,
                                 stdout=out, stderr=err)
    try:
        name = wait_until(lambda: _try_name(guard.address, watch.pid), 15, "the watch's connection")
        time.sleep(0.5)  # its match rules and GetNameOwner are in place
        forge(guard.address, name, MANAGER_PATH, f"{MANAGER}.ProcessTerminated", "susss",
              "forged000", 1, "sshd", "sshd.service", "SIGKILL")
        forge(guard.address, name, "/org/freedesktop/DBus", "org.freedesktop.DBus.NameOwnerChanged",
              "sss", BUS_NAME, ":1.1", "")
        # A real signal after the forgeries: once it is shown, they were read (and ignored).
        gpu = str(private_gpu(guard.host))
        guard.manager("Sweep", "a{sv}", "2", "gpus", "au", "1", gpu, "dry_run", "b", "true")
        wait_until(lambda: "SweepFinished" in out_path.read_text(), 15, "the real SweepFinished")
    finally:
        watch.terminate()
        watch.wait(timeout=10)
    shown = out_path.read_text()
    assert "forged000" not in shown, shown
    assert "stopped" not in err_path.read_text(), err_path.read_text()


def _try_name(address: str, pid: int) -> str | None:
    try:
        return unique_name_of(address, pid)
    except AssertionError:
        return None
