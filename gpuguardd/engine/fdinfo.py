"""DRM clients and their VRAM, from /proc/<pid>/fdinfo (the kernel's drm-usage-stats).

Documentation/gpu/drm-usage-stats.rst: each open DRM file's fdinfo has "key:<tab>value" lines;
`drm-driver` (mandatory), `drm-pdev` (the PCI address), `drm-client-id` (unique per open file
description of the device: several fds, dup()ed or passed on, share it), and memory as
`drm-<category>-<region>: <uint> [KiB|MiB]` (no unit: bytes; GiB accepted too). amdgpu
(amdgpu/amdgpu_fdinfo.c) names its regions "cpu", "gtt", "vram"; xe numbers them ("vram0").

Which figure: `drm-resident-vram` is what the buffers occupy in VRAM now, the figure that
mem_info_vram_used drops by when the client goes; `drm-memory-vram` (amdgpu's, in KiB) is the
deprecated alias of the same. `drm-total-vram` counts buffers created for VRAM whether or not
they are there (evicted ones too), so it is used only where neither of the others is given.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from gpuguardd import numbers, safetext

_FDINFO_MAX = 65536  # amdgpu's is ~1 KiB; a driver with many engines a few
_VALUE_MAX = 2**63 - 1
_UNITS = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_LINE = re.compile(r"([a-z0-9_-]+):\s*(.*)")
_MEMORY = re.compile(r"drm-(memory|resident|total)-(vram[0-9]*)")
_SIZE = re.compile(r"([0-9]{1,20})(?: (KiB|MiB|GiB))?")
_RANK = {"resident": 0, "memory": 1, "total": 2}  # lower wins, per region


@dataclass(frozen=True)
class DrmClient:
    pdev: str = ""  # "0000:c3:00.0", "" where not given
    client_id: int | None = None
    vram_bytes: int | None = None  # None: no VRAM figure given


def _size(text: str) -> int | None:
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        return None
    value = int(match.group(1)) * _UNITS[match.group(2) or ""]
    return value if value <= _VALUE_MAX else None


def parse(text: str) -> DrmClient | None:
    """A DRM client from one fdinfo file's text; None when it is none (no drm-driver)."""
    fields: dict[str, str] = {}
    vram: dict[str, tuple[int, int]] = {}  # region -> (rank, bytes)
    for line in text.splitlines():
        match = _LINE.fullmatch(line.strip())
        if match is None:
            continue
        key, value = match.groups()
        fields.setdefault(key, value.strip())
        memory = _MEMORY.fullmatch(key)
        size = _size(value) if memory else None
        if memory and size is not None:
            rank = _RANK[memory.group(1)]
            if memory.group(2) not in vram or rank < vram[memory.group(2)][0]:
                vram[memory.group(2)] = (rank, size)
    if not fields.get("drm-driver"):
        return None
    client = fields.get("drm-client-id", "")
    return DrmClient(pdev=safetext.clean(fields.get("drm-pdev", "").lower(), safetext.NAME_MAX),
                     client_id=int(client) if numbers.is_digits(client) and len(client) <= 20 else None,
                     vram_bytes=sum(size for _, size in vram.values()) if vram else None)


def drm_clients(pid: int, proc: str = "/proc", *, fds: list[str]) -> list[DrmClient]:
    """The DRM clients behind process `pid`'s `fds` (those the holder scan found on DRM nodes),
    each (pdev, client id) once. A vanished or unreadable fd is left out, silently."""
    found: dict[tuple[str, int] | str, DrmClient] = {}
    for fd in sorted(fds, key=int):
        try:
            with open(os.path.join(proc, str(pid), "fdinfo", fd), "rb") as handle:
                raw = handle.read(_FDINFO_MAX)
        except OSError:
            continue
        client = parse(raw.decode("utf-8", "replace"))
        if client is not None:
            key = (client.pdev, client.client_id) if client.client_id is not None else fd
            found.setdefault(key, client)
    return list(found.values())


def vram_by_pdev(clients: Iterable[DrmClient]) -> dict[str, int]:
    """Bytes of VRAM by PCI address over one process's `clients`."""
    totals: dict[str, int] = {}
    for client in clients:
        if client.vram_bytes is not None and client.pdev:
            totals[client.pdev] = totals.get(client.pdev, 0) + client.vram_bytes
    return totals
