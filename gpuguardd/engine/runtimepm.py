"""Whether a GPU is runtime-suspended, read from sysfs so that asking never wakes it.

A dGPU laptop (and a desk-side box with runtime D3 enabled) powers an idle NVIDIA GPU down;
the kernel's PCI runtime PM says so in /sys/bus/pci/devices/<bdf>/power/runtime_status
("active", "suspending", "suspended", "resuming"). Reading that file is a sysfs attribute of
the PCI core: it never calls into the nvidia module, so it never resumes the GPU.

NVML queries do: a device query (memory info, process lists, and the rest) on a suspended
GPU resumes it, and frequent queries keep it from suspending at all. That is what nvtop did
until it checked runtime_status before opening a render node (Syllo/nvtop issue 267), what
waybar's GPU module stopped by the same check (PolpOnline/gpu-usage-waybar PR 41), what the
COSMIC system monitor applet fixed the same way (D-Brox/cosmic-ext-applet-system-monitor issue
38, PR 39: "an NVML query against an already-suspended dGPU resumes it"), and beszel found of
nvmlDeviceGetMemoryInfo in particular (henrygd/beszel PR 1587: it restarts the driver's
suspend timer). So nvml.py asks here first and makes no NVML call naming a GPU found asleep.
Nor does it keep an NVML session while every GPU sleeps: nvmlInit attaches every GPU, opening
its device node, and resumes a suspended one (btop issue 1831); an open session keeps a GPU's
runtime PM usage count up (cosmic-ext-applet-system-monitor issue 38).

Which GPU is which bus id without asking NVML: the bus id NVML gave when the GPU was last read
(nvml.py keeps it), or, before any read since nvmlInit, the devices the nvidia driver is bound
to, in bus order, which is NVML's enumeration order (driverinfo.fill_from_driver relies on the
same), used only when both count the same GPUs.
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
