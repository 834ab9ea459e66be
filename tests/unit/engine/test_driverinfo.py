"""engine/driverinfo.py: the nvidia module's GPU list and runtime PM status, as untrusted text."""

from __future__ import annotations

from pathlib import Path

from gpuguardd.engine import driverinfo
from gpuguardd.engine.driverinfo import DriverGpu, fill_from_driver, read_driver_gpus
from gpuguardd.records.models import GpuInfo


def test_driver_info_parsing_and_matching(tmp_path: Path) -> None:
    base = tmp_path / "gpus"
    for bus, minor, excluded in (("0000:1a:00.0", "3", "No"), ("0000:05:00.0", "7", "No"),
                                 ("0000:40:00.0", "9", "Yes"), ("0000:41:00.0", "x9", "No")):
        (base / bus).mkdir(parents=True)
        (base / bus / "information").write_text(
            f"Model: \t\t NVIDIA H200\nGPU UUID: \t GPU-{minor}\nBus Location: \t {bus}\n"
            f"Device Minor: \t {minor}\nGPU Excluded:\t {excluded}\n")
    found = read_driver_gpus(str(base))
    # Sorted by bus id (NVML's order); excluded GPUs and garbage minors left out.
    assert found == [DriverGpu("0000:05:00.0", "GPU-7", "NVIDIA H200", 7),
                     DriverGpu("0000:1a:00.0", "GPU-3", "NVIDIA H200", 3)]
    assert read_driver_gpus(str(tmp_path / "missing")) == []
    # By position only when both sides list the same GPUs.
    gpus = [GpuInfo(index=0, lost=True), GpuInfo(index=1, pci_bus_id="00000000:1A:00.0", minor=3)]
    fill_from_driver(gpus, found)
    assert gpus[0].minor == 7 and gpus[0].uuid == "GPU-7"
    three = [GpuInfo(index=0, lost=True), GpuInfo(index=1), GpuInfo(index=2)]
    fill_from_driver(three, found)
    assert three[0].minor is None
    swapped = [GpuInfo(index=0, lost=True), GpuInfo(index=1, pci_bus_id="0000:05:00.0", minor=7)]
    fill_from_driver(swapped, found)
    assert swapped[0].minor is None, "GPU 1 sits at GPU 0's position: the order is not NVML's"
    by_uuid = [GpuInfo(index=5, uuid="GPU-3", unknown=True)]
    fill_from_driver(by_uuid, found)
    assert by_uuid[0].minor == 3


def _status(root: Path, bdf: str, raw: bytes) -> None:
    power = root / "bus/pci/devices" / bdf / "power"
    power.mkdir(parents=True)
    (power / "runtime_status").write_bytes(raw)


def test_status_by_either_spelling_of_the_bus_id(tmp_path: Path) -> None:
    _status(tmp_path, "0000:01:00.0", b"suspended\n")
    _status(tmp_path, "0000:02:00.0", b"active\n")
    _status(tmp_path, "0000:06:00.0", b"suspending\n")
    assert driverinfo.asleep(str(tmp_path), "00000000:01:00.0")
    assert driverinfo.asleep(str(tmp_path), "0000:06:00.0")
    assert not driverinfo.asleep(str(tmp_path), "0000:02:00.0")
    assert not driverinfo.asleep(str(tmp_path), "0000:03:00.0")  # no such device


def test_odd_text_and_paths_are_no_status(tmp_path: Path) -> None:
    _status(tmp_path, "0000:04:00.0", "suspended\u0660".encode())
    _status(tmp_path, "0000:05:00.0", b"x" * 500)
    assert not driverinfo.asleep(str(tmp_path), "0000:04:00.0")
    assert not driverinfo.asleep(str(tmp_path), "0000:05:00.0")
    # A bus id that is no PCI address never becomes a path.
    (tmp_path / "bus/pci/power").mkdir(parents=True)
    (tmp_path / "bus/pci/power/runtime_status").write_bytes(b"suspended\n")
    assert not driverinfo.asleep(str(tmp_path), "..")


def test_the_nvidia_drivers_devices_in_bus_order(tmp_path: Path) -> None:
    bound = tmp_path / "bus/pci/drivers/nvidia"
    for name in ("0000:41:00.0", "0000:01:00.0", "bind", "new_id", "module"):
        (bound / name).mkdir(parents=True)
    assert driverinfo.nvidia_bus_ids(str(tmp_path)) == ["0000:01:00.0", "0000:41:00.0"]
    assert driverinfo.nvidia_bus_ids(str(tmp_path / "none")) == []


def test_the_driver_version_from_sysfs(tmp_path: Path) -> None:
    (tmp_path / "module/nvidia").mkdir(parents=True)
    (tmp_path / "module/nvidia/version").write_text("550.54.15\n")
    assert driverinfo.driver_version(str(tmp_path)) == "550.54.15"
    (tmp_path / "module/nvidia/version").write_text("550\u0660.1\n")
    assert driverinfo.driver_version(str(tmp_path)) == ""
    assert driverinfo.driver_version(str(tmp_path / "none")) == ""
