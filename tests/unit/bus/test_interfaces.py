"""Manager.Vendors: the vendors whose GPUs the daemon reads now (NvmlSnapshot.vendors), and a
GPU summary's vendor as its Gpu object shows it."""

from __future__ import annotations

from gpuguardd.bus.interfaces import GpuInterface
from gpuguardd.records.enums import Vendor
from gpuguardd.records.models import GpuInfo, GpuSummary, NvmlSnapshot


def test_vendors_are_those_of_the_gpus_and_nvidia_while_nvml_answers() -> None:
    nvidia, amd = GpuInfo(index=0), GpuInfo(index=1, vendor=Vendor.AMD)
    assert NvmlSnapshot(available=True, gpus=[nvidia]).vendors == ["nvidia"]
    # NVML answers with no GPU listed: its reader works.
    assert NvmlSnapshot(available=True).vendors == ["nvidia"]
    assert NvmlSnapshot(available=True, gpus=[amd, nvidia]).vendors == ["amd", "nvidia"]
    # No NVML, AMD GPUs: a working host, reading AMD's.
    assert NvmlSnapshot(available=False, error="no driver", gpus=[amd]).vendors == ["amd"]
    assert NvmlSnapshot(available=False).vendors == []


def test_a_gpu_object_carries_its_vendor() -> None:
    assert GpuInterface(GpuSummary(index=0).to_dict())._values["Vendor"] == "nvidia"
    amd = GpuSummary(index=1, name="AMD Instinct MI300X", vendor=Vendor.AMD)
    gpu = GpuInterface(amd.to_dict())
    assert (gpu._values["Vendor"], gpu._values["Name"]) == ("amd", "AMD Instinct MI300X")
