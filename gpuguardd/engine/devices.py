"""Which device files gpuguard watches, and how to recognise them from any mount namespace.

A process in a container may reach a GPU through a node at another path or inode (Docker's
--device creates fresh nodes); its device number survives that. So nodes are indexed by path,
inode (for mmaps) and rdev, with the drivers' majors from /proc/devices as the last resort.

MIG: a process in an instance holds its GPU's /dev/nvidiaN and the instance's capability nodes,
/dev/nvidia-caps/nvidia-capN, for the GPU instance (`gpu0/gi1/access`) and the compute instance
(`gpu0/gi1/ci0/access`; gpuG: the GPU's minor), each N as untrusted /proc/driver/nvidia-caps/mig-minors says.
"""

from __future__ import annotations

import glob
import os
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpuguardd.records.models import DeviceNode, NvmlSnapshot

_GPU_NAME = re.compile(r"^nvidia([0-9]{1,7})$")
# amdgpu's DRM nodes: /dev/dri/renderD<minor> (compute, rendering) and card<minor> (modesetting).
_DRM_NAME = re.compile(r"^(renderD|card)([0-9]{1,7})$")
DRM_RENDER_MINOR_BASE = 128  # drm_minor_type: primary 0-63, (control 64-127), render 128-
_CAPS_NAME = re.compile(r"^nvidia-cap([0-9]{1,7})$")
# Driver names in /proc/devices -> role of their minors (see the NVIDIA driver's nv.c and uvm).
_DRIVER_MAJORS = {"nvidia-frontend": "nvidia", "nvidia": "nvidia", "nvidia-uvm": "uvm",
                  "nvidia-caps": "caps", "nvidia-caps-imex-channels": "imex",
                  "nvidia-nvswitch": "other", "nvidia-nvlink": "other",
                  # AMD (docs/real-hosts.md, "AMD GPUs"): amdkfd registers "kfd"; every DRM driver
                  # shares "drm" (226), so its nodes count only where amdgpu drives them.
                  "kfd": "kfd", "drm": "drm"}
_NAMED_ROLES = {"kfd": "kfd", "nvidiactl": "control", "nvidia-uvm": "uvm", "nvidia-modeset": "modeset"}
NVIDIA_CTL_MINOR = 255
NVIDIA_MODESET_MINOR = 254
CAPS_DIRECTORY = "/dev/nvidia-caps"
MAX_MIG_MINORS_BYTES = 1 << 20  # 8 GPUs x 7 instances x 2 lines, plus config/monitor: under 1 KiB a GPU
_MIG_LINE = re.compile(r"gpu(\d{1,9})/gi(\d{1,9})(?:/ci(\d{1,9}))?/access\s+(\d{1,9})")


@dataclass(frozen=True)
class MigCap:
    gpu_minor: int
    gpu_instance_id: int
    compute_instance_id: int | None  # None: the GPU instance's own access node


def read_mig_minors(path: str) -> tuple[dict[int, MigCap], str]:
    """caps minor -> what it opens, and a problem worth a warning ("" when none: a missing file
    is no MIG here)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_MIG_MINORS_BYTES + 1)
    except FileNotFoundError:
        return {}, ""
    except OSError as exc:
        return {}, f"cannot read {path}: {exc.strerror or exc}: MIG caps nodes map to no instance"
    if len(data) > MAX_MIG_MINORS_BYTES:
        return {}, f"{path} is over {MAX_MIG_MINORS_BYTES} bytes: not read"
    lines = (_MIG_LINE.fullmatch(line.strip()) for line in data.decode("ascii", "replace").splitlines())
    return {int(m[4]): MigCap(int(m[1]), int(m[2]), int(m[3]) if m[3] is not None else None) for m in lines if m}, ""


def role_for_name(path: str) -> tuple[str, int | None]:
    name = os.path.basename(path)
    match = _GPU_NAME.match(name)
    if match:
        return "gpu", int(match.group(1))
    if name in _NAMED_ROLES:
        return _NAMED_ROLES[name], None
    drm = _DRM_NAME.match(name)
    if drm:
        return ("render" if drm.group(1) == "renderD" else "card"), int(drm.group(2))
    if "nvidia-caps" in path or name.startswith("nvidia-cap"):
        # /dev/nvidia-caps/nvidia-capN: N is the minor that mig-minors maps to a MIG instance.
        caps = _CAPS_NAME.match(name)
        return "caps", int(caps.group(1)) if caps and "imex" not in path else None
    # nvidia-uvm-tools (profilers), nvidia-nvswitchctl and friends: a GPU handle, not a context.
    return "control", None


def driver_majors() -> dict[int, str]:
    """Character majors registered by the GPU drivers (NVIDIA's, amdkfd, DRM) -> a role family."""
    try:
        with open("/proc/devices", encoding="ascii", errors="replace") as handle:
            chars = handle.read().partition("Character devices")[2].partition("Block devices")[0]
    except OSError:
        return {}
    return {int(parts[0]): _DRIVER_MAJORS[parts[1]] for parts in map(str.split, chars.splitlines())
            if len(parts) == 2 and parts[0].isdigit() and parts[1] in _DRIVER_MAJORS}


@dataclass
class DeviceMap:
    nodes: list[DeviceNode] = field(default_factory=list)
    by_path: dict[str, DeviceNode] = field(default_factory=dict)
    by_rdev: dict[int, DeviceNode] = field(default_factory=dict)
    by_inode: dict[tuple[int, int], DeviceNode] = field(default_factory=dict)
    majors: dict[int, str] = field(default_factory=dict)
    # Substrings found on every /proc/<pid>/maps line naming a watched node (which is then checked
    # exactly): " <common path prefix>" per node directory, " <dev> " per filesystem; two searches a process.
    maps_prefilter: tuple[bytes, ...] = ()
    warnings: list[str] = field(default_factory=list)
    mig_caps: dict[int, MigCap] = field(default_factory=dict)  # nvidia-caps minor -> the instance it opens
    # The DRM minors (render and card) of the GPUs amdgpu drives: other DRM nodes (an Intel
    # iGPU, a virtual display) are nobody's GPU here, and their holders no GPU holders.
    amd_minors: frozenset[int] = frozenset()

    def node_for_rdev(self, rdev: int) -> DeviceNode | None:
        node = self.by_rdev.get(rdev)
        family = self.majors.get(os.major(rdev))
        minor = os.minor(rdev)
        if node is not None or family is None:
            return node
        if family == "drm" and minor not in self.amd_minors:
            return None  # DRM's major is every DRM driver's: only amdgpu's nodes are GPUs'
        role = {"nvidia": {NVIDIA_CTL_MINOR: "control", NVIDIA_MODESET_MINOR: "modeset"}.get(minor, "gpu"),
                "uvm": "uvm" if minor == 0 else "control", "caps": "caps", "imex": "caps", "kfd": "kfd",
                "drm": "render" if minor >= DRM_RENDER_MINOR_BASE else "card"}.get(family, "control")
        numbered = role in ("gpu", "render", "card") or family == "caps"
        # A node we were not configured with, e.g. created inside a container: name it by number.
        return DeviceNode(f"char:{os.major(rdev)}:{minor}", role, minor=minor if numbered else None, rdev=rdev)


def refusal(st: os.stat_result, driver: Iterable[int], allowed: Iterable[int]) -> str | None:
    """Why a watched path must not count as a GPU device, or None: else every holder of it is a GPU
    holder (with /dev/null's numbers, each `| grep` a management client --include-management kills)."""
    if not stat.S_ISCHR(st.st_mode):
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else "a block device" if stat.S_ISBLK(
            st.st_mode) else "not a device"
        return f"not a character device ({kind})"
    major = os.major(st.st_rdev)
    if major not in driver and major not in allowed:
        return (f"character device {major}:{os.minor(st.st_rdev)}, and major {major} is no GPU "
                "driver's in /proc/devices nor in [Devices] AllowMajors")
    return None


def build_device_map(patterns: Iterable[str], allow_majors: Iterable[int] = (),
                     origin: Callable[[str], str] | None = None, mig_minors: str | None = None,
                     amd_minors: frozenset[int] = frozenset()) -> DeviceMap:
    """The nodes `patterns` name now, but for what is no character device of a GPU driver's major (or
    `allow_majors`): left out with a warning saying where it was configured (`origin`) and why. DRM
    nodes amdgpu does not drive are left out silently: the default Paths match every /dev/dri node."""
    device_map = DeviceMap(majors=driver_majors(), amd_minors=amd_minors)
    allowed = frozenset(allow_majors)
    by_dir: dict[str, list[str]] = {}
    devs: set[bytes] = set()
    if mig_minors:
        device_map.mig_caps, problem = read_mig_minors(mig_minors)
        if problem:
            device_map.warnings.append(problem)
    for pattern in patterns:
        paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        for path in paths:
            try:
                st = os.stat(path)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) or path in device_map.by_path:
                continue
            why = refusal(st, device_map.majors, allowed)
            if why is not None:
                where = f" ({origin(pattern)})" if origin is not None else ""
                shown = path if path == pattern else f"{path} (matched by {pattern})"
                device_map.warnings.append(f"[Devices] Paths{where}: ignored {shown}: {why}")
                continue
            # Every node here is a character device (refusal): a real driver's node goes by the
            # minor it was made with, whatever its name says.
            role, minor = role_for_name(path)
            rdev = st.st_rdev
            family = device_map.majors.get(os.major(rdev))
            if role in ("render", "card"):
                minor = os.minor(rdev)
                if family == "drm" and minor not in amd_minors:
                    continue
            if (role == "gpu" and family is not None) or (role == "caps" and family == "caps"):
                minor = os.minor(rdev)
            node = DeviceNode(path=path, role=role, minor=minor, rdev=rdev, inode=(st.st_dev, st.st_ino))
            device_map.nodes.append(node)
            device_map.by_path[path] = node
            device_map.by_rdev.setdefault(rdev, node)
            device_map.by_inode[(st.st_dev, st.st_ino)] = node
            by_dir.setdefault(os.path.dirname(path), []).append(os.path.basename(path))
            devs.add(f" {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} ".encode())  # maps' "%02x:%02x"
    if not device_map.nodes and not device_map.majors:
        device_map.warnings.append(f"no device files match {' '.join(patterns)} and no GPU driver is registered "
                                   "in /proc/devices: nothing can hold a GPU here")
    # Character by character on purpose: "/dev/nvidia" covers nvidia0, nvidiactl, nvidia-uvm.
    prefixes = {b" " + os.path.join(directory, os.path.commonprefix(names)).encode()  # noqa: RUF071
                for directory, names in by_dir.items()}
    device_map.maps_prefilter = tuple(sorted(prefixes | devs))
    return device_map


def instances_for_caps(nodes: list[DeviceNode], caps: dict[int, MigCap],
                       nvml: NvmlSnapshot) -> tuple[set[int], set[str]]:
    """The GPUs (NVML indices) and MIG UUIDs that the caps nodes among `nodes` open. A GPU-instance
    node without one of its compute instances' stands for every compute instance in it."""
    held = [caps[n.minor] for n in nodes if n.role == "caps" and n.minor is not None and n.minor in caps]
    gpus: set[int] = set()
    migs: set[str] = set()
    with_ci = {(c.gpu_minor, c.gpu_instance_id) for c in held if c.compute_instance_id is not None}
    for cap in held:
        if cap.compute_instance_id is None and (cap.gpu_minor, cap.gpu_instance_id) in with_ci:
            continue
        if not nvml.available:
            gpus.add(cap.gpu_minor)  # as for /dev/nvidiaN without NVML: the minor names it
            continue
        for gpu in nvml.gpus:
            if gpu.minor == cap.gpu_minor:
                gpus.add(gpu.index)
                migs.update(i.uuid for i in gpu.mig if i.gpu_instance_id == cap.gpu_instance_id
                            and cap.compute_instance_id in (None, i.compute_instance_id))
    return gpus, migs


def annotate_device_paths(nvml: NvmlSnapshot, caps: dict[int, MigCap], nodes: list[DeviceNode]) -> None:
    """Set each instance's device_path: its compute instance's caps node, by minor."""
    by_instance = {(c.gpu_minor, c.gpu_instance_id, c.compute_instance_id): minor for minor, c in caps.items()}
    paths = {n.minor: n.path for n in nodes if n.role == "caps" and n.minor is not None}
    for gpu in nvml.gpus:
        for instance in gpu.mig:
            minor = by_instance.get((gpu.minor if gpu.minor is not None else -1,
                                     instance.gpu_instance_id, instance.compute_instance_id))
            if minor is not None:
                instance.device_path = paths.get(minor, f"{CAPS_DIRECTORY}/nvidia-cap{minor}")
