"""NVML faults against the engine: a hung driver costs a caller at most the
timeout and later callers nothing; GPUs that cannot be read are `unknown`, never `idle`; a
lost GPU's device nodes still map to it through /proc/driver/nvidia/gpus."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguardd.config import Config
from gpuguardd.engine.driverinfo import DRIVER_GPUS_DIR, bus_key
from gpuguardd.engine.engine import Engine
from gpuguardd.engine.gpustate import gpu_summaries
from gpuguardd.engine.nvml import Nvml
from gpuguardd.records.models import GpuInfo, NvmlSnapshot, ScanResult, SweepRequest
from tests.conftest import GiB, GpuHost, MiB

TIMEOUT = 0.3
SLACK = 0.35  # scheduling on two shared cores


@pytest.fixture
def sessions() -> Iterator[list[Nvml]]:
    made: list[Nvml] = []
    yield made
    for nvml in made:
        # A stuck call holds the fake library's lock in this process: let it return before the
        # next test talks to NVML.
        deadline = time.monotonic() + 10
        while nvml._worker._hung is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        nvml.shutdown()


def session(sessions: list[Nvml], timeout: float = 5.0, driver_gpus_dir: str = DRIVER_GPUS_DIR) -> Nvml:
    nvml = Nvml(lambda: timeout, lambda: "/sys", driver_gpus_dir)
    sessions.append(nvml)
    return nvml


def timed_snapshot(nvml: Nvml) -> tuple[float, list[GpuInfo], str]:
    started = time.monotonic()
    snap = nvml.snapshot()
    assert snap.available, snap.error
    return time.monotonic() - started, snap.gpus, snap.error


def states(gpus: list[GpuInfo]) -> list[str]:
    snap = NvmlSnapshot(available=True, gpus=gpus)
    return [s.state for s in gpu_summaries(ScanResult(holders=[], nvml=snap), 64 * MiB)]


def write_driver_info(directory: Path, host: GpuHost) -> None:
    """What the nvidia module shows for the host's fake GPUs, one directory per bus id."""
    for gpu in host.state.gpus:
        assert gpu.pci_bus_id is not None
        bus = bus_key(gpu.pci_bus_id)
        (directory / bus).mkdir(parents=True)
        (directory / bus / "information").write_text(
            f"Model: \t\t {gpu.name}\nIRQ:   \t\t 42\nGPU UUID: \t {gpu.uuid}\n"
            f"Bus Type: \t PCIe\nBus Location: \t {bus}\nDevice Minor: \t {gpu.minor}\n"
            "GPU Excluded:\t No\n")


def test_a_hung_call_costs_one_timeout_then_nothing_until_it_returns(
        inproc_nvml: GpuHost, sessions: list[Nvml]) -> None:
    host = inproc_nvml
    host.state.hang = [("nvmlDeviceGetMemoryInfo_v2", 2000, 1)]
    host.publish()
    nvml = session(sessions, timeout=TIMEOUT)
    took, gpus, error = timed_snapshot(nvml)
    assert took < TIMEOUT + SLACK
    assert "NVML hung: nvmlDeviceGetMemoryInfo_v2 (GPU 1) has not returned" in error
    # GPU 0 was read before the hang; GPU 1 keeps its identity but not its state.
    assert not gpus[0].unknown and gpus[0].memory_total == 80 * GiB
    assert gpus[1].unknown and gpus[1].uuid == host.state.gpus[1].uuid and gpus[1].minor == 1
    assert states(gpus) == ["idle", "unknown"]
    # While the call is stuck nobody queues behind it: the answer comes at once.
    took, gpus, error = timed_snapshot(nvml)
    assert took < 0.1
    assert error.startswith("NVML hung: nvmlDeviceGetMemoryInfo_v2 (GPU 1)")
    assert states(gpus) == ["unknown", "unknown"]
    assert [g.uuid for g in gpus] == [g.uuid for g in host.state.gpus]
    # The driver comes back: so do the states.
    host.state.hang = []
    host.publish()
    deadline = time.monotonic() + 5
    while True:
        _, gpus, error = timed_snapshot(nvml)
        if not error:
            break
        assert time.monotonic() < deadline, error
        time.sleep(0.1)
    assert states(gpus) == ["idle", "idle"]


def test_a_hung_init_answers_unavailable_in_time(inproc_nvml: GpuHost, sessions: list[Nvml]) -> None:
    host = inproc_nvml
    host.state.hang = [("nvmlInitWithFlags", 1000, None)]
    host.publish()
    nvml = session(sessions, timeout=TIMEOUT)
    started = time.monotonic()
    snap = nvml.snapshot()
    assert time.monotonic() - started < TIMEOUT + SLACK
    assert not snap.available
    assert snap.error.startswith("NVML hung: nvmlInitWithFlags has not returned for")
    host.state.hang = []
    host.publish()


@pytest.mark.parametrize(("code", "state", "text"), [(15, "lost", "GPU is lost"),
                                                     (999, "unknown", "Unknown Error"),
                                                     (4, "unknown", "Insufficient Permissions")])
def test_failed_handle_lookups_are_never_idle(inproc_nvml: GpuHost, sessions: list[Nvml],
                                              code: int, state: str, text: str) -> None:
    host = inproc_nvml
    nvml = session(sessions, timeout=5.0)
    _, gpus, _ = timed_snapshot(nvml)
    assert states(gpus) == ["idle", "idle"]
    host.state.gpus[1].handle_error = code
    host.publish()
    _, gpus, _ = timed_snapshot(nvml)
    assert states(gpus) == ["idle", state]
    assert text in gpus[1].error
    # NVML numbers GPUs once per init: what GPU 1 was is still known.
    assert (gpus[1].uuid, gpus[1].minor) == (host.state.gpus[1].uuid, 1)


def test_a_failed_memory_query_is_unknown(inproc_nvml: GpuHost, sessions: list[Nvml]) -> None:
    host = inproc_nvml
    host.state.fail = {"nvmlDeviceGetMemoryInfo_v2": 999}
    host.publish()
    _, gpus, _ = timed_snapshot(session(sessions))
    assert states(gpus) == ["unknown", "unknown"]


def test_a_lost_gpus_holders_still_map_to_it(inproc_nvml: GpuHost, sessions: list[Nvml],
                                             tmp_path: Path) -> None:
    """Lost before gpuguard ever read it: only the nvidia module knows its minor number."""
    host = inproc_nvml
    host.state.gpus[1].handle_error = 15
    host.publish()
    info = tmp_path / "driver-gpus"
    write_driver_info(info, host)
    holder = host.spawn("--hold", host.node("nvidia1"), "--hold", host.node("nvidia-uvm"))
    nvml = session(sessions, driver_gpus_dir=str(info))
    engine = Engine(Config(device_paths=(f"{host.dev}/nvidia*",), allow_majors=(120,),
                           runtime_directory=str(host.root / "run"), verify_timeout_sec=0.3),
                    nvml=nvml)
    scan = engine.scan()
    lost = scan.nvml.gpus[1]
    assert lost.lost and lost.minor == 1 and lost.uuid == host.state.gpus[1].uuid
    mine = [h for h in scan.holders if h.pid == holder.pid]
    assert mine and mine[0].gpus == [1]
    summary = gpu_summaries(scan, 64 * MiB)[1]
    assert summary.state == "lost" and summary.device_path == "/dev/nvidia1"
    report = engine.sweep(SweepRequest(gpus=["1"]))
    assert [t.pid for t in report.terminated] == [holder.pid]
    assert report.outcome == "unverified"  # a lost GPU's memory cannot be read: never "freed"
    assert any("GPU 1: memory could not be read" in w for w in report.warnings)


MIG_A = "MIG-11111111-2222-4333-8444-555555555555"


@pytest.mark.parametrize("fault", ["hang", "handle_error"])
def test_an_unreadable_mig_gpu_keeps_its_instances_unknown(
        inproc_nvml: GpuHost, sessions: list[Nvml], fault: str) -> None:
    """MIG UUIDs still name a GPU's instances while NVML cannot read it, and each reads
    `unknown`, never `idle`."""
    host = inproc_nvml
    host.state.add_mig(1, MIG_A, gpu_instance_id=1, compute_instance_id=0, memory_total=40 * GiB)
    host.publish()
    nvml = session(sessions, timeout=TIMEOUT)
    _, gpus, _ = timed_snapshot(nvml)
    assert [m.uuid for m in gpus[1].mig] == [MIG_A]
    if fault == "hang":
        host.state.hang = [("nvmlDeviceGetMemoryInfo_v2", 1500, 1)]
    else:
        host.state.gpus[1].handle_error = 999
    host.publish()
    _, gpus, _ = timed_snapshot(nvml)
    assert gpus[1].unknown and gpus[1].mig_mode
    assert [(m.uuid, m.gpu_instance_id) for m in gpus[1].mig] == [(MIG_A, 1)]
    summary = gpu_summaries(ScanResult(holders=[], nvml=NvmlSnapshot(available=True, gpus=gpus)),
                            64 * MiB)[1]
    assert summary.state == "unknown"
    assert [(m.uuid, m.state) for m in summary.mig_instances or []] == [(MIG_A, "unknown")]
    host.state.hang = []
    host.publish()


def test_a_gpu_whose_process_lists_all_fail_is_unknown_not_leaked(
        inproc_nvml: GpuHost, sessions: list[Nvml]) -> None:
    host = inproc_nvml
    host.state.gpus[0].base_used = 6 * GiB  # no process to show for it: a leak, if lists work
    host.publish()
    nvml = session(sessions)
    _, gpus, _ = timed_snapshot(nvml)
    assert states(gpus) == ["leaked", "idle"]
    host.state.fail = {name: 999 for name in ("nvmlDeviceGetRunningProcessDetailList",
                                              "nvmlDeviceGetComputeRunningProcesses_v3",
                                              "nvmlDeviceGetGraphicsRunningProcesses_v3",
                                              "nvmlDeviceGetMPSComputeRunningProcesses_v3")}
    host.publish()
    _, gpus, _ = timed_snapshot(nvml)
    assert states(gpus) == ["unknown", "unknown"]
    assert "Unknown Error" in gpus[0].error
