"""MIG instances on the device side: which nvidia-caps node opens which instance.

A process in a MIG instance holds its GPU's /dev/nvidiaN and the instance's capability nodes,
/dev/nvidia-caps/nvidia-capN, for the GPU instance (`gpu0/gi1/access`) and the compute instance
(`gpu0/gi1/ci0/access`); /proc/driver/nvidia-caps/mig-minors says which minor N is which
("gpuG": the GPU's minor). It is untrusted text: read bounded, a line that does not parse skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuguardd.records.models import DeviceNode, NvmlSnapshot

CAPS_DIRECTORY = "/dev/nvidia-caps"
# 8 GPUs x 7 instances x 2 lines, plus config/monitor, is well under 1 KiB a GPU.
MAX_MIG_MINORS_BYTES = 1 << 20
_LINE = re.compile(r"gpu(\d{1,9})/gi(\d{1,9})(?:/ci(\d{1,9}))?/access\s+(\d{1,9})")


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
    caps: dict[int, MigCap] = {}
    for line in data.decode("ascii", "replace").splitlines():
        match = _LINE.fullmatch(line.strip())
        if match:
            gpu, gi, ci, minor = match.groups()
            caps[int(minor)] = MigCap(int(gpu), int(gi), int(ci) if ci is not None else None)
    return caps, ""


def instances_for_caps(nodes: list[DeviceNode], caps: dict[int, MigCap],
                       nvml: NvmlSnapshot) -> tuple[set[int], set[str]]:
    """The GPUs (NVML indices) and MIG UUIDs that the caps nodes among `nodes` open.

    A compute-instance node names its instance. A GPU-instance node alone (the process has not
    opened a compute instance of it) stands for every compute instance in that GPU instance."""
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
            if gpu.minor != cap.gpu_minor:
                continue
            gpus.add(gpu.index)
            migs.update(i.uuid for i in gpu.mig if i.gpu_instance_id == cap.gpu_instance_id
                        and cap.compute_instance_id in (None, i.compute_instance_id))
    return gpus, migs


def annotate_device_paths(nvml: NvmlSnapshot, caps: dict[int, MigCap],
                          nodes: list[DeviceNode]) -> None:
    """Set each instance's device_path: its compute instance's caps node, by minor."""
    by_instance = {(c.gpu_minor, c.gpu_instance_id, c.compute_instance_id): minor
                   for minor, c in caps.items()}
    paths = {n.minor: n.path for n in nodes if n.role == "caps" and n.minor is not None}
    for gpu in nvml.gpus:
        for instance in gpu.mig:
            minor = by_instance.get((gpu.minor if gpu.minor is not None else -1,
                                     instance.gpu_instance_id, instance.compute_instance_id))
            if minor is not None:
                instance.device_path = paths.get(minor, f"{CAPS_DIRECTORY}/nvidia-cap{minor}")
