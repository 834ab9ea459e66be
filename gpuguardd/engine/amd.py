"""AMD GPUs read from the amdgpu driver's own files in sysfs: no ROCm library, no device node.

Sources (the kernel's, as of Linux 6.x):
- GPUs: KFD's topology, class/kfd/kfd/topology/nodes/<n>/ (amdkfd/kfd_topology.c): `gpu_id` (0
  for a CPU node) and `properties` ("key value" lines, decimal): `drm_render_minor`, `domain`,
  `location_id` (bus << 8 | devfn), `unique_id` (0 where the ASIC has none). Then the amdgpu
  devices KFD does not list (an APU, a Radeon without KFD), by their render nodes.
- Per GPU, its render node's PCI device: IDs, `mem_info_vram_*` (amdgpu_vram_mgr.c), `drm/card<N>`.
- Memory by process: class/kfd/kfd/proc/<pid>/vram_<gpu_id> (kfd_process.c): bytes of the
  process's KFD (ROCm) allocations, not its graphics (GEM) buffers. <pid> is in the initial PID
  namespace, and the entry outlives the process until KFD's release worker has run.
- DRM clients' memory: /proc/<pid>/fdinfo/<fd> of a render or card node (drm-usage-stats.rst,
  amdgpu_fdinfo.c): `drm-driver` (mandatory), `drm-pdev`, `drm-client-id` (one per open file
  description, shared by fds dup()ed or passed on), `drm-<category>-<region>: <uint> [KiB|MiB]`.
  `drm-resident-vram` is what leaves VRAM with the client (`drm-memory-vram` its deprecated
  alias); `drm-total-vram` counts evicted buffers too, so it counts only where neither is given.
- Names: libdrm's amdgpu.ids, amdgpu's `product_name` (the board's FRU), pci.ids, in that order.

Never waking a GPU: power/runtime_status, a PCI core attribute, is read first, and an asleep GPU's
mem_info_* files (amdgpu's: one may resume the device to answer) stay closed. PCI config and KFD
files never touch the device; /dev/kfd and /dev/dri are never opened. Every file is untrusted text.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from gpuguardd import numbers, safetext
from gpuguardd.engine.driverinfo import BDF
from gpuguardd.records.enums import Vendor
from gpuguardd.records.models import GpuInfo

AMDGPU_IDS = "/usr/share/libdrm/amdgpu.ids"
PCI_IDS = "/usr/share/misc/pci.ids"
AMD_VENDOR = 0x1002
VRAM_MAX = 2**50  # 1 PiB: past any GPU's memory, so a larger figure is a broken file
PID_MAX = 2**22  # PID_MAX_LIMIT (include/linux/threads.h)
ACTIVE = frozenset(("active", "unsupported", ""))  # "": no runtime_status, no runtime PM

_ATTR_MAX = 256  # one attribute: a number, a word, a product name (64 bytes in amdgpu)
_PROPS_MAX = 65536  # a topology node's properties: at most a page
# The properties read, each with its ceiling: MINORBITS, a 32-bit domain, bus << 8 | devfn, a u64.
_PROPS = {"drm_render_minor": 2**20 - 1, "domain": numbers.UINT32_MAX, "location_id": 0xFFFF, "unique_id": 2**64 - 1}
_IDS_MAX = 8 << 20  # pci.ids is ~1.4 MB today
_HEX = re.compile(r"0x([0-9a-f]{1,8})")
_RENDER = re.compile(r"renderD([0-9]{1,7})")
_CARD = re.compile(r"card([0-9]{1,7})")
_VRAM = re.compile(r"vram_([0-9]{1,10})")
_IDS_LINE = re.compile(r"([0-9A-Fa-f]{4}),\s*([0-9A-Fa-f]{2}),\s*(\S.*)")
_PCI_DEVICE = re.compile(r"\t([0-9a-f]{4})\s+(\S.*)")
_FDINFO_MAX = 65536  # amdgpu's is ~1 KiB; a driver with many engines a few
_FDINFO_LINE = re.compile(r"([a-z0-9_-]+):\s*(.*)")
_FDINFO_VRAM = re.compile(r"drm-(memory|resident|total)-(vram[0-9]*)")
_FDINFO_SIZE = re.compile(r"([0-9]{1,20})(?: (KiB|MiB|GiB))?")
_FDINFO_UNITS = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_FDINFO_RANK = {"resident": 0, "memory": 1, "total": 2}  # lower wins, per region


class _Bad(Exception):
    """A file that could not be read as what it should hold; the message names it."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


def _read(path: str, limit: int = _ATTR_MAX) -> str:
    """The text of sysfs file `path`, at most `limit` bytes, never following a last link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            raw = os.read(fd, limit + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _Bad(f"cannot read {path}: {exc.strerror or exc}",
                   missing=isinstance(exc, FileNotFoundError)) from None
    if len(raw) > limit:
        raise _Bad(f"cannot read {path}: longer than {limit} bytes")
    return raw.decode("utf-8", "backslashreplace")


def _uint(text: str, path: str, maximum: int) -> int:
    if not numbers.is_digits(text):
        raise _Bad(f"cannot read {path}: not a number: {numbers.shown(text)}")
    try:
        return numbers.parse_uint(text, path, maximum)
    except numbers.BadNumber:
        raise _Bad(f"cannot read {path}: out of range (at most {maximum}): {numbers.shown(text)}") from None


def _number(path: str, maximum: int) -> int:
    return _uint(_read(path).strip("\n"), path, maximum)


def _hex(path: str, maximum: int) -> int:
    text = _read(path).strip("\n")
    match = _HEX.fullmatch(text)
    if match is None or int(match.group(1), 16) > maximum:
        raise _Bad(f"cannot read {path}: not a hex number: {numbers.shown(text)}")
    return int(match.group(1), 16)


def _properties(path: str) -> dict[str, str]:
    return {key: value for key, _, value in (line.partition(" ") for line in _read(path, _PROPS_MAX).splitlines())}


@dataclass
class _Node:  # what KFD's topology says of one GPU
    gpu_id: int
    minor: int | None = None
    bdf: str = ""
    unique_id: int = 0
    error: str = ""


def _kfd_nodes(sysfs: str) -> list[_Node]:
    base = os.path.join(sysfs, "class/kfd/kfd/topology/nodes")
    try:
        names = [name for name in os.listdir(base) if numbers.is_digits(name) and len(name) < 8]
    except OSError:
        return []  # no KFD
    found: list[_Node] = []
    for name in sorted(names, key=int):
        node = _Node(gpu_id=-1)
        try:
            node.gpu_id = _number(os.path.join(base, name, "gpu_id"), numbers.UINT32_MAX)
            if node.gpu_id == 0:
                continue  # a CPU node
            path = os.path.join(base, name, "properties")
            props = _properties(path)
            values = {key: _uint(props[key], f"{path} ({key})", top) for key, top in _PROPS.items() if key in props}
            if "drm_render_minor" not in values or "location_id" not in values:
                raise _Bad(f"cannot read {path}: no drm_render_minor or location_id")
            node.minor, loc = values["drm_render_minor"], values["location_id"]
            domain = values.get("domain", 0)  # before Linux 4.20 there was none: 0
            node.bdf = f"{domain:04x}:{loc >> 8:02x}:{(loc >> 3) & 0x1F:02x}.{loc & 7}"
            node.unique_id = values.get("unique_id", 0)
        except _Bad as exc:
            node.error = str(exc)
        found.append(node)
    return found


def _amdgpu_minors(sysfs: str) -> list[tuple[str, int]]:
    """(bus id, render minor) of every render node of an amdgpu device, in PCI order."""
    base = os.path.join(sysfs, "class/drm")
    try:
        names = os.listdir(base)
    except OSError:
        return []
    found: list[tuple[str, int]] = []
    for name in names:
        match = _RENDER.fullmatch(name)
        if match is None:
            continue
        device = os.path.join(base, name, "device")
        try:
            bdf = os.path.basename(os.readlink(device))
        except OSError:
            continue
        try:
            driver = os.path.basename(os.readlink(os.path.join(device, "driver")))
        except OSError:
            driver = ""  # being unbound: the vendor decides
        if driver != "amdgpu":
            try:
                if _hex(os.path.join(device, "vendor"), 0xFFFF) != AMD_VENDOR:
                    continue
            except _Bad:
                continue
        found.append((bdf, int(match.group(1))))
    return sorted(found)


# Parsed name tables by path: ((mtime, size, inode), table), so a poll re-reads none.
_tables: dict[str, tuple[tuple[int, int, int], dict[tuple[int, int], str]]] = {}


def _table(path: str, parse: Callable[[str], dict[tuple[int, int], str]]) -> dict[tuple[int, int], str]:
    try:
        st = os.stat(path)
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        cached = _tables.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        with open(path, "rb") as handle:
            text = handle.read(_IDS_MAX).decode("utf-8", "replace")
    except OSError:
        return {}
    table = parse(text)
    _tables[path] = (stamp, table)
    return table


def _parse_amdgpu_ids(text: str) -> dict[tuple[int, int], str]:
    """libdrm's data/amdgpu.ids: '#' comments, a version line, then "DEVICE,\\tREV,\\tNAME"."""
    table: dict[tuple[int, int], str] = {}
    for line in text.splitlines():
        match = _IDS_LINE.fullmatch(line.strip())
        if match:
            key = (int(match.group(1), 16), int(match.group(2), 16))
            table.setdefault(key, safetext.clean(match.group(3).strip(), safetext.NAME_MAX))
    return table


def _parse_pci_ids(text: str) -> dict[tuple[int, int], str]:
    """pci.ids' devices of vendor 1002, as {(device, 0): name}."""
    table: dict[tuple[int, int], str] = {}
    inside = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if not line.startswith("\t"):
            inside = line.startswith(f"{AMD_VENDOR:04x} ")
            if table and not inside:
                break
            continue
        match = _PCI_DEVICE.fullmatch(line) if inside else None
        if match:
            table[(int(match.group(1), 16), 0)] = safetext.clean(match.group(2).strip(), safetext.NAME_MAX)
    return table


def _name(pci: str, device: int, revision: int) -> str:
    if name := _table(AMDGPU_IDS, _parse_amdgpu_ids).get((device, revision)):
        return name
    try:
        product = safetext.clean(_read(os.path.join(pci, "product_name")).strip(), safetext.NAME_MAX)
    except _Bad:
        product = ""
    if product and product.isprintable():
        return product
    return _table(PCI_IDS, _parse_pci_ids).get((device, 0)) or f"AMD GPU 0x{device:04x}"


def _uuid(node: _Node | None, device: int, bdf: str) -> str:
    """KFD's unique_id, as ROCm and HIP print it; without one, the device id, PCI domain (32-bit:
    VMD's start at 0x10000) and location id, unique on the host and stable across boots."""
    if node is not None and node.unique_id:
        return f"GPU-{node.unique_id:016x}"
    match = BDF.fullmatch(bdf)
    assert match is not None  # every caller checked
    domain, bus, slot, function = (int(part, 16) for part in match.groups())
    return f"GPU-{device:04x}{domain:08x}{bus << 8 | slot << 3 | function:04x}"


def _fill(gpu: GpuInfo, sysfs: str, node: _Node | None) -> None:
    if node is not None and node.error:
        raise _Bad(node.error)
    render = os.path.join(sysfs, f"class/drm/renderD{gpu.minor}")
    pci = os.path.join(render, "device")
    try:
        target = os.path.basename(os.readlink(pci))
    except OSError as exc:
        raise _Bad(f"cannot read {pci}: {exc.strerror or exc}") from None
    expected = node.bdf if node is not None else ""
    if BDF.fullmatch(target):
        if expected and target != expected:
            raise _Bad(f"{pci} is {target}, but KFD places GPU {gpu.gpu_id} at {expected}")
        gpu.pci_bus_id = target
        with contextlib.suppress(OSError):
            gpu.card_minor = next((int(m.group(1)) for m in map(_CARD.fullmatch, os.listdir(os.path.join(pci, "drm")))
                                   if m), None)
    elif expected:
        # A partition's render node (amdgpu_xcp.N, a platform device): the PCI device is KFD's.
        gpu.pci_bus_id = expected
        pci = os.path.join(sysfs, "bus/pci/devices", expected)
        gpu.warnings.append(f"{render} belongs to {safetext.clean(target, safetext.NAME_MAX)}, "
                            f"a partition of {expected}: memory figures are the whole device's")
    else:
        raise _Bad(f"cannot read {pci}: not a PCI device: {numbers.shown(target)}")
    device = _hex(os.path.join(pci, "device"), 0xFFFF)
    gpu.uuid = _uuid(node, device, gpu.pci_bus_id)
    gpu.name = _name(pci, device, _hex(os.path.join(pci, "revision"), 0xFF))
    try:
        status = _read(os.path.join(pci, "power/runtime_status"), 64).strip("\n")
    except _Bad as exc:
        if not exc.missing:
            raise
        status = ""
    if status not in ACTIVE:
        gpu.suspended = True  # the mem_info files are amdgpu's: opening one could resume it
        return
    gpu.memory_total = _number(os.path.join(pci, "mem_info_vram_total"), VRAM_MAX)
    gpu.memory_used = _number(os.path.join(pci, "mem_info_vram_used"), VRAM_MAX)


def _kfd_processes(sysfs: str, gpus: list[GpuInfo]) -> None:
    by_id = {gpu.gpu_id: gpu for gpu in gpus if gpu.gpu_id}
    base = os.path.join(sysfs, "class/kfd/kfd/proc")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return
    for name in names:
        entry = os.path.join(base, name)
        try:
            files = os.listdir(entry)
        except OSError:
            continue  # gone since listed
        ids = {int(m.group(1)) for m in map(_VRAM.fullmatch, files) if m}
        named = [by_id[i] for i in sorted(ids) if i in by_id]
        try:
            pid = numbers.parse_uint(name, "pid", PID_MAX, 1)
        except numbers.BadNumber:
            for gpu in named or list(by_id.values()):
                gpu.warnings.append(f"{base}: entry {numbers.shown(name)} is no process id: left out")
            continue
        for gpu in named:
            try:
                gpu.processes[pid] = _number(os.path.join(entry, f"vram_{gpu.gpu_id}"), VRAM_MAX)
            except _Bad as exc:
                if not exc.missing:  # a missing one went with its process: nothing to say
                    gpu.processes[pid] = None
                    gpu.warnings.append(str(exc))


def read_gpus(sysfs: str, first_index: int, *, with_processes: bool = True) -> list[GpuInfo]:
    """The AMD GPUs under `sysfs`, indexed from `first_index`: KFD's in node order, then the rest
    in PCI order. Never raises: a GPU that cannot be read is `unknown`, its `error` naming the file."""
    pairs: list[tuple[int | None, _Node | None]] = [(node.minor, node) for node in _kfd_nodes(sysfs)]
    seen = {minor for minor, _ in pairs}
    pairs += [(minor, None) for _, minor in _amdgpu_minors(sysfs) if minor not in seen]
    gpus: list[GpuInfo] = []
    for offset, (minor, node) in enumerate(pairs):
        gpu = GpuInfo(index=first_index + offset, vendor=Vendor.AMD, minor=minor,
                      gpu_id=max(node.gpu_id, 0) if node is not None else 0)
        try:
            _fill(gpu, sysfs, node)
        except _Bad as exc:
            gpu.unknown = True
            gpu.error = safetext.clean(str(exc), safetext.PATH_MAX)
        gpus.append(gpu)
    if with_processes:
        _kfd_processes(sysfs, gpus)
    return gpus


@dataclass(frozen=True)
class DrmClient:
    pdev: str = ""  # "0000:c3:00.0", "" where not given
    client_id: int | None = None
    vram_bytes: int | None = None  # None: no VRAM figure given


def _fdinfo_size(text: str) -> int | None:
    match = _FDINFO_SIZE.fullmatch(text.strip())
    if match is None:
        return None
    value = int(match.group(1)) * _FDINFO_UNITS[match.group(2) or ""]
    return value if value <= 2**63 - 1 else None


def parse_fdinfo(text: str) -> DrmClient | None:
    """A DRM client from one fdinfo file's text; None when it is none (no drm-driver)."""
    fields: dict[str, str] = {}
    vram: dict[str, tuple[int, int]] = {}  # region -> (rank, bytes)
    for line in text.splitlines():
        match = _FDINFO_LINE.fullmatch(line.strip())
        if match is None:
            continue
        key, value = match.groups()
        fields.setdefault(key, value.strip())
        memory = _FDINFO_VRAM.fullmatch(key)
        if memory and (size := _fdinfo_size(value)) is not None:
            rank = _FDINFO_RANK[memory.group(1)]
            if memory.group(2) not in vram or rank < vram[memory.group(2)][0]:
                vram[memory.group(2)] = (rank, size)
    if not fields.get("drm-driver"):
        return None
    client = fields.get("drm-client-id", "")
    return DrmClient(pdev=safetext.clean(fields.get("drm-pdev", "").lower(), safetext.NAME_MAX),
                     client_id=int(client) if numbers.is_digits(client) and len(client) <= 20 else None,
                     vram_bytes=sum(size for _, size in vram.values()) if vram else None)


def drm_vram(pid: int, fds: list[str], proc: str = "/proc") -> dict[str, int]:
    """Bytes of VRAM by PCI address held by the DRM clients behind process `pid`'s `fds` (on DRM
    nodes), each (pdev, client id) once; a vanished or unreadable fd is left out."""
    seen: set[tuple[str, int] | str] = set()
    totals: dict[str, int] = {}
    for fd in sorted(fds, key=int):
        try:
            with open(os.path.join(proc, str(pid), "fdinfo", fd), "rb") as handle:
                client = parse_fdinfo(handle.read(_FDINFO_MAX).decode("utf-8", "replace"))
        except OSError:
            continue
        key = fd if client is None or client.client_id is None else (client.pdev, client.client_id)
        if client is None or key in seen:
            continue
        seen.add(key)
        if client.vram_bytes is not None and client.pdev:
            totals[client.pdev] = totals.get(client.pdev, 0) + client.vram_bytes
    return totals
