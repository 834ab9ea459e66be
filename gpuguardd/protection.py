"""Who a sweep must never signal, and why. The answer is on the holder before any signal."""

from __future__ import annotations

import os
from collections.abc import Iterable

from . import procfs
from .config import Config
from .models import Holder


def protection_reason(holder: Holder, config: Config, own_chain: Iterable[int]) -> str | None:
    if holder.pid == 1:
        return "PID 1 (init)"
    stat = procfs.read_stat(holder.pid)
    if holder.pid == 2 or (stat is not None and stat.is_kernel_thread):
        return "kernel thread"
    if holder.pid == os.getpid():
        return "gpuguard itself"
    if holder.pid in own_chain:
        return "an ancestor of the sweeping process"
    if holder.state == "Z":
        # A zombie runs no code and holds no files; signalling it is harmless and it is
        # reported as a survivor with its parent named.
        return None
    if not holder.exe:
        # Without the real executable we cannot rule out a protected daemon; comm proves nothing.
        return f"executable unknown (cannot read /proc/{holder.pid}/exe)"
    pattern = config.is_protected_executable(holder.exe)
    if pattern is not None:
        return f"protected executable {holder.exe}" + (f" (matches {pattern})" if pattern != holder.exe else "")
    if not holder.container:
        unit_pattern = config.is_protected_unit(holder.unit)
        if unit_pattern is not None:
            return f"protected unit {holder.unit}"
    return None


def mark_protection(holder: Holder, config: Config, own_chain: Iterable[int]) -> None:
    reason = protection_reason(holder, config, own_chain)
    holder.protected = reason is not None
    holder.protected_why = reason or ""
