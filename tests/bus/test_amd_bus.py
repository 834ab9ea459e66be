"""gpuguardd with AMD GPUs: the fake KFD/DRM tree of tests/amd_sysfs.py beside the fake NVML, or
alone on a host without NVML, seen as busctl, gpuguardctl and Prometheus see it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.amd_sysfs import AmdHost, make_amd_host
from tests.conftest import GiB
from tests.dbus_harness import GPU, MANAGER, MANAGER_PATH, GuardDaemon, wait_until
from tests.helpers import alive, gone

pytest_plugins = ["tests.dbus_harness"]


@pytest.fixture
def mixed(daemon: GuardDaemon, tmp_path: Path) -> Iterator[AmdHost]:
    amd = make_amd_host(daemon.host, tmp_path, nvidia=True)
    yield amd
    amd.close()


def gpu(index: int) -> str:
    return f"{MANAGER_PATH}/gpu/{index}"


def test_the_daemon_publishes_both_vendors(daemon: GuardDaemon, mixed: AmdHost) -> None:
    daemon.host.write_config(daemon.host.config_extra + "[Daemon]\nPollIntervalSec=0.2\n")
    daemon.start()
    assert daemon.get_property(MANAGER_PATH, MANAGER, "Vendors") == ["amd", "nvidia"]
    assert daemon.get_property(MANAGER_PATH, MANAGER, "GpuCount") == 4
    assert [daemon.get_property(gpu(i), GPU, "Vendor") for i in range(4)] == ["nvidia", "nvidia", "amd", "amd"]
    assert daemon.get_property(gpu(2), GPU, "PciBusId") == "0000:c3:00.0"
    assert daemon.get_property(gpu(3), GPU, "DevicePath") == f"/dev/dri/renderD{mixed.gpus[1].render_minor}"
    assert daemon.get_property(gpu(3), GPU, "State") == "idle"
    text = daemon.manager("GetMetrics")[0]
    assert 'vendor="amd"' in text and 'vendor="nvidia"' in text, text

    # A ROCm process on the second MI300X makes it in use; a sweep of it by PCI bus id ends it
    # and waits for KFD's teardown; the NVIDIA tenant is never touched.
    nvidia = daemon.host.spawn("--hold", daemon.host.node("nvidia0"), "--hold",
                               daemon.host.node("nvidia-uvm"), nvml=(0, 2 * GiB)).pid
    rocm = mixed.holder(mixed.gpus[1], 6 * GiB)
    wait_until(lambda: daemon.property_is(gpu(3), GPU, "State", "in-use"), 10, "GPU 3 in use")
    mixed.release_after_exit(rocm, memory_after=0.5, entry_after=0.8)
    done = daemon.ctl("sweep", "--gpu", "0000:C4:00.0", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = done.json
    assert report["outcome"] == "freed" and [t["pid"] for t in report["terminated"]] == [rocm], report
    assert gone(rocm) and alive(nvidia)
    wait_until(lambda: daemon.property_is(gpu(3), GPU, "State", "idle"), 10, "GPU 3 idle again")


def test_a_host_without_nvml_is_a_working_host(daemon: GuardDaemon, tmp_path: Path) -> None:
    amd = make_amd_host(daemon.host, tmp_path, nvidia=False)
    try:
        daemon.start(env={"LD_LIBRARY_PATH": ""})
        assert daemon.get_property(MANAGER_PATH, MANAGER, "NvmlAvailable") is False
        assert daemon.get_property(MANAGER_PATH, MANAGER, "Vendors") == ["amd"]
        assert daemon.get_property(MANAGER_PATH, MANAGER, "GpuCount") == 2
        assert daemon.get_property(gpu(1), GPU, "State") == "idle"
        done = daemon.ctl("check")
        assert (done.returncode, done.stdout) == (0, ""), done.stdout + done.stderr
        done = daemon.ctl("wait", "--gpu", "1", "--timeout", "10s", "--stable", "0s")
        assert done.returncode == 0, done.stdout + done.stderr
        rocm = amd.holder(amd.gpus[0], 4 * GiB)
        amd.release_after_exit(rocm, memory_after=0.3, entry_after=0.5)
        done = daemon.ctl("sweep", "--gpu", "0", "--json")
        assert (done.returncode, done.json["outcome"]) == (0, "freed"), done.stdout + done.stderr
        swept = done.json["id"]
        done = daemon.ctl("history", "--json")
        assert done.returncode == 0 and done.json[0]["id"] == swept, done.stdout + done.stderr
    finally:
        amd.close()
