"""Ghost memory, classified (engine/judge.py), as the GPU objects, sweep reports, metrics and
`gpuguardctl check` show it; and which holders a GPU reset may go past (engine/reset.py)."""

from __future__ import annotations

from gpuguardd.engine.gpustate import gpu_summaries
from gpuguardd.records.enums import GpuState, HolderKind
from gpuguardd.records.models import GpuInfo, Holder, MigInstance, NvmlSnapshot, ScanResult
from tests.unit.helpers import DEAD, LIVE

GiB = 1 << 30


def summary(processes: dict[int, int | None], pids_local: bool = True, used: int = 3 * GiB,
            holders: list[Holder] | None = None) -> tuple[str, str]:
    gpu = GpuInfo(index=0, uuid="GPU-a", memory_total=80 * GiB, memory_used=used,
                  processes=processes)
    snap = NvmlSnapshot(available=True, gpus=[gpu], pids_local=pids_local)
    found = gpu_summaries(ScanResult(holders=holders or [], nvml=snap), 256 << 20)[0]
    return found.state.value, found.leak_kind


def test_each_kind_of_ghost_memory_is_told_apart() -> None:
    assert summary({}) == ("leaked", "no-process")
    assert summary({DEAD: 3 * GiB}) == ("leaked", "dead-pids")
    # One live process among the dead: someone computes there.
    assert summary({DEAD: GiB, LIVE: GiB}) == ("in-use", "")
    # From another PID namespace a pid missing here may live there: never called dead.
    assert summary({DEAD: 3 * GiB}, pids_local=False) == ("in-use", "")
    # Below the threshold nothing leaked, whatever NVML lists.
    assert summary({DEAD: None}, used=1 << 20) == ("idle", "")
    compute = Holder(pid=LIVE, kind=HolderKind.COMPUTE, gpus=[0], node_gpus=[0])
    assert summary({}, holders=[compute]) == ("in-use", "")


def test_a_mig_instance_is_classified_on_its_own() -> None:
    gone = MigInstance(uuid="MIG-a", gpu_instance_id=1, compute_instance_id=0,
                       memory_total=10 * GiB, memory_used=2 * GiB, processes={DEAD: 2 * GiB})
    busy = MigInstance(uuid="MIG-b", gpu_instance_id=2, compute_instance_id=0,
                       memory_total=10 * GiB, memory_used=2 * GiB, processes={LIVE: 2 * GiB})
    gpu = GpuInfo(index=0, uuid="GPU-a", memory_total=80 * GiB, memory_used=4 * GiB,
                  processes={DEAD: 2 * GiB, LIVE: 2 * GiB}, mig_mode=True, mig=[gone, busy])
    found = gpu_summaries(ScanResult(holders=[], nvml=NvmlSnapshot(available=True, gpus=[gpu])),
                          256 << 20)[0]
    assert found.state == GpuState.IN_USE and found.leak_kind == ""
    assert [(m.state.value, m.leak_kind) for m in found.mig_instances or []] == [
        ("leaked", "dead-pids"), ("in-use", "")]

