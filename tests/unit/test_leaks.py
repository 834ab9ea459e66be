"""Ghost memory, classified (engine/leaks.py), as the GPU objects, sweep reports, metrics and
`gpuguardctl check` show it; and which holders a GPU reset may go past (engine/reset.py)."""

from __future__ import annotations

import io
import os

from gpuguardd.cli import output
from gpuguardd.cli.check import check
from gpuguardd.daemon.metrics import Metrics
from gpuguardd.engine.gpustate import gpu_summaries
from gpuguardd.engine.judge import facts_of, judge
from gpuguardd.engine.reset import refusal
from gpuguardd.records.enums import GpuState, HolderKind, LeakKind
from gpuguardd.records.models import GpuInfo, Holder, MigInstance, NvmlSnapshot, ScanResult

GiB = 1 << 30
DEAD = 4_000_000  # above any pid_max: never a process here
LIVE = os.getpid()


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


def test_stuck_processes_are_a_kind_of_their_own() -> None:
    def kind(listed: list[int], stuck: list[int]) -> LeakKind | None:
        gpu = GpuInfo(index=0, uuid="GPU-a", memory_total=80 * GiB, memory_used=3 * GiB,
                      processes=dict.fromkeys(listed))
        return judge(facts_of(gpu, None, (), 256 << 20, True, stuck=stuck)).leak
    assert kind([LIVE, DEAD], [LIVE]) == LeakKind.STUCK
    assert kind([DEAD], [LIVE]) == LeakKind.DEAD_PIDS  # LIVE is not listed there


def test_gpus_shows_the_kind_with_the_state() -> None:
    gpu = GpuInfo(index=0, uuid="GPU-a", memory_total=80 * GiB, memory_used=3 * GiB)
    out = io.StringIO()
    output.print_gpus(gpu_summaries(ScanResult(holders=[], nvml=NvmlSnapshot(
        available=True, gpus=[gpu])), 256 << 20), out)
    assert "leaked (no-process)" in out.getvalue()


def test_check_and_metrics_name_the_kind() -> None:
    gpu = GpuInfo(index=0, uuid="GPU-a", memory_total=80 * GiB, memory_used=3 * GiB,
                  processes={DEAD: 3 * GiB})
    scan = ScanResult(holders=[], nvml=NvmlSnapshot(available=True, gpus=[gpu]))
    summaries = gpu_summaries(scan, 256 << 20)
    result = check({"nvml_available": True}, summaries, [], [])
    assert [p.message for p in result.problems] == [
        "GPU 0 (GPU-a, nvidia): leaked, 3.0 GiB memory in use with no process holding it (dead-pids)"]
    metrics = Metrics()
    metrics.observe_inventory(True, summaries, [])
    text = metrics.render().decode()
    labels = 'UUID="GPU-a",gpu="0",kind="dead-pids",vendor="nvidia"'
    assert f"gpuguard_leaked_memory_by_kind_bytes{{{labels}}} 3.221225472e+09" in text, text


def test_a_reset_goes_past_gpuguardd_and_persistenced_only() -> None:
    gpu = GpuInfo(index=1, uuid="GPU-b", processes={DEAD: GiB})
    snap = NvmlSnapshot(available=True, gpus=[gpu])
    persistenced = Holder(pid=10, comm="nvidia-persistenced", exe="/usr/bin/nvidia-persistenced",
                          node_gpus=[0, 1])
    own = Holder(pid=11, comm="gpuguardd", node_gpus=[0, 1])
    assert refusal(gpu, snap, [persistenced, own], frozenset({11})) == ""
    smi = Holder(pid=12, comm="nvidia-smi", exe="/usr/bin/nvidia-smi", node_gpus=[1], unit="x.service")
    assert refusal(gpu, snap, [smi], frozenset()) == "pid 12 (nvidia-smi, management) holds it in unit x.service"
    dcgm = Holder(pid=13, comm="nv-hostengine", exe="/usr/bin/nv-hostengine", node_gpus=[1])
    assert "stop DCGM first" in refusal(gpu, snap, [dcgm], frozenset())
    # A compute holder whose GPU nobody can name may be on this one.
    unplaced = Holder(pid=14, comm="python", kind=HolderKind.COMPUTE)
    assert "pid 14" in refusal(gpu, snap, [unplaced], frozenset())
    # Another GPU's management client is no matter.
    other = Holder(pid=15, comm="nvidia-smi", node_gpus=[0])
    assert refusal(gpu, snap, [other], frozenset()) == ""
    alive = GpuInfo(index=1, uuid="GPU-b", processes={LIVE: GiB})
    assert "NVML lists live process(es) on it" in refusal(alive, NvmlSnapshot(available=True, gpus=[alive]),
                                                         [], frozenset())
    foreign = NvmlSnapshot(available=True, gpus=[gpu], pids_local=False)
    assert "another PID namespace" in refusal(gpu, foreign, [], frozenset())
