"""One code path for unit sweeps: `gpuguardctl sweep --local --unit U` skipped the
unit adoption and one-sweep-per-stop of the daemon, so the drop-in's fallback (no daemon)
left U's escaped leftovers alive. Both now ask adoption.leftovers.

On the tests' bus a stand-in systemd says U stopped with CUDA_VISIBLE_DEVICES naming the
private GPU; a holder on that GPU in no unit (the cgroup root) is U's escaped leftover by the
rule in adoption.py: the daemon's SweepUnit and the local sweep both adopt and end it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.bus.adversarial.fake_systemd import FakeSystemd
from tests.conftest import GiB, GpuHost
from tests.dbus_harness import (
    PYTHON,
    BusDaemon,
    GuardDaemon,
    private_gpu,
    private_holder,
    wait_until,
)
from tests.helpers import gone

pytest_plugins = ["tests.dbus_harness"]

UNIT = "gg-local.service"


@pytest.fixture
def systemd(system_bus: BusDaemon, gpu_host: GpuHost) -> Iterator[FakeSystemd]:
    fake = FakeSystemd(system_bus.address, f"CUDA_VISIBLE_DEVICES={private_gpu(gpu_host)}")
    try:
        yield fake
    finally:
        fake.close()



def local_sweep(host: GpuHost, address: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(host.env)
    env["GPUGUARD_BUS_ADDRESS"] = address
    return subprocess.run([PYTHON, "-m", "gpuguardd.cli.main", "sweep", "--local", "--config",
                           str(host.config_path), "--json", *args],
                          env=env, capture_output=True, text=True, timeout=120, check=False)


def test_local_and_daemon_unit_sweeps_adopt_the_same_leftover(
        guard: GuardDaemon, systemd: FakeSystemd) -> None:
    host = guard.host
    wait_until(lambda: "watching systemd units" in guard.stderr(), 15, "the daemon's unit watch")
    # The daemon: SweepUnit adopts the escaped holder.
    first = private_holder(host, GiB)
    report = guard.manager("SweepUnit", "sa{sv}", UNIT, "1", "grace_ms", "u", "1000")[0]
    assert report["scope"].get("adopted_pids") == [first], report
    assert [t["pid"] for t in report["terminated"]] == [first]
    assert wait_until(lambda: gone(first), 10, "the daemon's sweep to end it")

    # The local fallback, as the drop-in runs it without a daemon: the same.
    second = private_holder(host, GiB)
    local = local_sweep(host, guard.address, "--unit", UNIT, "--grace", "1",
                        "--reason", f"hook:{UNIT} result=success")
    assert local.returncode == 0, local.stderr
    result = json.loads(local.stdout)
    assert result["scope"].get("adopted_pids") == [second], result
    assert [t["pid"] for t in result["terminated"]] == [second]
    assert result["requested_by"] == f"hook:{UNIT}" and result["outcome"] == "freed"
    assert wait_until(lambda: gone(second), 10, "the local sweep to end it")


def test_local_unit_sweep_without_systemd_adopts_nothing(gpu_host: GpuHost,
                                                          system_bus: BusDaemon) -> None:
    """No systemd on the bus: every process looks unit-less, so nothing may be adopted."""
    gpu_host.write_config()
    pid = private_holder(gpu_host, GiB)
    local = local_sweep(gpu_host, system_bus.address, "--unit", UNIT, "--dry-run")
    assert local.returncode == 0, local.stderr
    result = json.loads(local.stdout)
    assert "adopted_pids" not in result["scope"] or result["scope"]["adopted_pids"] == []
    assert result["targets"] == [] and not gone(pid)
    assert "no systemd on the bus" in local.stderr
