"""gpuguardd on a real bus while NVML hangs: replies stay bounded, the
watchdog keeps being fed, the hung GPU reads `unknown`, and all of it recovers when the stuck
call returns."""

from __future__ import annotations

import json
import subprocess
import time

from tests.conftest import GiB
from tests.dbus_harness import (
    MANAGER_PATH,
    PYTHON,
    GuardDaemon,
    private_gpu,
    private_holder,
    wait_until,
)

pytest_plugins = ["tests.dbus_harness"]

GPU = "org.gpuguard.GpuGuard1.Gpu"
MANAGER = "org.gpuguard.GpuGuard1.Manager"
NVML_TIMEOUT = 0.5
HANG_MS = 4000
# A reply may take one NvmlTimeoutSec (the call that finds NVML hung) plus a scan and busctl's
# own start-up, on two shared cores.
REPLY_BOUND = NVML_TIMEOUT + 2.0


def state_of(guard: GuardDaemon, index: int) -> str:
    return str(guard.get_property(f"{MANAGER_PATH}/gpu/{index}", GPU, "State"))


def timed(call: object) -> float:
    started = time.monotonic()
    call()  # type: ignore[operator]
    return time.monotonic() - started


def test_a_hung_nvml_never_blocks_replies_or_the_watchdog(daemon: GuardDaemon) -> None:
    host = daemon.host
    daemon.host.write_config(f"PollIntervalSec=0.25\nNvmlTimeoutSec={int(NVML_TIMEOUT * 1000)}ms\n")
    daemon.start(env={"WATCHDOG_USEC": "200000"})
    wait_until(lambda: state_of(daemon, 1) == "idle", 10, "GPU 1 idle")

    host.state.hang = [("nvmlDeviceGetMemoryInfo_v2", HANG_MS, 1)]
    host.publish()
    hung_at = time.monotonic()
    wait_until(lambda: state_of(daemon, 1) == "unknown", 5, "GPU 1 unknown")
    error = daemon.get_property(MANAGER_PATH, MANAGER, "NvmlError")
    assert "NVML hung: nvmlDeviceGetMemoryInfo_v2 (GPU 1)" in error
    assert "has not returned" in daemon.get_property(f"{MANAGER_PATH}/gpu/1", GPU, "Error")
    # Every reply that needs NVML (a fresh holder scan, a sweep's GPU lookup) is bounded.
    assert timed(lambda: daemon.manager("ListHolders", "a{sv}", "1", "fresh", "b", "true")) < REPLY_BOUND
    assert timed(lambda: daemon.manager("ListHolders", "a{sv}", "1", "gpus", "au", "1", "1")) < REPLY_BOUND
    dry = daemon.manager("Sweep", "a{sv}", "2", "gpus", "au", "1", "1", "dry_run", "b", "true")
    assert dry[0]["outcome"] == "dry-run"
    assert timed(lambda: daemon.manager("GetHistory", "u", "5")) < REPLY_BOUND
    assert state_of(daemon, 1) == "unknown", "never idle while NVML cannot say"
    assert time.monotonic() - hung_at < HANG_MS / 1000, "the checks above ran after the hang ended"

    # The watchdog is pinged from the event loop every 0.1 s: no gap while NVML hung.
    assert daemon.notify is not None
    pings = [t for t, text in daemon.notify.messages if "WATCHDOG=1" in text and t >= hung_at]
    assert len(pings) >= 5
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert max(gaps) < 0.6, f"watchdog gaps while NVML hung: {max(gaps):.2f} s"

    # The stuck call returns: GPU 1 reads again, and the error clears.
    host.state.hang = []
    host.publish()
    wait_until(lambda: state_of(daemon, 1) == "idle", HANG_MS / 1000 + 5, "GPU 1 idle again")
    wait_until(lambda: daemon.get_property(MANAGER_PATH, MANAGER, "NvmlError") == "", 5,
               "NvmlError cleared")
    assert "NVML answers again" in daemon.stderr()


def test_the_daemon_stops_while_nvml_is_hung_for_good(daemon: GuardDaemon) -> None:
    host = daemon.host
    daemon.host.write_config(f"PollIntervalSec=0.25\nNvmlTimeoutSec={int(NVML_TIMEOUT * 1000)}ms\n")
    daemon.start()
    wait_until(lambda: state_of(daemon, 0) == "idle", 10, "GPU 0 idle")
    host.state.hang = [("nvmlDeviceGetMemoryInfo_v2", 3_600_000, None)]
    host.publish()
    wait_until(lambda: state_of(daemon, 0) == "unknown", 5, "GPU 0 unknown")
    started = time.monotonic()
    try:
        code = daemon.stop(timeout=15)
    finally:
        if daemon.proc is not None and daemon.alive():  # a failed test leaves nothing running
            daemon.proc.kill()
            daemon.proc.wait()
    assert code == 0
    # One bounded nvmlShutdown attempt; the thread stuck in the driver does not hold it up.
    assert time.monotonic() - started < 5


def test_a_call_still_running_when_the_daemon_stops_logs_no_traceback(daemon: GuardDaemon) -> None:
    """A ListHolders waiting on a scan stuck in NVML when SIGTERM comes: the call's task is
    cancelled as the daemon exits, after it left the bus. dbus-fast logged that as a service
    error with a traceback and then failed to send the reply on the closed socket (a second
    traceback); a stop is no error, and nothing can be sent then."""
    host = daemon.host
    daemon.host.write_config("PollIntervalSec=0.25\nNvmlTimeoutSec=6s\n")
    daemon.start()
    wait_until(lambda: state_of(daemon, 0) == "idle", 10, "GPU 0 idle")
    host.state.hang = [("nvmlDeviceGetMemoryInfo_v2", 3_600_000, None)]
    host.publish()
    time.sleep(0.5)  # the poller's scan is now stuck in NVML; so is any fresh scan after it
    call = subprocess.Popen(
        ["busctl", f"--address={daemon.address}", "--timeout=30", "call", "org.gpuguard.GpuGuard1",
         MANAGER_PATH, MANAGER, "ListHolders", "a{sv}", "1", "fresh", "b", "true"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        assert call.poll() is None, "the call is still waiting for its scan"
        code = daemon.stop(timeout=15)
        _, error = call.communicate(timeout=15)
    finally:
        if call.poll() is None:
            call.kill()
            call.wait()
        if daemon.proc is not None and daemon.alive():
            daemon.proc.kill()
            daemon.proc.wait()
    assert code == 0
    logs = daemon.stderr()
    assert "Traceback" not in logs and "raised an exception" not in logs, logs
    assert call.returncode != 0 and error, "the caller is told the call failed"


def test_a_sweep_while_nvml_hangs_ends_unverified_and_gpuguardctl_exits_6(
        daemon: GuardDaemon) -> None:
    """NVML hangs during a sweep's grace period. The holder is still ended,
    but its memory cannot be verified: `unverified` (never `freed`), gpuguardctl's exit status
    6, and every read meanwhile answers within NvmlTimeoutSec plus a little."""
    host = daemon.host
    host.write_config(f"PollIntervalSec=0.25\nNvmlTimeoutSec={int(NVML_TIMEOUT * 1000)}ms\n"
                      "[Sweep]\nVerifyTimeoutSec=1\n")
    daemon.start()
    pid = private_holder(host, 2 * GiB, "--ignore-term")
    gpu = private_gpu(host)
    wait_until(lambda: daemon.property_is(f"{MANAGER_PATH}/gpu/{gpu}", GPU, "State", "in-use"), 10,
               f"GPU {gpu} in use")
    sweep = subprocess.Popen(
        [PYTHON, "-m", "gpuguardd.cli.main", "sweep", "--json", "--gpu", str(gpu), "--grace", "2"],
        env=daemon.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The sweep has found its target through NVML; now NVML stops answering for the GPU.
        wait_until(lambda: f"sent SIGTERM to pid {pid}" in daemon.stderr(), 20, "the SIGTERM")
        host.state.hang = [("nvmlDeviceGetMemoryInfo_v2", 3 * HANG_MS, gpu)]
        host.publish()
        wait_until(lambda: state_of(daemon, gpu) == "unknown", 5, f"GPU {gpu} unknown")
        reads = [timed(lambda: daemon.manager("ListHolders", "a{sv}", "1", "fresh", "b", "true")),
                 timed(lambda: state_of(daemon, gpu)),
                 timed(lambda: daemon.manager("GetHistory", "u", "5"))]
        out, err = sweep.communicate(timeout=30)
    finally:
        host.state.hang = []
        host.publish()
        if sweep.poll() is None:
            sweep.kill()
            sweep.communicate()
    assert max(reads) < REPLY_BOUND, reads
    assert sweep.returncode == 6, (out, err)
    report = json.loads(out)
    assert report["outcome"] == "unverified" and report["verified"] is False, report
    assert [(t["pid"], t["signal"]) for t in report["terminated"]] == [(pid, "SIGKILL")]
    assert any("NVML hung" in warning for warning in report["warnings"]), report["warnings"]
    assert daemon.manager("GetHistory", "u", "1")[0][0]["id"] == report["id"]
