"""The AMD GPU reset (engine/reset.py, docs/recovery.md "AMD GPUs"): the same guarded
procedure as NVIDIA's without NVML. The reset command is a real program here (a script that
logs its arguments and "resets" the GPU by rewriting the memory the scan reads, as amdgpu's
mem_info_vram_used would drop), and each refusal AMD documents is checked to leave the command
unrun: any /dev/kfd holder anywhere, an XGMI hive, a partition, the boot display GPU."""

from __future__ import annotations

import json
import os
import shlex
import stat
from pathlib import Path
from typing import cast

import pytest

from gpuguardd.config import Config
from gpuguardd.engine.nvml import Nvml
from gpuguardd.engine.reset import GpuReset, refusal
from gpuguardd.records.enums import HolderKind, Outcome, Vendor, WarningCode
from gpuguardd.records.models import GpuInfo, Holder, NvmlSnapshot, ScanResult
from gpuguardd.records.report import Report
from tests.unit.helpers import DEAD, LIVE

MiB = 1024 * 1024
GiB = 1024 * MiB
BUS = "0000:03:00.0"


class NoNvml:
    """An AMD reset must not touch NVML (there may be none): any use fails the test."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the AMD reset used NVML ({name})")


class Host:
    """One AMD GPU (index 0, 5 GiB leaked) and whatever else a test adds; the fake amd-smi
    writes what it was called with and sets the GPU's used memory, which the scan reads."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sysfs = root / "sys"
        self.sysfs.mkdir()
        self.memory = root / "vram_used"
        self.memory.write_text(str(5 * GiB))
        self.calls = root / "calls.jsonl"
        self.holders: list[Holder] = []
        self.report = Report()
        self.others: list[GpuInfo] = []
        self.available = True
        self.smi = root / "amd-smi"
        self.fake_smi(after=300 * MiB)

    def fake_smi(self, after: int, status: int = 0) -> None:
        self.smi.write_text(
            "#!/bin/sh\n"
            f"printf '%s\\n' \"$(python3 -c 'import json,sys; print(json.dumps(sys.argv[1:]))' \"$@\")\""
            f" >> {self.calls}\n"
            f"echo {after} > {self.memory}\n"
            "echo 'GPU: 0  RESET: Successfully reset GPU'\n"
            f"exit {status}\n")
        self.smi.chmod(self.smi.stat().st_mode | stat.S_IXUSR)

    def gpu(self) -> GpuInfo:
        return GpuInfo(index=0, uuid="amd-0", name="AMD Instinct MI210", pci_bus_id=BUS, minor=128,
                       memory_total=64 * GiB, memory_used=int(self.memory.read_text()),
                       vendor=Vendor.AMD, card_minor=0, gpu_id=4242, released_below=1024 * MiB)

    def scan(self) -> ScanResult:
        return ScanResult(holders=list(self.holders),
                          nvml=NvmlSnapshot(available=self.available, gpus=[self.gpu(), *self.others]))

    def pci(self, name: str, value: str) -> None:
        path = self.sysfs / "bus" / "pci" / "devices" / BUS / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")

    def reset(self) -> tuple[Outcome, str, list[list[str]]]:
        config = Config(reset_timeout_sec=10, verify_timeout_sec=1.0, released_below_mib=256,
                        runtime_directory=str(self.root), sysfs_path=str(self.sysfs),
                        amd_reset_command=shlex.join([str(self.smi), "reset", "--gpureset", "--gpu"]))
        report = self.report = GpuReset(0, cast(Nvml, NoNvml()), self.scan, config, "test").run()
        calls = [json.loads(line) for line in self.calls.read_text().splitlines()] \
            if self.calls.exists() else []
        return report.outcome, report.error, calls


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path)


def holder(pid: int, *devices: str, gpus: tuple[int, ...] = ()) -> Holder:
    return Holder(pid=pid, comm="python3", devices=list(devices), node_gpus=list(gpus),
                  gpus=list(gpus), kind=HolderKind.COMPUTE)


def test_amd_reset_runs_the_command_with_the_bus_id_and_verifies(host: Host) -> None:
    # Graphics on another GPU (its render node, no /dev/kfd) does not stand in the way. NVML
    # not being there at all (an AMD-only host) does not either.
    host.holders = [holder(os.getpid() + 100000, "/dev/dri/renderD129", gpus=(1,))]
    host.available = False
    outcome, error, calls = host.reset()
    assert (outcome, error) == (Outcome.RESET, "")
    assert calls == [["reset", "--gpureset", "--gpu", BUS]]


def test_a_reset_reports_warnings_with_their_codes(host: Host) -> None:
    # The lock directory cannot be made (a file is in its way): the reset goes on, unserialized,
    # and says so with a code, as a sweep's report does.
    (host.root / "locks").write_text("")
    outcome, error, _ = host.reset()
    assert outcome == Outcome.RESET and not error
    assert len(host.report.warnings) == 1 and "not serialized" in host.report.warnings[0]
    assert host.report.warning_codes == [WarningCode.LOCKS_UNAVAILABLE]
    assert host.report.to_dict()["warning_codes"] == ["locks-unavailable"]


def test_amd_reset_verifies_against_the_amd_threshold(host: Host) -> None:
    # 300 MiB after the reset is released for an AMD GPU (its driver's own VRAM), though above
    # ReleasedBelowMiB; 1.5 GiB is not.
    host.fake_smi(after=1536 * MiB)
    outcome, error, calls = host.reset()
    assert outcome == Outcome.RESET_FAILED and "1536 MiB still in use" in error
    assert len(calls) == 1


def test_a_failing_amd_command_is_a_failed_reset(host: Host) -> None:
    host.fake_smi(after=5 * GiB, status=3)
    outcome, error, _ = host.reset()
    assert outcome == Outcome.RESET_FAILED
    assert "failed (exit status 3)" in error and "Successfully" in error


def test_any_kfd_holder_refuses_even_on_another_gpu(host: Host) -> None:
    # amd-smi's guide: every process with /dev/kfd open is ended by a GPU reset, whichever
    # GPU it uses.
    host.holders = [holder(4321, "/dev/kfd", "/dev/dri/renderD129", gpus=(1,))]
    outcome, error, calls = host.reset()
    assert outcome == Outcome.RESET_REFUSED and calls == []
    assert "pid 4321 (python3) holds /dev/kfd" in error


@pytest.mark.parametrize(("setup", "words"), [
    (lambda h: h.pci("xgmi_hive_info/xgmi_hive_id", "1234567890"), "XGMI hive (1234567890)"),
    (lambda h: h.pci("boot_vga", "1"), "boot display GPU"),
    (lambda h: h.others.append(GpuInfo(index=1, pci_bus_id=BUS.upper(), vendor=Vendor.AMD)),
     "one partition of the GPU at 0000:03:00.0, with GPU(s) 1"),
])
def test_what_a_reset_would_take_down_refuses(host: Host, setup, words: str) -> None:  # type: ignore[no-untyped-def]
    setup(host)
    outcome, error, calls = host.reset()
    assert outcome == Outcome.RESET_REFUSED and calls == []
    assert words in error


def test_kfd_topology_hive_refuses(host: Host) -> None:
    node = host.sysfs / "class" / "kfd" / "kfd" / "topology" / "nodes" / "2"
    node.mkdir(parents=True)
    (node / "gpu_id").write_text("4242\n")
    (node / "properties").write_text("cpu_cores_count 0\nsimd_count 416\nhive_id 98765\n")
    outcome, error, calls = host.reset()
    assert outcome == Outcome.RESET_REFUSED and calls == [] and "XGMI hive" in error
    (node / "properties").write_text("simd_count 416\nhive_id 0\n")  # no hive: it goes ahead
    assert host.reset()[0] == Outcome.RESET


def test_a_live_kfd_process_on_the_gpu_refuses_in_kfd_words(host: Host) -> None:
    gpu = host.gpu

    def with_process() -> GpuInfo:
        info = gpu()
        info.processes = {os.getpid(): 4 * GiB}
        return info
    host.gpu = with_process  # type: ignore[method-assign]
    outcome, error, calls = host.reset()
    assert outcome == Outcome.RESET_REFUSED and calls == []
    assert error.startswith("KFD lists live process(es) on it")


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

