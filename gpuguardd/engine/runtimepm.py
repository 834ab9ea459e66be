"""Whether a GPU is runtime-suspended, read from sysfs so that asking never wakes it.

The kernel's PCI runtime PM says so in /sys/bus/pci/devices/<bdf>/power/runtime_status, an
attribute of the PCI core that never calls into the nvidia module. NVML queries do: one on a
suspended GPU resumes it, and frequent ones keep it from suspending (nvtop issue 267, beszel
PR 1587, cosmic-ext-applet-system-monitor issue 38), and an open session attaches every GPU
(btop issue 1831). So nvml.py asks here first, and makes no NVML call naming a GPU asleep.
"""

from __future__ import annotations

import os
import re

from gpuguardd.engine.driverinfo import bus_key

# What the kernel writes there (drivers/base/power/sysfs.c, rtpm_status_show) for a device
# (going) down: a query now would resume it.
ASLEEP = frozenset(("suspended", "suspending"))
_MAX_READ = 64  # the attribute is one short word and a newline
# A PCI address as the kernel spells it in sysfs: domain:bus:device.function, lower-case hex.
BDF = re.compile(r"([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])")
_VERSION = re.compile(r"[0-9]{1,4}(\.[0-9]{1,4}){1,3}")


def asleep(sysfs: str, bus_id: str) -> bool:
    """Whether the PCI device `bus_id` (NVML's or the kernel's spelling) is runtime-suspended;
    False where that cannot be read (no such device, no runtime PM, no PCI address)."""
    bdf = bus_key(bus_id)
    if not BDF.fullmatch(bdf):
        return False
    try:
        with open(os.path.join(sysfs, "bus/pci/devices", bdf, "power/runtime_status"), "rb") as handle:
            raw = handle.read(_MAX_READ)
    except OSError:
        return False
    return raw.decode("ascii", "replace").strip() in ASLEEP


def driver_version(sysfs: str) -> str:
    """The nvidia module's version (module/nvidia/version), what NVML would say, or ""."""
    try:
        with open(os.path.join(sysfs, "module/nvidia/version"), "rb") as handle:
            text = handle.read(_MAX_READ).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return text if _VERSION.fullmatch(text) else ""


def nvidia_bus_ids(sysfs: str) -> list[str]:
    """The PCI devices bound to the nvidia driver, in bus order (NVML's enumeration order)."""
    try:
        names = os.listdir(os.path.join(sysfs, "bus/pci/drivers/nvidia"))
    except OSError:
        return []
    return sorted(name for name in names if BDF.fullmatch(name))
