"""Whether a GPU is runtime-suspended, read from sysfs so that asking never wakes it.

The kernel's PCI runtime PM says so in /sys/bus/pci/devices/<bdf>/power/runtime_status, an
attribute of the PCI core that never calls into the nvidia module. NVML queries do: one on a
suspended GPU resumes it, and frequent ones keep it from suspending (nvtop issue 267, beszel
PR 1587, cosmic-ext-applet-system-monitor issue 38), and an open session attaches every GPU
(btop issue 1831). So nvml.py asks here first, and makes no NVML call naming a GPU asleep.

Which GPU is which bus id without NVML: the bus id NVML gave when it last read the GPU, or,
before that, the devices the nvidia driver is bound to, in bus order (NVML's), used only
when both count the same GPUs.
"""

from __future__ import annotations

import os
import re

from gpuguardd.engine.driverinfo import bus_key

DEFAULT_SYSFS = "/sys"
# Both mean the device is (going) down: a query now would resume it.
ASLEEP = frozenset(("suspended", "suspending"))
_MAX_READ = 64  # the attribute is one short word and a newline
# What the kernel writes there (drivers/base/power/sysfs.c, rtpm_status_show).
_WORDS = frozenset(("active", "resuming", "suspended", "suspending", "error", "unsupported"))
# A PCI address as the kernel spells it in sysfs: domain:bus:device.function, lower-case hex.
_BDF = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_VERSION = re.compile(r"[0-9]{1,4}(\.[0-9]{1,4}){1,3}")


def runtime_status(sysfs: str, bus_id: str) -> str:
    """The runtime PM status of the PCI device `bus_id` (NVML's or the kernel's spelling):
    "active", "suspended" and so on, or "" when it cannot be read (no such device, runtime PM
    not supported, a bus id that is no PCI address)."""
    bdf = bus_key(bus_id)
    if not _BDF.fullmatch(bdf):
        return ""
    try:
        with open(os.path.join(sysfs, "bus/pci/devices", bdf, "power/runtime_status"), "rb") as handle:
            raw = handle.read(_MAX_READ)
    except OSError:
        return ""
    text = raw.decode("ascii", "replace").strip()
    # Untrusted text all the same: one of the kernel's words, or nothing.
    return text if text in _WORDS else ""


def asleep(sysfs: str, bus_id: str) -> bool:
    return runtime_status(sysfs, bus_id) in ASLEEP


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
    return sorted(name for name in names if _BDF.fullmatch(name))
