"""Unit tests of gpuguardd/engine/driverinfo.py."""

from __future__ import annotations

from pathlib import Path

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

