"""The start gate's rule (gpuguardd/engine/gate.py): what blocks a GPU or MIG instance, and
the stability clock that a memory move past the tolerance restarts."""

from __future__ import annotations

from gpuguardd.engine.gate import GateRule, GateState, GateTracker, Target, blockers
from gpuguardd.records.enums import GpuState, HolderKind
from gpuguardd.records.models import GpuSummary, Holder, MigSummary

MiB = 1024 * 1024
RULE = GateRule(free_below=256 * MiB, tolerance=16 * MiB)
MIG_A = "MIG-aaaaaaaa-0000-4000-8000-000000000001"
MIG_B = "MIG-bbbbbbbb-0000-4000-8000-000000000002"


def gpu(index: int, used: int = 0, state: GpuState = GpuState.IDLE,
        mig: list[MigSummary] | None = None) -> GpuSummary:
    return GpuSummary(index=index, uuid=f"GPU-{index}", memory_total=80 * 1024 * MiB,
                      memory_used=used, state=state, mig_instances=mig)


def compute(pid: int, gpus: list[int], mig: list[str] | None = None) -> Holder:
    return Holder(pid=pid, comm="python", gpus=gpus, kind=HolderKind.COMPUTE, mig=mig or [])


def test_stability_restarts_on_a_move_past_the_tolerance_only() -> None:
    s = GateState(Target(0, "GPU-0"))
    s.settle(10.0, 1, 0, False, 16 * MiB)
    assert s.free_since == 10.0
    s.settle(11.0, 2, 10 * MiB, False, 16 * MiB)  # within the tolerance: still since 10
    assert s.free_since == 10.0
    s.settle(12.0, 3, 100 * MiB, False, 16 * MiB)  # grew back: the clock restarts
    assert (s.free_since, s.free_since_usec) == (12.0, 3)
    s.settle(13.0, 4, 100 * MiB, True, 16 * MiB)  # blocked: not free at all
    assert s.free_since is None
    assert s.free_since_usec == 0
    s.settle(14.0, 5, 0, False, 16 * MiB)
    assert s.free_since == 14.0


def test_a_drift_within_the_tolerance_never_accumulates_past_it() -> None:
    s = GateState(Target(0, "GPU-0"))
    s.settle(0.0, 0, 0, False, 16 * MiB)
    for step in range(1, 5):  # 10 MiB a step: each within 16 of the last, not of the first
        s.settle(float(step), step, step * 10 * MiB, False, 16 * MiB)
    # Measured from the figure at the last restart, not the last sample: a steady climb of
    # 10 MiB a poll restarts the clock every other poll (at 20 MiB, at 40 MiB).
    assert s.free_since == 4.0


def test_holders_count_on_their_gpu_and_unknown_gpus_count_everywhere() -> None:
    target = Target(0, "GPU-0")
    assert blockers(target, gpu(0), [compute(5, [1])], RULE, None, False) == []
    assert blockers(target, gpu(0), [compute(5, [0])], RULE, None, False) == \
        ["compute holder pid 5 (python)"]
    assert blockers(target, gpu(0), [compute(6, [])], RULE, None, False) == \
        ["compute holder pid 6 (python)"]
    management = Holder(pid=7, comm="nvidia-smi", gpus=[0], kind=HolderKind.MANAGEMENT)
    assert blockers(target, gpu(0), [management], RULE, None, False) == []


def test_memory_nvml_and_sweeps_block() -> None:
    target = Target(0, "GPU-0")
    assert blockers(target, gpu(0, used=256 * MiB), [], RULE, None, False) == \
        ["memory in use at or above 256 MiB"]
    assert blockers(target, gpu(0, used=255 * MiB), [], RULE, None, False) == []
    assert blockers(target, gpu(0), [], RULE, None, True) == ["a sweep of its GPU is running"]
    assert blockers(target, gpu(0, state=GpuState.IN_USE), [], RULE, None, False) == \
        ["NVML lists processes on it"]
    assert blockers(target, gpu(0, state=GpuState.LOST), [], RULE, None, False) == \
        ["lost (fell off the bus)"]


def test_unreadable_fails_closed_unless_allowed() -> None:
    target = Target(0, "GPU-0")
    lenient = GateRule(256 * MiB, 16 * MiB, allow_unverified=True)
    assert blockers(target, gpu(0, state=GpuState.UNKNOWN), [], RULE, None, False) == \
        ["its memory cannot be read"]
    assert blockers(target, gpu(0, state=GpuState.UNKNOWN), [], lenient, None, False) == []
    assert blockers(target, None, [], RULE, "Driver Not Loaded", False) == \
        ["NVML unavailable (Driver Not Loaded): memory cannot be checked"]
    assert blockers(target, None, [], lenient, "Driver Not Loaded", False) == []
    # Allowed unverified, a holder still blocks.
    assert blockers(target, None, [compute(9, [])], lenient, "x", False) == \
        ["compute holder pid 9 (python)"]


def test_mig_instances_are_judged_alone() -> None:
    a = MigSummary(uuid=MIG_A, memory_used=0, state=GpuState.IDLE)
    b = MigSummary(uuid=MIG_B, memory_used=8 * 1024 * MiB, state=GpuState.IN_USE)
    parent = gpu(1, used=8 * 1024 * MiB, state=GpuState.IN_USE, mig=[a, b])
    tenant_b = compute(11, [1], [MIG_B])
    tracker = GateTracker(RULE)
    tracker.observe(1.0, 1, [parent], [tenant_b], None, ())
    assert tracker.states[(1, MIG_A)].free_since == 1.0
    assert tracker.states[(1, MIG_B)].free_since is None
    assert tracker.states[(1, "")].free_since is None  # the whole GPU is busy
    # A tenant whose instance is unknown may be in A too.
    tracker.observe(2.0, 2, [parent], [tenant_b, compute(12, [1])], None, ())
    assert tracker.states[(1, MIG_A)].waiting_on == ["compute holder pid 12 (python)"]


def test_tracker_follows_gpus_that_come_and_go() -> None:
    tracker = GateTracker(RULE)
    tracker.observe(1.0, 1, [gpu(0), gpu(1)], [], None, ())
    assert set(tracker.states) == {(0, ""), (1, "")}
    tracker.observe(2.0, 2, [gpu(0)], [], None, [1])
    assert set(tracker.states) == {(0, "")}
    assert tracker.states[(0, "")].free_since == 1.0


def test_running_sweeps_cover_their_gpus_or_every_gpu_when_unknown() -> None:
    from gpuguardd.daemon.gate import sweeping_indices

    assert sweeping_indices([], [0, 1, 2]) == set()
    assert sweeping_indices([[1]], [0, 1, 2]) == {1}
    # Not resolved yet, or a unit whose GPUs nobody saw: every GPU waits for it.
    assert sweeping_indices([[1], None], [0, 1, 2]) == {0, 1, 2}
    assert sweeping_indices([[]], [0, 1]) == {0, 1}
