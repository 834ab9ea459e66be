"""Names of the D-Bus contract (docs/contract.md), shared by the daemon, the client and the tests."""

from __future__ import annotations

import os

BUS_NAME = "org.gpuguard.GpuGuard1"
MANAGER_PATH = "/org/gpuguard/GpuGuard1"
MANAGER_INTERFACE = BUS_NAME + ".Manager"
GPU_INTERFACE = BUS_NAME + ".Gpu"
ERROR_PREFIX = BUS_NAME + ".Error."

ACTION_VIEW_DETAILS = BUS_NAME + ".view-details"

# Lets tests and admins point gpuguardctl at a bus other than the system bus.
ENV_BUS_ADDRESS = "GPUGUARD_BUS_ADDRESS"

# For the CLI without dbus-fast: an unreadable uid is sent as (uid_t)-1, which Linux never gives a
# process (marshal.holder); the last entry of a cut reply says how many were left out (replysize).
UID_UNKNOWN = 2**32 - 1
OMITTED_KEY = "omitted_after"

PROPERTIES_INTERFACE = "org.freedesktop.DBus.Properties"


def gpu_path(index: int) -> str:
    return f"{MANAGER_PATH}/gpu/{index}"


def default_address(explicit: str | None) -> str | None:
    """`explicit`, else $GPUGUARD_BUS_ADDRESS, else None: the system bus. Here so --local needs no dbus-fast."""
    return explicit or os.environ.get(ENV_BUS_ADDRESS) or None
