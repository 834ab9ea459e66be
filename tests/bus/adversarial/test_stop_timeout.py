"""A stop must not cut a sweep's report: TimeoutStopSec=30s was shorter than a
sweep of the default settings (GraceSec 10 s + KillTimeoutSec 5 s + VerifyTimeoutSec 30 s),
so `systemctl stop gpuguardd` during a sweep SIGKILLed the daemon before its report.

Now the unit allows the default settings' longest sweep plus margin, the daemon keeps
systemd's stop timeout extended (EXTEND_TIMEOUT_USEC) while sweeps finish, for as long as
their settings allow, and records any sweep still running after that as it stands.
"""

from __future__ import annotations

import json
import signal
import subprocess

from tests.conftest import GiB
from tests.dbus_harness import PYTHON, GuardDaemon, private_gpu, private_holder, wait_until

pytest_plugins = ["tests.dbus_harness"]


def test_sigterm_during_a_sweep_waits_for_its_report(daemon: GuardDaemon) -> None:
    daemon.host.write_config("[Daemon]\nPollIntervalSec=0.25\n")
    daemon.start()
    pid = private_holder(daemon.host, GiB, "--ignore-term")
    gpu = str(private_gpu(daemon.host))
    sweep = subprocess.Popen([PYTHON, "-m", "gpuguardd.cli.main", "sweep", "--gpu", gpu, "--grace", "4",
                              "--json"], env=daemon.env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: f"sent SIGTERM to pid {pid}" in daemon.stderr(), 20, "the SIGTERM")
        assert daemon.proc is not None and daemon.notify is not None
        daemon.proc.send_signal(signal.SIGTERM)  # systemctl stop, mid-grace
        out, err = sweep.communicate(timeout=60)
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
    assert sweep.returncode == 0, err
    report = json.loads(out)
    assert report["outcome"] == "freed" and report["terminated"][0]["signal"] == "SIGKILL"
    assert daemon.proc.wait(timeout=30) == 0  # it exits on its own once the report is out
    daemon.stop()
    extended = [line for line in daemon.notify.lines() if line.startswith("EXTEND_TIMEOUT_USEC=")]
    assert extended, daemon.notify.lines()
    # The wait asked for covers what the sweep could still need (grace 4 + 3 + 3 + margin).
    assert int(extended[0].split("=", 1)[1]) >= 5_000_000
    daemon.start()
    history = daemon.manager("GetHistory", "u", "5")[0]
    assert report["id"] in [r["id"] for r in history]


