"""The nvidia kernel module's own list of GPUs, for the ones NVML can no longer describe.

A GPU that fell off the bus gives NVML no minor number, yet its holders keep /dev/nvidiaN
open: without the minor a sweep of that GPU would miss them. The module lists every GPU it
drives, whatever its state, in /proc/driver/nvidia/gpus/<pci bus id>/information.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpuguardd.numbers import is_digits
from gpuguardd.records.models import GpuInfo
from gpuguardd.records.selectors import pci_key

DRIVER_GPUS_DIR = "/proc/driver/nvidia/gpus"
_MAX_READ = 16384  # the real file is under 1 KiB; anything bigger is not it


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
    """Give GPUs without a minor number the module's, matched by UUID, then by bus id, and
    only then by position: NVML numbers GPUs in PCI bus order, so the i-th GPU by bus id is
    index i, but only when both list the same GPUs (same count, and every GPU whose bus id
    NVML did give sits at its own position)."""
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
