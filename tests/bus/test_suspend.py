"""gpuguardd never wakes a runtime-suspended GPU: not one NVML call names it.

The sysfs view is a directory of the test's own ([Devices] SysfsPath): bus/pci/devices/<bdf>/
power/runtime_status for the fake GPUs' bus ids, and bus/pci/drivers/nvidia/<bdf> for the
order. The fake NVML writes a line per call naming a GPU ($FAKE_NVML_CALLS). The daemon polls
every 0.1 s over a 15 s span (150 polls: the issue's minute at 2 s polls would be 30; a minute
at 0.1 s adds nothing but time), with 100 property reads and holder listings meanwhile.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.conftest import GiB
from tests.dbus_harness import GPU, MANAGER_PATH, GuardDaemon, wait_until
from tests.fakenvml import CALLS_ENV, calls_per_gpu

pytest_plugins = ["tests.dbus_harness"]

SPAN_SEC = 15.0
READS = 100


def sysfs_view(root: Path, statuses: dict[str, str]) -> None:
    """(Re)write the runtime PM status of each bus id (the kernel's spelling)."""
    for bdf, status in statuses.items():
        power = root / "bus/pci/devices" / bdf / "power"
        power.mkdir(parents=True, exist_ok=True)
        (power / "runtime_status").write_text(status + "\n")
        (root / "bus/pci/drivers/nvidia" / bdf).mkdir(parents=True, exist_ok=True)


def test_suspended_gpu_is_never_asked(daemon: GuardDaemon, tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    # The fake's GPUs 0 and 1 sit on buses 01 and 02.
    sysfs_view(sysfs, {"0000:01:00.0": "suspended", "0000:02:00.0": "active"})
    calls = tmp_path / "nvml-calls"
    daemon.host.write_config(f"PollIntervalSec=0.1\n[Devices]\nSysfsPath={sysfs}\n")
    holder = daemon.host.spawn("--hold", daemon.host.node("nvidia1"), nvml=(1, 3 * GiB))
    daemon.start(env={CALLS_ENV: str(calls)})
    asleep, awake = f"{MANAGER_PATH}/gpu/0", f"{MANAGER_PATH}/gpu/1"
    wait_until(lambda: daemon.property_is(asleep, GPU, "State", "suspended"), 10, "GPU 0 suspended")
    wait_until(lambda: daemon.property_is(awake, GPU, "State", "in-use"), 10, "GPU 1 in use")

    started = time.monotonic()
    for read in range(READS):
        name = ("State", "MemoryUsed", "MemoryTotal", "HolderCount", "Uuid")[read % 5]
        daemon.get_property(asleep, GPU, name)
        if read % 25 == 0:
            # Listings and `gpuguardctl gpus` scan, and a scan takes an NVML snapshot.
            assert daemon.ctl("holders").returncode == 0
            assert daemon.ctl("gpus").returncode == 0
    time.sleep(max(0.0, SPAN_SEC - (time.monotonic() - started)))

    counts = calls_per_gpu(calls)
    assert counts.get(0, 0) == 0, f"NVML was asked about the suspended GPU: {counts}"
    # Normal service on the other: polled all along (memory, lists: several calls a poll).
    assert counts.get(1, 0) >= SPAN_SEC / 0.1, counts
    assert daemon.get_property(awake, GPU, "MemoryUsed") == 3 * GiB
    assert daemon.get_property(asleep, GPU, "State") == "suspended"

    # It wakes: read again, and its figures kept when it sleeps once more.
    sysfs_view(sysfs, {"0000:01:00.0": "active"})
    wait_until(lambda: daemon.property_is(asleep, GPU, "State", "idle"), 10, "GPU 0 idle")
    assert daemon.get_property(asleep, GPU, "MemoryTotal") == 80 * GiB
    assert calls_per_gpu(calls).get(0, 0) > 0
    sysfs_view(sysfs, {"0000:01:00.0": "suspended"})
    wait_until(lambda: daemon.property_is(asleep, GPU, "State", "suspended"), 10, "GPU 0 asleep")
    time.sleep(0.5)  # a snapshot that began before the change has ended
    calls.unlink()
    time.sleep(2)
    assert calls_per_gpu(calls).get(0, 0) == 0
    assert daemon.get_property(asleep, GPU, "MemoryTotal") == 80 * GiB  # its last known figure
    holder.stop()
    assert daemon.get_property(asleep, GPU, 'PciBusId') == '00000000:01:00.0'


def open_nodes(pid: int, dev: Path) -> set[str]:
    """The test's device nodes among what process `pid` has open (the fake NVML opens them at
    nvmlInit and closes them at nvmlShutdown, as libnvidia-ml does)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(dev) + "/"):
            found.add(target.rsplit("/", 1)[1])
    return found


def test_no_nvml_session_while_every_gpu_sleeps(daemon: GuardDaemon, tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    sysfs_view(sysfs, {"0000:01:00.0": "suspended", "0000:02:00.0": "suspended"})
    (sysfs / "module/nvidia").mkdir(parents=True)
    (sysfs / "module/nvidia/version").write_text("550.54.15\n")
    calls = tmp_path / "nvml-calls"
    daemon.host.write_config(f"PollIntervalSec=0.1\n[Devices]\nSysfsPath={sysfs}\n")
    daemon.start(env={CALLS_ENV: str(calls)})
    assert daemon.proc is not None
    pid, dev = daemon.proc.pid, daemon.host.dev
    gpus = [f"{MANAGER_PATH}/gpu/{index}" for index in (0, 1)]
    wait_until(lambda: all(daemon.property_is(path, GPU, "State", "suspended") for path in gpus),
               10, "both GPUs suspended")
    time.sleep(2)  # 20 polls
    assert open_nodes(pid, dev) == set(), "an NVML session holds the sleeping GPUs' nodes"
    assert calls_per_gpu(calls) == {}
    assert daemon.ctl("status").returncode == 0
    assert daemon.get_property(MANAGER_PATH, "org.gpuguard.GpuGuard1.Manager", "DriverVersion") == "550.54.15"

    # One wakes: the session opens (every node, as nvmlInit does), the awake GPU is read.
    sysfs_view(sysfs, {"0000:02:00.0": "active"})
    wait_until(lambda: daemon.property_is(gpus[1], GPU, "State", "idle"), 10, "GPU 1 read")
    assert "nvidia1" in open_nodes(pid, dev)
    assert calls_per_gpu(calls).get(0, 0) == 0
    # Both asleep again: the session closes, and GPU 1 keeps what was read of it.
    sysfs_view(sysfs, {"0000:02:00.0": "suspended"})
    wait_until(lambda: daemon.property_is(gpus[1], GPU, "State", "suspended"), 10, "GPU 1 asleep")
    wait_until(lambda: not open_nodes(pid, dev), 5, "the NVML session closed")
    assert daemon.get_property(gpus[1], GPU, "MemoryTotal") == 80 * GiB
    assert daemon.get_property(gpus[1], GPU, "Uuid") == daemon.host.state.gpus[1].uuid
