"""A GPU's state as the Gpu objects, `gpuguardctl gpus` and the metrics show it: the judge's
verdict for a whole GPU and a MIG instance alike, from a scan's holders and NVML's figures."""

from __future__ import annotations

from gpuguardd.engine.devices import DeviceMap
from gpuguardd.engine.judge import facts_of, facts_of_record, judge, released_line
from gpuguardd.records.enums import GpuState
from gpuguardd.records.models import GpuInfo, GpuSummary, MigSummary, ScanResult


def node_gpus(device_map: DeviceMap) -> dict[int, str]:
    """GPU number -> device node, from the configured nodes alone (when NVML is unavailable,
    the number is the node's minor, as holders are attributed then)."""
    found: dict[int, str] = {}
    for node in device_map.nodes:
        if node.role == "gpu" and node.minor is not None:
            found.setdefault(node.minor, node.path)
    return found


def all_summaries(scan: ScanResult, released_below_bytes: int, device_map: DeviceMap) -> list[GpuSummary]:
    """`gpuguardctl gpus --local`: every GPU read; without NVML also those NVIDIA's nodes name,
    memory unknown (0), in use where a compute holder may be on it (the judge), else unknown."""
    found = gpu_summaries(scan, released_below_bytes)
    if not scan.nvml.available:
        read = {s.index for s in found}
        error = scan.nvml.error or "NVML unavailable"
        for index, path in sorted(node_gpus(device_map).items()):
            if index not in read:
                verdict = judge(facts_of_record(index, "", None, scan.holders, error))
                found.append(GpuSummary(index=index, minor=index, device_path=path, state=verdict.state, error=error,
                                        holder_count=sum(index in h.gpus for h in scan.holders)))
    return sorted(found, key=lambda s: s.index)


def _leak_kind(state: GpuState, leak: object) -> str:
    return str(leak) if state == GpuState.LEAKED and leak is not None else ""


def gpu_summaries(scan: ScanResult, released_below_bytes: int) -> list[GpuSummary]:
    summaries = []
    for gpu in scan.nvml.gpus:
        verdict = judge(facts_of(gpu, None, scan.holders, released_below_bytes, scan.nvml.pids_local))
        summaries.append(GpuSummary(
            index=gpu.index, uuid=gpu.uuid, name=gpu.name, pci_bus_id=gpu.pci_bus_id,
            minor=gpu.minor if gpu.minor is not None else 0, device_path=gpu.device_path,
            memory_total=gpu.memory_total, memory_used=gpu.memory_used,
            holder_count=sum(gpu.index in h.gpus for h in scan.holders), state=verdict.state, error=gpu.error,
            mig_mode=gpu.mig_mode, mig_instances=mig_summaries(gpu, scan, released_below_bytes),
            leak_kind=_leak_kind(verdict.state, verdict.leak), vendor=gpu.vendor,
            released_below=released_line(gpu, released_below_bytes)))
    return summaries


def mig_summaries(gpu: GpuInfo, scan: ScanResult, released_below_bytes: int) -> list[MigSummary]:
    """A GPU's MIG instances, each judged like a GPU of its own, on its own memory and tenants."""
    out = []
    for instance in gpu.mig:
        verdict = judge(facts_of(gpu, instance, scan.holders, released_below_bytes, scan.nvml.pids_local))
        out.append(MigSummary(uuid=instance.uuid, gpu_instance_id=instance.gpu_instance_id,
                              compute_instance_id=instance.compute_instance_id, device_path=instance.device_path,
                              memory_total=instance.memory_total, memory_used=instance.memory_used,
                              holder_count=sum(instance.uuid in h.mig for h in scan.holders),
                              state=verdict.state, leak_kind=_leak_kind(verdict.state, verdict.leak)))
    return out
