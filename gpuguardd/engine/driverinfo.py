"""NVIDIA GPUs as the kernel describes them, without NVML: the GPUs NVML can no longer
describe, and those an NVML call would wake.

A GPU that fell off the bus gives NVML no minor number, yet its holders keep /dev/nvidiaN open;
the module still lists it in /proc/driver/nvidia/gpus/<pci bus id>/information.

Runtime PM: /sys/bus/pci/devices/<bdf>/power/runtime_status, a PCI core attribute, never calls
into the nvidia module. NVML does: a query resumes a suspended GPU, frequent ones keep it from
suspending (nvtop issue 267, beszel PR 1587, cosmic-ext-applet-system-monitor issue 38), and an
open session attaches every GPU (btop issue 1831). So nvml.py makes no NVML call naming a GPU asleep.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from gpuguardd.numbers import is_digits
from gpuguardd.records.models import GpuInfo
from gpuguardd.records.selectors import pci_key

DRIVER_GPUS_DIR = "/proc/driver/nvidia/gpus"
_MAX_READ = 16384  # the real file is under 1 KiB; anything bigger is not it
# runtime_status of a device (going) down (drivers/base/power/sysfs.c): a query would resume it.
ASLEEP = frozenset(("suspended", "suspending"))
_MAX_WORD = 64  # runtime_status and the module's version: one short word and a newline
BDF = re.compile(r"([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])")  # a PCI address as sysfs spells it
_VERSION = re.compile(r"[0-9]{1,4}(\.[0-9]{1,4}){1,3}")


@dataclass(frozen=True)
class DriverGpu:
    bus_id: str  # normalised by bus_key()
    uuid: str
    model: str
    minor: int


bus_key = pci_key  # one spelling of a PCI address, shared with the selectors


def read_driver_gpus(directory: str = DRIVER_GPUS_DIR) -> list[DriverGpu]:
    """Every GPU the module drives and NVML enumerates (excluded ones left out), by bus id."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found: list[DriverGpu] = []
    for name in names:
        try:
            with open(os.path.join(directory, name, "information"), "rb") as handle:
                lines = handle.read(_MAX_READ).decode("utf-8", "replace").splitlines()
        except OSError:
            continue
        fields = {key.strip(): value.strip() for key, sep, value in (line.partition(":") for line in lines) if sep}
        minor_text = fields.get("Device Minor", "")
        # Untrusted text: a minor that is not a small number is no minor.
        if not is_digits(minor_text) or len(minor_text) > 6:
            continue
        if fields.get("GPU Excluded", "No").lower().startswith("yes"):
            continue  # NVML does not enumerate it, so it has no index to take
        found.append(DriverGpu(bus_id=bus_key(fields.get("Bus Location", name)),
                               uuid=fields.get("GPU UUID", ""), model=fields.get("Model", ""),
                               minor=int(minor_text)))
    return sorted(found, key=lambda g: g.bus_id)


def fill_from_driver(gpus: list[GpuInfo], driver: list[DriverGpu]) -> None:
    """Give GPUs without a minor number the module's, matched by UUID, bus id, else position: NVML
    numbers GPUs in bus order, so the i-th by bus id is index i, where both list the same GPUs."""
    if not driver:
        return
    by_uuid = {g.uuid.lower(): g for g in driver if g.uuid}
    by_bus = {g.bus_id: g for g in driver}
    positional = len(driver) == len(gpus) and all(
        not gpu.pci_bus_id or bus_key(gpu.pci_bus_id) == driver[i].bus_id
        for i, gpu in enumerate(sorted(gpus, key=lambda g: g.index)))
    for gpu in gpus:
        if gpu.minor is not None:
            continue
        match = by_uuid.get(gpu.uuid.lower()) if gpu.uuid else None
        if match is None and gpu.pci_bus_id:
            match = by_bus.get(bus_key(gpu.pci_bus_id))
        if match is None and positional and 0 <= gpu.index < len(driver):
            match = driver[gpu.index]
        if match is None:
            continue
        gpu.minor = match.minor
        gpu.uuid = gpu.uuid or match.uuid
        gpu.name = gpu.name or match.model
        gpu.pci_bus_id = gpu.pci_bus_id or match.bus_id


def _word(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.read(_MAX_WORD).decode("ascii", "replace").strip()
    except OSError:
        return ""


def asleep(sysfs: str, bus_id: str) -> bool:
    """Whether the PCI device `bus_id` (NVML's or the kernel's spelling) is runtime-suspended;
    False where that cannot be read (no such device, no runtime PM, no PCI address)."""
    bdf = bus_key(bus_id)
    status = os.path.join(sysfs, "bus/pci/devices", bdf, "power/runtime_status")
    return bool(BDF.fullmatch(bdf)) and _word(status) in ASLEEP  # the address checked before it is read


def driver_version(sysfs: str) -> str:
    """The nvidia module's version (module/nvidia/version), what NVML would say, or ""."""
    text = _word(os.path.join(sysfs, "module/nvidia/version"))
    return text if _VERSION.fullmatch(text) else ""


def nvidia_bus_ids(sysfs: str) -> list[str]:
    """The PCI devices bound to the nvidia driver, in bus order (NVML's enumeration order)."""
    try:
        names = os.listdir(os.path.join(sysfs, "bus/pci/drivers/nvidia"))
    except OSError:
        return []
    return sorted(name for name in names if BDF.fullmatch(name))
