"""What more than one unit test module uses: a few made-up processes, GPUs, units and
requests (one copy, so that the tests of each module can sit in its own file)."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence

from gpuguardd.records.enums import GpusFrom, GpuState, HolderKind, Vendor
from gpuguardd.records.models import GpuInfo, GpuSummary, Holder, NvmlSnapshot, SweepRequest
from gpuguardd.records.report import Report, ReportScope
from gpuguardd.systemd.rules import UnitState
from tests.conftest import GiB

DEAD = 4_000_000  # above any pid_max: never a process here
LIVE = os.getpid()

HOLDER = Holder(pid=42, comm="python3", exe="/usr/bin/python3", unit="vllm.service",
                container="", kind=HolderKind.COMPUTE, gpus=[0, 1], gpu_memory=7, state="D", ppid=1)

ID = "0123456789abcdef" * 2


def request(**changes: object) -> SweepRequest:
    base = SweepRequest(gpus=["0", "GPU-1"], unit="sglang-a.service", grace_ms=2500,
                        dry_run=False, reason="hook:sglang-a.service result=success",
                        requested_by="hook:sglang-a.service", adopted=[(41, 9000)],
                        slurm_job="", report_id=ID)
    for key, value in changes.items():
        setattr(base, key, value)
    return base


NVML = NvmlSnapshot(available=True, gpus=[
    GpuInfo(0, uuid="GPU-aaaa1111-0000-4000-8000-000000000000"),
    GpuInfo(1, uuid="GPU-bbbb2222-0000-4000-8000-000000000001"),
    GpuInfo(2, uuid="GPU-bbbb3333-0000-4000-8000-000000000002"),
])


def holder(pid: int, unit: str, gpus: Sequence[int], *, start: int = 100, container: str = "",
           kind: HolderKind = HolderKind.COMPUTE, protected: bool = False) -> Holder:
    return Holder(pid=pid, comm=f"p{pid}", unit=unit, gpus=list(gpus), nvml_gpus=list(gpus),
                  gpus_from=GpusFrom.NVML if gpus else GpusFrom.NONE, start_time=start,
                  container=container, kind=kind, protected=protected,
                  cgroup=f"/system.slice/{unit}" if unit else "/escaped")


def state(active: str) -> UnitState:
    return UnitState("sglang.service", active, invocation_id="ab" * 16)


H100 = "NVIDIA H100 80GB HBM3"
MI300X = "AMD Instinct MI300X"


def summaries() -> list[GpuSummary]:
    return [GpuSummary(index=0, uuid="GPU-a", name=H100, memory_total=80 * GiB, state=GpuState.IDLE),
            GpuSummary(index=1, uuid="GPU-b", name=MI300X, vendor=Vendor.AMD, memory_total=192 * GiB,
                       memory_used=GiB, state=GpuState.IDLE)]


class CountingNvml:
    """NVML as a list of its full GPU readings (with_processes of each): nothing else asked."""

    def __init__(self) -> None:
        self.reads: list[bool] = []

    def snapshot(self, with_processes: bool = True) -> NvmlSnapshot:
        self.reads.append(with_processes)
        return copy.deepcopy(NVML)


class SweepCounter:
    """The service's sweep events; `reads_at_start`: the GPU readings made when the sweep began."""

    def __init__(self, nvml: CountingNvml) -> None:
        self.nvml = nvml
        self.reads_at_start = -1

    def sweep_started(self, report_id: str, scope: ReportScope) -> None:
        self.reads_at_start = len(self.nvml.reads)

    def process_terminated(self, report_id: str, pid: int, comm: str, unit: str,
                           signal_name: str) -> None:
        pass

    def sweep_finished(self, report: Report) -> None:
        pass

    def busy_changed(self, busy: bool) -> None:
        pass
