"""A GPU's state as the Gpu objects, `gpuguardctl gpus` and the metrics show it: one ladder
(`classify`) for a whole GPU and a MIG instance alike, from a scan's holders and NVML's figures.
"""

from __future__ import annotations

from gpuguardd.engine import leaks
from gpuguardd.engine.devices import DeviceMap
from gpuguardd.records.enums import GpuState, HolderKind, LeakKind
from gpuguardd.records.models import GpuInfo, GpuSummary, Holder, MigSummary, ScanResult


def node_gpus(device_map: DeviceMap) -> dict[int, str]:
    """GPU number -> device node, from the configured nodes alone (when NVML is unavailable,
    the number is the node's minor, as holders are attributed then)."""
    found: dict[int, str] = {}
    for node in device_map.nodes:
        if node.role == "gpu" and node.minor is not None:
            found.setdefault(node.minor, node.path)
    return found


def node_gpu_summaries(scan: ScanResult, device_map: DeviceMap) -> list[GpuSummary]:
    """`gpuguardctl gpus` without NVML: the GPUs the nodes name, memory unknown (0)."""
    summaries = []
    for index, path in sorted(node_gpus(device_map).items()):
        holders = [h for h in scan.holders if index in h.gpus]
        summaries.append(GpuSummary(
            index=index, minor=index, device_path=path, holder_count=len(holders),
            state=GpuState.IN_USE if any(_makes_in_use(h, index) for h in holders) else GpuState.UNKNOWN,
            error=scan.nvml.error or "NVML unavailable"))
    return summaries


def all_summaries(scan: ScanResult, released_below_bytes: int, device_map: DeviceMap) -> list[GpuSummary]:
    """`gpuguardctl gpus --local`: every GPU read, and without NVML those NVIDIA's nodes name."""
    found = gpu_summaries(scan, released_below_bytes)
    if not scan.nvml.available:
        read = {s.index for s in found}
        found += [s for s in node_gpu_summaries(scan, device_map) if s.index not in read]
    return sorted(found, key=lambda s: s.index)


def _makes_in_use(holder: Holder, index: int) -> bool:
    """A holder that keeps GPU `index` busy. Management clients (nvidia-persistenced,
    dcgm-exporter, gpuguardd's own NVML handles) and protected processes hold every GPU's node
    on a real host: counting them would make every GPU in-use forever and hide every leak.
    NVML's own lists (GpuInfo.processes) count whoever is on them."""
    return index in holder.gpus and holder.kind == HolderKind.COMPUTE and not holder.protected


def classify(*, suspended: bool, lost: bool, unknown: bool, busy: bool,
             leak: LeakKind | None, used: int, released_below_bytes: int
             ) -> tuple[GpuState, str]:
    """The one GPU-state ladder, for a GPU and a MIG instance alike: its state and leak kind.
    `busy`: a compute holder keeps it (_makes_in_use); `leak`: leaks.kind_of, None while a
    process NVML lists still lives. A figure that is not current or not read is never idle."""
    if suspended:
        return GpuState.SUSPENDED, ""  # never leaked: its figures are not current
    if lost:
        return GpuState.LOST, ""
    if unknown:
        return GpuState.UNKNOWN, ""
    if leak is None or busy:
        return GpuState.IN_USE, ""
    if used > released_below_bytes:
        return GpuState.LEAKED, leak.value
    return GpuState.IDLE, ""


def gpu_summaries(scan: ScanResult, released_below_bytes: int) -> list[GpuSummary]:
    """Per-GPU state as the Gpu objects and `gpuguardctl gpus` show it."""
    summaries = []
    for gpu in scan.nvml.gpus:
        holders = [h for h in scan.holders if gpu.index in h.gpus]
        # NVML's list counts as in use unless every pid on it is gone (leaks.py: dead-pids);
        # so does a holder a driver's list puts there (AMD: a DRM client's fdinfo).
        listed = any(gpu.index in h.nvml_gpus for h in holders)
        state, leak_kind = classify(
            suspended=gpu.suspended, lost=gpu.lost, unknown=gpu.unknown,
            busy=any(_makes_in_use(h, gpu.index) for h in holders),
            leak=None if listed else leaks.kind_of(gpu, scan.nvml.pids_local), used=gpu.memory_used,
            released_below_bytes=released_below_bytes if gpu.released_below is None else gpu.released_below)
        summaries.append(GpuSummary(
            index=gpu.index, uuid=gpu.uuid, name=gpu.name, pci_bus_id=gpu.pci_bus_id,
            minor=gpu.minor if gpu.minor is not None else 0, device_path=gpu.device_path,
            memory_total=gpu.memory_total, memory_used=gpu.memory_used,
            holder_count=len(holders), state=state, error=gpu.error, mig_mode=gpu.mig_mode,
            mig_instances=mig_summaries(gpu, scan.holders, released_below_bytes,
                                        scan.nvml.pids_local),
            leak_kind=leak_kind, vendor=gpu.vendor))
    return summaries


def mig_summaries(gpu: GpuInfo, holders: list[Holder], released_below_bytes: int,
                  pids_local: bool = True) -> list[MigSummary]:
    """A GPU's MIG instances as its Gpu object's MigInstances shows them: each is judged like
    a GPU of its own, on its own memory and tenants."""
    out = []
    for instance in gpu.mig:
        tenants = [h for h in holders if instance.uuid in h.mig]
        state, leak_kind = classify(
            suspended=gpu.suspended, lost=gpu.lost,
            unknown=gpu.unknown or bool(instance.error and not instance.memory_total),
            # As _makes_in_use: management holders never make it busy.
            busy=any(h.kind == HolderKind.COMPUTE and not h.protected for h in tenants),
            leak=leaks.kind_of(instance, pids_local), used=instance.memory_used,
            released_below_bytes=released_below_bytes)
        out.append(MigSummary(uuid=instance.uuid, gpu_instance_id=instance.gpu_instance_id,
                              compute_instance_id=instance.compute_instance_id,
                              device_path=instance.device_path,
                              memory_total=instance.memory_total,
                              memory_used=instance.memory_used, holder_count=len(tenants),
                              state=state, leak_kind=leak_kind))
    return out
