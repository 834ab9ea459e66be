"""The fake NVML's MIG mode, driven through the real pynvml (see tests/unit/test_fake_nvml.py).

What it must reproduce (nvml.h, NVIDIA's MIG user guide): instances found by index with gaps,
per-instance UUIDs, ids, memory and process lists; the parent's memory is the aggregate and its
process lists are empty unless the caller is privileged; MIG handles answer only the queries
NVML documents for them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakenvml import GIB, FakeNvmlState, env_for
from tests.unit.test_fake_nvml import NvmlSession

NOT_MIG = 0xFFFFFFFF
NOT_FOUND, NOT_SUPPORTED, INVALID_ARGUMENT = 6, 3, 2
MIG_A = "MIG-aaaaaaaa-0000-4000-8000-000000000001"
MIG_B = "MIG-bbbbbbbb-0000-4000-8000-000000000002"

# One instance's view, through pynvml's own wrappers, evaluated in the child.
INSTANCE = ("(lambda m: {{'uuid': N.nvmlDeviceGetUUID(m),"
            " 'is_mig': N.nvmlDeviceIsMigDeviceHandle(m).value,"
            " 'gi': N.nvmlDeviceGetGpuInstanceId(m), 'ci': N.nvmlDeviceGetComputeInstanceId(m),"
            " 'parent': N.nvmlDeviceGetIndex(N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)),"
            " 'used': N.nvmlDeviceGetMemoryInfo(m, version=N.nvmlMemory_v2).used,"
            " 'total': N.nvmlDeviceGetMemoryInfo(m).total,"
            " 'procs': [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId]"
            "           for p in N.nvmlDeviceGetComputeRunningProcesses(m)]}})"
            "(N.nvmlDeviceGetMigDeviceHandleByIndex(h({gpu}), {slot}))")


@pytest.fixture
def nvml(fake_nvml_libdir: Path, tmp_path: Path) -> Iterator[tuple[NvmlSession, Path]]:
    state_path = tmp_path / "state"
    session = NvmlSession({**os.environ, **env_for(fake_nvml_libdir, state_path)},
                          tmp_path / "child.stderr")
    try:
        yield session, state_path
    finally:
        session.close()


def mig_state(pid_a: int, pid_b: int) -> FakeNvmlState:
    state = FakeNvmlState()
    state.add_gpu()  # no MIG at all
    state.add_gpu(base_used=GIB // 2)
    # Slots 0 and 2: real drivers leave gaps where instances were destroyed.
    state.add_mig(1, MIG_A, gpu_instance_id=1, compute_instance_id=0, slot=0, memory_total=20 * GIB)
    state.add_mig(1, MIG_B, gpu_instance_id=2, compute_instance_id=0, slot=2, memory_total=40 * GIB,
                  base_used=GIB // 4)
    state.add_proc(1, pid_a, 3 * GIB, mig=MIG_A)
    state.add_proc(1, pid_b, 5 * GIB, mig=MIG_B)
    return state


def test_mig_instances_are_found_by_index_with_gaps(nvml: tuple[NvmlSession, Path]) -> None:
    session, state_path = nvml
    # Two real pids that outlive the test's calls: this process and its parent.
    pid_a, pid_b = os.getpid(), os.getppid()
    state = mig_state(pid_a, pid_b)
    state.write(state_path)
    session.call("init()")
    assert session.error("N.nvmlDeviceGetMigMode(h(0))").code == NOT_SUPPORTED
    assert session.error("N.nvmlDeviceGetMaxMigDeviceCount(h(0))").code == NOT_SUPPORTED
    assert session.call("N.nvmlDeviceGetMigMode(h(1))") == [1, 1]
    assert session.call("N.nvmlDeviceGetMaxMigDeviceCount(h(1))") == 7
    assert session.error("N.nvmlDeviceGetMigDeviceHandleByIndex(h(1), 1)").code == NOT_FOUND
    assert session.error("N.nvmlDeviceGetMigDeviceHandleByIndex(h(1), 7)").code == INVALID_ARGUMENT
    assert session.error("N.nvmlDeviceGetMigDeviceHandleByIndex(h(0), 0)").code == NOT_SUPPORTED
    a = session.call(INSTANCE.format(gpu=1, slot=0))
    b = session.call(INSTANCE.format(gpu=1, slot=2))
    assert a == {"uuid": MIG_A, "is_mig": 1, "gi": 1, "ci": 0, "parent": 1, "used": 3 * GIB,
                 "total": 20 * GIB, "procs": [[pid_a, 3 * GIB, 1, 0]]}
    assert b == {"uuid": MIG_B, "is_mig": 1, "gi": 2, "ci": 0, "parent": 1,
                 "used": 5 * GIB + GIB // 4, "total": 40 * GIB, "procs": [[pid_b, 5 * GIB, 2, 0]]}
    # The parent: aggregate memory over every instance, but no processes for this caller.
    assert session.call("mem2(1)")["used"] == 8 * GIB + GIB // 2 + GIB // 4
    assert session.call("procs(1)") == []
    assert session.call("N.nvmlDeviceIsMigDeviceHandle(h(1)).value") == 0
    assert session.error("N.nvmlDeviceGetGpuInstanceId(h(1))").code == NOT_SUPPORTED
    # Whole-GPU properties are not a MIG handle's to answer.
    assert session.error(
        "N.nvmlDeviceGetMinorNumber(N.nvmlDeviceGetMigDeviceHandleByIndex(h(1), 0))").code == NOT_SUPPORTED
    # What a privileged caller sees on the parent: every instance's processes, with their ids.
    state.gpus[1].mig_parent_lists = "aggregate"
    state.write(state_path)
    assert sorted(session.call("procs(1)")) == sorted([[pid_a, 3 * GIB, 1, 0], [pid_b, 5 * GIB, 2, 0]])
    # A GPU without MIG keeps reporting "not a MIG process" ids.
    state.add_proc(0, pid_a, GIB)
    state.write(state_path)
    assert session.call("procs(0)") == [[pid_a, GIB, NOT_MIG, NOT_MIG]]


def test_mig_state_is_checked(nvml: tuple[NvmlSession, Path]) -> None:
    session, state_path = nvml
    state = mig_state(os.getpid(), os.getppid())
    state.write(state_path)
    session.call("init()")
    text = state.render()
    for bad in (text.replace(" mig=0", ""),                 # a MIG GPU runs nothing outside instances
                text.replace("mig 1 2 ", "mig 1 0 "),       # two instances in one slot
                text.replace("mig 1 0 ", "mig 0 0 "),       # an instance on a GPU without MIG
                text.replace("mig=on", "mig=maybe")):
        state_path.write_text(bad)
        assert session.error("count()").code == 999, bad
    with pytest.raises(ValueError):
        state.add_proc(1, 1, GIB, mig="MIG-nonexistent")
