"""The bus daemon dies under gpuguardd: gpuguardd exits non-zero within
seconds, idle or in a sweep's grace period, so systemd's Restart=on-failure brings it back on
the restarted bus. Each test has a dbus-daemon of its own: the session's is shared."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import GiB, GpuHost
from tests.dbus_harness import (
    BUS_NAME,
    FAST_POLL,
    MANAGER,
    MANAGER_PATH,
    BusDaemon,
    GuardDaemon,
    private_gpu,
    private_holder,
    wait_until,
)

# Noticing the lost connection, and leaving: an interpreter's exit on two shared cores.
EXIT_WITHIN_SEC = 5.0


@pytest.fixture
def own_bus() -> Iterator[BusDaemon]:
    bus = BusDaemon()
    try:
        yield bus
    finally:
        bus.close()  # after a kill: its log and directory


@pytest.fixture
def on_own_bus(own_bus: BusDaemon, gpu_host: GpuHost, tmp_path: Path) -> Iterator[GuardDaemon]:
    guard = GuardDaemon(address=own_bus.address, host=gpu_host, workdir=tmp_path)
    guard.host.write_config(FAST_POLL)
    try:
        guard.start()
        yield guard
    finally:
        try:
            if guard.proc is not None and guard.alive():
                guard.proc.kill()
                guard.proc.wait()
        finally:
            guard.close()


def exit_after_bus_dies(guard: GuardDaemon, bus: BusDaemon) -> tuple[int, float]:
    bus.proc.send_signal(signal.SIGKILL)
    bus.proc.wait()
    killed = time.monotonic()
    assert guard.proc is not None
    try:
        code = guard.proc.wait(timeout=EXIT_WITHIN_SEC + 5)
    except subprocess.TimeoutExpired:
        code = None
    return code if code is not None else -999, time.monotonic() - killed


def test_idle_gpuguardd_exits_non_zero_when_the_bus_dies(on_own_bus: GuardDaemon,
                                                         own_bus: BusDaemon) -> None:
    code, took = exit_after_bus_dies(on_own_bus, own_bus)
    assert code not in (0, -999), f"gpuguardd exited with {code}:\n{on_own_bus.stderr()}"
    assert took < EXIT_WITHIN_SEC, f"gpuguardd took {took:.1f} s to exit"
    assert "lost the connection to" in on_own_bus.stderr()
    assert "Traceback" not in on_own_bus.stderr()


def test_gpuguardd_in_a_sweep_exits_non_zero_when_the_bus_dies(on_own_bus: GuardDaemon,
                                                               own_bus: BusDaemon) -> None:
    guard = on_own_bus
    pid = private_holder(guard.host, 2 * GiB, "--ignore-term")
    gpu = str(private_gpu(guard.host))
    call = subprocess.Popen(
        ["busctl", f"--address={guard.address}", "call", BUS_NAME, MANAGER_PATH, MANAGER, "Sweep",
         "a{sv}", "2", "gpus", "au", "1", gpu, "grace_ms", "u", "60000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # In the grace period: the sweep's thread waits for the holder to exit.
        wait_until(lambda: f"sent SIGTERM to pid {pid}" in guard.stderr(), 20, "the SIGTERM")
        code, took = exit_after_bus_dies(guard, own_bus)
    finally:
        call.kill()
        call.wait()
    assert code not in (0, -999), f"gpuguardd exited with {code}:\n{guard.stderr()}"
    assert took < EXIT_WITHIN_SEC, f"gpuguardd took {took:.1f} s to exit"
    assert "lost the connection to" in guard.stderr()
    assert "Traceback" not in guard.stderr()
