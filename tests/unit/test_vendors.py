"""Manager.Vendors: the vendors whose GPUs the daemon reads now (daemon/publisher.py), and a
GPU summary's vendor as its Gpu object shows it."""

from __future__ import annotations

from gpuguardd.bus.interfaces import GpuInterface
from gpuguardd.daemon.publisher import vendors
from gpuguardd.records.enums import Vendor
from gpuguardd.records.models import GpuSummary, NvmlSnapshot


def test_vendors_are_those_of_the_gpus_and_nvidia_while_nvml_answers() -> None:
    nvidia, amd = GpuSummary(index=0), GpuSummary(index=1, vendor=Vendor.AMD)
    assert vendors(NvmlSnapshot(available=True), [nvidia]) == ["nvidia"]
    # NVML answers with no GPU listed: its reader works.
    assert vendors(NvmlSnapshot(available=True), []) == ["nvidia"]
    assert vendors(NvmlSnapshot(available=True), [amd, nvidia]) == ["amd", "nvidia"]
    # No NVML, AMD GPUs: a working host, reading AMD's.
    assert vendors(NvmlSnapshot(available=False, error="no driver"), [amd]) == ["amd"]
    assert vendors(NvmlSnapshot(available=False), []) == []


def test_a_gpu_object_carries_its_vendor() -> None:
    assert GpuInterface(GpuSummary(index=0).to_dict()).value("Vendor") == "nvidia"
    amd = GpuSummary(index=1, name="AMD Instinct MI300X", vendor=Vendor.AMD)
    gpu = GpuInterface(amd.to_dict())
    assert (gpu.value("Vendor"), gpu.value("Name")) == ("amd", "AMD Instinct MI300X")
