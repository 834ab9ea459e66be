"""gpuguardd killed during a sweep: the caller and the next daemon finish it (daemon/units.py, cli/sweep.py).

The real daemon on a private bus over the fake NVML; its death is SIGKILL, as an OOM kill or
a crash would be; the test plays systemd's Restart=on-failure by starting the next one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.dbus_harness import (
    FAST_POLL,
    PYTHON,
    ROOT,
    GuardDaemon,
    private_gpu,
    private_holder,
    wait_until,
)
from tests.helpers import alive

pytest_plugins = ["tests.dbus_harness"]



def inflight_dir(daemon: GuardDaemon) -> Path:
    return daemon.host.root / "run" / "sweeps"


def kill_during_grace(daemon: GuardDaemon, pid: int) -> None:
    """SIGKILL gpuguardd once the holder has had its SIGTERM (the grace period runs)."""
    wait_until(lambda: any(inflight_dir(daemon).glob("*.json")), 10, "the in-flight record")
    wait_until(lambda: "SIGTERM" in daemon.stderr() and f"pid {pid}" in daemon.stderr(), 10,
               "the holder's SIGTERM")
    assert daemon.proc is not None
    daemon.proc.kill()
    daemon.proc.wait(10)
    daemon.logs.append(daemon.stderr())


def history(daemon: GuardDaemon) -> list[dict[str, Any]]:
    found = daemon.manager("GetHistory", "u", "0")[0]
    assert isinstance(found, list)
    return found


def test_a_killed_daemons_sweep_is_finished_by_the_next_and_linked(guard: GuardDaemon) -> None:
    pid = private_holder(guard.host, 2 * 1024**3, "--ignore-term")
    gpu = str(private_gpu(guard.host))
    call = subprocess.Popen(
        ["busctl", f"--address={guard.address}", "call", "--json=short", "org.gpuguard.GpuGuard1",
         "/org/gpuguard/GpuGuard1", "org.gpuguard.GpuGuard1.Manager", "Sweep", "a{sv}", "3",
         "gpus", "au", "1", gpu, "grace_ms", "u", "4000", "reason", "s", "rotate"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kill_during_grace(guard, pid)
    _, err = call.communicate(timeout=10)
    assert "disconnected from message bus without replying" in err  # what the caller saw
    assert alive(pid)  # nobody finished it yet

    guard.start()  # systemd's Restart=on-failure
    wait_until(lambda: not alive(pid), 20, "the next gpuguardd to end the holder")
    # Verified and recorded: nothing left to finish.
    wait_until(lambda: not list(inflight_dir(guard).glob("*")), 20, "the record to go")
    reports = history(guard)
    cut = [r for r in reports if r["outcome"] == "interrupted"]
    assert len(cut) == 1, reports
    finished = [r for r in reports if r.get("resumes") == cut[0]["id"]]
    assert len(finished) == 1 and cut[0]["finished_by"] == finished[0]["id"], reports
    assert finished[0]["outcome"] == "freed"
    assert [t["pid"] for t in finished[0]["terminated"]] == [pid]
    assert finished[0]["reason"] == cut[0]["reason"] == "rotate"
    assert cut[0]["scope"]["gpus"] == finished[0]["scope"]["gpus"] == [int(gpu)]
    assert f"was cut short when gpuguardd stopped: sweep {finished[0]['id'][:8]}" in guard.stderr()


def test_gpuguardctl_retries_when_the_daemon_dies_and_exits_with_the_finishing_sweep(
        guard: GuardDaemon) -> None:
    pid = private_holder(guard.host, 2 * 1024**3, "--ignore-term")
    gpu = str(private_gpu(guard.host))
    ctl = subprocess.Popen([PYTHON, "-m", "gpuguardd.cli.main", "sweep", "--gpu", gpu,
                            "--grace", "4", "--json"], env=guard.env, cwd=str(ROOT),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kill_during_grace(guard, pid)
    time.sleep(1.5)  # RestartSec=1s; the client is retrying meanwhile
    guard.start()
    out, err = ctl.communicate(timeout=60)
    assert ctl.returncode == 0, err
    assert "gpuguardd stopped during the sweep of its scope" in err and "retrying" in err
    assert "the restarted gpuguardd finished it" in err
    assert "Traceback" not in err
    assert not alive(pid)
    report = json.loads(out)
    assert report["outcome"] in ("freed", "nothing-to-do")
    # Whichever came first (the daemon's own resumption or the retried call), the history
    # holds the cut-short sweep and the one that finished it, linked.
    reports = history(guard)
    cut = [r for r in reports if r["outcome"] == "interrupted"]
    assert len(cut) == 1 and any(r["id"] == cut[0]["finished_by"] and r["outcome"] == "freed"
                                 for r in reports), reports


def test_an_old_interrupted_sweep_is_recorded_not_repeated(daemon: GuardDaemon) -> None:
    """The daemon stayed down past the sweep's budget: its GPUs may have new owners."""
    daemon.host.write_config(FAST_POLL)
    pid = private_holder(daemon.host, 2 * 1024**3)
    gpu = private_gpu(daemon.host)
    directory = inflight_dir(daemon)
    directory.mkdir(parents=True)
    report_id = "ab" * 16
    started = (time.time_ns() // 1000) - 3600 * 10**6  # an hour ago
    record = {"format": 1, "started_usec": started, "report_id": report_id, "resumes": "",
              "gpus": [str(gpu)], "unit": "", "container": "", "grace_ms": 1000, "dry_run": False,
              "include_management": False, "reason": "old", "requested_by": "uid 0 (root)",
              "adopted": [], "slurm_job": "", "slurm_uid": -1, "audited": True}
    (directory / f"{report_id}.json").write_text(json.dumps(record))
    # And one that is not what gpuguardd writes: reported and removed, never acted on.
    (directory / f"{'cd' * 16}.json").write_text('{"format": 1, "report_id": "x"}')
    daemon.start()
    wait_until(lambda: not list(directory.glob("*.json")), 10, "the records to be dealt with")
    reports = history(daemon)
    assert [r["id"] for r in reports if r["outcome"] == "interrupted"] == [report_id]
    assert "not swept again" in reports[0]["error"]
    time.sleep(0.5)
    assert alive(pid)  # the holder that may be someone else's now was left alone
    assert "in-flight record" in daemon.stderr() and "not used" in daemon.stderr()
    os.kill(pid, signal.SIGKILL)
