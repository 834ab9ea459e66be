"""engine/amd.py against a fake sysfs laid out as the kernel's (tests/amd_sysfs.py), and DRM fdinfo as
the kernel prints it (drm-usage-stats.rst, amdgpu_fdinfo.c)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguardd.engine import amd
from gpuguardd.engine.amd import DrmClient
from gpuguardd.records.enums import Vendor
from gpuguardd.records.models import GpuInfo
from tests.amd_sysfs import AmdSysfs, GiB, write_amdgpu_ids
from tests.helpers import wait_until


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[AmdSysfs]:
    tree = AmdSysfs(tmp_path / "sys")
    yield tree
    tree.close()


@pytest.fixture
def ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """libdrm's table as the tests write it, and no pci.ids."""
    path = write_amdgpu_ids(tmp_path / "amdgpu.ids")
    monkeypatch.setattr(amd, "AMDGPU_IDS", path)
    monkeypatch.setattr(amd, "PCI_IDS", "/nonexistent")
    return path


def read(fake: AmdSysfs, **kw: bool) -> list[GpuInfo]:
    return amd.read_gpus(fake.sysfs, 0, **kw)


def test_an_mi300x_with_kfd_and_an_apu_without(fake: AmdSysfs, ids: str) -> None:
    fake.radeon_apu("0000:65:00.0", render_minor=129, card_minor=0)
    fake.mi300x("0000:c3:00.0", gpu_id=53987, render_minor=128, card_minor=1, vram_used=5 * GiB)
    mi, apu = amd.read_gpus(fake.sysfs, 4)
    # KFD's GPUs first (node order), then the rest; indices from first_index.
    assert (mi.index, apu.index) == (4, 5)
    assert mi.vendor == apu.vendor == Vendor.AMD
    assert (mi.minor, mi.card_minor, mi.gpu_id, mi.pci_bus_id) == (128, 1, 53987, "0000:c3:00.0")
    assert mi.uuid == "GPU-9a5d4f3c2b1e0d07"
    assert mi.name == "AMD Instinct MI300X"
    assert (mi.memory_total, mi.memory_used) == (192 * GiB, 5 * GiB)
    assert not (mi.unknown or mi.suspended or mi.error)
    assert mi.device_path == "/dev/dri/renderD128"
    assert (apu.minor, apu.card_minor, apu.gpu_id, apu.pci_bus_id) == (129, 0, 0, "0000:65:00.0")
    assert apu.name == "AMD Radeon 780M"  # matched on (device, revision)
    # Without unique_id: device, domain, location id (0x65 << 8).
    assert apu.uuid == "GPU-15bf000000006500"
    assert apu.memory_used == 60 << 20 and apu.released_below is None


def test_pci_order_for_gpus_kfd_does_not_list_and_other_vendors_skipped(fake: AmdSysfs, ids: str) -> None:
    fake.radeon_apu("0000:c1:00.0", render_minor=128, card_minor=1)
    fake.radeon_apu("0000:05:00.0", render_minor=130, card_minor=2)
    other = fake.add_pci_gpu("0000:02:00.0", 0x2330, render_minor=131, card_minor=3, driver="nvidia")
    fake.write(other.device_dir / "vendor", "0x10de\n")
    gpus = read(fake)
    assert [g.pci_bus_id for g in gpus] == ["0000:05:00.0", "0000:c1:00.0"]
    # A device amdgpu is not bound to, of vendor 0x1002 (vfio, a driver being rebound), counts.
    fake.write(other.device_dir / "vendor", "0x1002\n")
    assert [g.pci_bus_id for g in read(fake)] == ["0000:02:00.0", "0000:05:00.0", "0000:c1:00.0"]


def test_names_fall_back_to_product_name_then_pci_ids(fake: AmdSysfs, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    fake.mi300x(product_name="AMD Instinct MI300X OAM")
    pci_ids = tmp_path / "pci.ids"
    pci_ids.write_text("# pci.ids\n10de  NVIDIA Corporation\n\t74a1  Not this one\n"
                       "1002  Advanced Micro Devices, Inc. [AMD/ATI]\n\t74a1  Aqua Vanjaram [Instinct MI300X]\n"
                       "\t\t1002 74a1  Instinct MI300X\n1022  AMD\n")
    monkeypatch.setattr(amd, "AMDGPU_IDS", str(tmp_path / "none"))
    monkeypatch.setattr(amd, "PCI_IDS", str(tmp_path / "none"))
    assert read(fake)[0].name == "AMD Instinct MI300X OAM"
    fake.break_file(fake.gpus[0].device_dir / "product_name", None)
    monkeypatch.setattr(amd, "PCI_IDS", str(pci_ids))
    assert read(fake)[0].name == "Aqua Vanjaram [Instinct MI300X]"
    monkeypatch.setattr(amd, "PCI_IDS", str(tmp_path / "none"))
    assert read(fake)[0].name == "AMD GPU 0x74a1"


def test_name_tables_are_parsed_once_per_version(fake: AmdSysfs, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    fake.mi300x()
    path = tmp_path / "ids"
    write_amdgpu_ids(path)
    calls: list[str] = []
    real = amd._parse_amdgpu_ids

    def counting(text: str) -> dict[tuple[int, int], str]:
        calls.append(text)
        return real(text)

    monkeypatch.setattr(amd, "_parse_amdgpu_ids", counting)
    monkeypatch.setattr(amd, "AMDGPU_IDS", str(path))
    for _ in range(3):
        assert read(fake)[0].name == "AMD Instinct MI300X"
    assert len(calls) == 1
    write_amdgpu_ids(path, "1.0.0\n74A1,\t00,\tRenamed MI300X\n")
    os.utime(path, ns=(1, 1))
    assert read(fake)[0].name == "Renamed MI300X"
    assert len(calls) == 2


def test_a_suspended_gpus_memory_files_are_never_opened(fake: AmdSysfs, ids: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    asleep = fake.mi300x()
    fake.radeon_apu()
    fake.suspend(asleep)  # its mem_info files are directories now: reading one would fail
    opened: list[str] = []
    real_open = os.open

    def spy(path: str, *args: int) -> int:
        opened.append(str(path))
        return real_open(path, *args)

    monkeypatch.setattr(os, "open", spy)
    first, second = read(fake)
    monkeypatch.undo()
    assert first.suspended and not first.unknown and not first.error, first.error
    assert (first.memory_total, first.memory_used) == (0, 0)
    assert first.uuid and first.name == "AMD Instinct MI300X"  # identity from PCI config alone
    assert not [p for p in opened if "mem_info" in p and asleep.bdf in os.path.realpath(p)]
    assert second.memory_used == 60 << 20 and not second.suspended
    assert not [p for p in opened if "/dev/" in p]
    for status in ("suspending", "resuming", "error", "weird\u0660"):
        fake.suspend(asleep, status, trap=False)
        assert read(fake)[0].suspended, status
    for status in ("active", "unsupported"):
        fake.write(asleep.device_dir / "power/runtime_status", status + "\n")
        gpu = read(fake)[0]
        assert not gpu.suspended and gpu.unknown and "mem_info_vram_total" in gpu.error  # the trap
    # Unreadable is not absent: unknown, the file named, and still no mem_info opened.
    status_file = asleep.device_dir / "power/runtime_status"
    fake.break_file(status_file, None)
    status_file.mkdir()
    gpu = read(fake)[0]
    assert gpu.unknown and not gpu.suspended
    assert gpu.error.startswith(f"cannot read {fake.sysfs}/class/drm/renderD128/device/power/runtime_status")
    status_file.rmdir()  # runtime PM not in use: the memory is read (here: the trap fires)
    gpu = read(fake)[0]
    assert not gpu.suspended and "mem_info_vram_total" in gpu.error


@pytest.mark.parametrize(("content", "why"), [
    ("abc\n", "not a number: 'abc'"),
    ("\u0663\u0664\n", "not a number: '\u0663\u0664'"),  # int() would take these
    ("-5\n", "not a number"),
    (" 5\n", "not a number"),
    ("9" * 40 + "\n", "out of range"),
    (str(2**63) + "\n", "out of range"),
    (b"\xff\xfe\n", "not a number"),
    ("1" * 300, "longer than"),
    (None, "No such file"),
])
def test_a_broken_file_makes_that_gpu_unknown_and_names_the_file(
        fake: AmdSysfs, ids: str, content: str | bytes | None, why: str) -> None:
    broken = fake.mi300x("0000:c3:00.0")
    fake.mi300x("0000:c4:00.0", gpu_id=1234, render_minor=130, card_minor=2, unique_id=7)
    fake.radeon_apu()
    path = broken.device_dir / "mem_info_vram_used"
    fake.break_file(path, content)
    bad, good, apu = read(fake)
    assert bad.unknown and f"cannot read {fake.sysfs}/class/drm/renderD128/device/mem_info_vram_used" in bad.error
    assert why in bad.error, bad.error
    assert bad.error.encode("utf-8") and "\0" not in bad.error
    assert bad.uuid == "GPU-9a5d4f3c2b1e0d07" and bad.pci_bus_id == "0000:c3:00.0"  # still known
    assert not good.unknown and good.memory_used == 300 << 20 and good.uuid == "GPU-0000000000000007"
    assert not apu.unknown


def test_broken_topology_and_links(fake: AmdSysfs, ids: str) -> None:
    gpu = fake.mi300x()
    fake.radeon_apu()
    node = fake.kfd / "topology/nodes" / str(gpu.node)
    props = (node / "properties").read_text()
    fake.write(node / "properties", props.replace("drm_render_minor 128", "drm_render_minor 1\u0662\u0668"))
    first, apu = read(fake)[:2]
    assert first.unknown and "properties (drm_render_minor)" in first.error and first.gpu_id == 53987
    assert not apu.unknown
    # KFD and the render node disagree on where the GPU is: unknown, never the wrong device.
    fake.write(node / "properties", props.replace("location_id 49920", "location_id 49928"))
    first = read(fake)[0]
    assert first.unknown and "0000:c3:01.0" in first.error
    fake.write(node / "properties", props)
    fake.break_file(node / "gpu_id", "x\n")
    first = read(fake)[0]
    assert first.unknown and "gpu_id" in first.error


def test_processes_from_kfd_and_entries_that_are_no_pid(fake: AmdSysfs, ids: str) -> None:
    one = fake.mi300x("0000:c3:00.0", gpu_id=100)
    fake.mi300x("0000:c4:00.0", gpu_id=200, render_minor=130, card_minor=2)
    fake.add_process(4242, {100: 3 * GiB, 200: 0})
    fake.add_process(777, {100: 1 << 20})
    fake.add_proc_entry("12ab", {"pasid": "1\n", "vram_100": "5\n"})
    fake.add_proc_entry("\u0661\u0662", {"vram_200": "5\n"})
    fake.add_proc_entry("0", {"vram_100": "5\n"})
    fake.add_proc_entry("99", {"vram_100": "many\n", "vram_999": "5\n"})  # 999: no such GPU
    first, second = read(fake)
    assert first.processes == {4242: 3 * GiB, 777: 1 << 20, 99: None}
    assert second.processes == {4242: 0}
    assert any("'12ab' is no process id" in w for w in first.warnings)
    assert any("'0' is no process id" in w for w in first.warnings)
    assert any("vram_100: not a number: 'many'" in w for w in first.warnings)
    assert any("'\u0661\u0662' is no process id" in w for w in second.warnings)
    assert not any("12ab" in w for w in second.warnings)
    assert first.memory_used == fake.used(one) == (300 << 20) + 3 * GiB + (1 << 20)
    assert all(g.processes == {} for g in read(fake, with_processes=False))


def test_asynchronous_teardown_the_entry_outlives_the_holder(fake: AmdSysfs, ids: str) -> None:
    gpu = fake.mi300x(gpu_id=100)
    idle = fake.used(gpu)
    holder = subprocess.Popen(["sleep", "60"])
    fake.add_process(holder.pid, {100: 8 * GiB})
    assert read(fake)[0].processes == {holder.pid: 8 * GiB}
    holder.kill()
    holder.wait()
    fake.release_later(holder.pid, memory_after=0.3, entry_after=0.6)
    # Right after the exit KFD still lists the (dead) PID and the memory is still in use.
    now = read(fake)[0]
    assert holder.pid in now.processes and now.memory_used == idle + 8 * GiB
    wait_until(lambda: read(fake)[0].memory_used == idle, 5, "the memory to come back")
    wait_until(lambda: not read(fake)[0].processes, 5, "KFD's proc entry to go")
    assert not read(fake)[0].warnings


def test_no_kfd_no_drm_no_gpus(tmp_path: Path, ids: str) -> None:
    assert amd.read_gpus(str(tmp_path / "nothing"), 0) == []
    assert amd.read_gpus(str(tmp_path), 0) == []


MiB = 1 << 20

# amdgpu before Linux 6.10: the legacy drm-memory-<region> keys, in KiB (amdgpu_fdinfo.c).
AMDGPU_LEGACY = """\
pos:\t0
flags:\t02100002
mnt_id:\t26
ino:\t1095
drm-driver:\tamdgpu
drm-pdev:\t0000:C3:00.0
drm-client-id:\t42
pasid:\t32770
drm-memory-vram:\t25600 KiB
drm-memory-gtt:\t4096 KiB
drm-memory-cpu:\t0 KiB
amd-memory-visible-vram:\t25600 KiB
amd-evicted-vram:\t0 KiB
amd-evicted-visible-vram:\t0 KiB
amd-requested-vram:\t30720 KiB
drm-engine-gfx:\t1234567 ns
drm-engine-compute:\t89 ns
"""

# amdgpu since 6.10: drm_print_memory_stats (drm_file.c) prints the generic keys, the size in
# the largest unit that divides it; resident and total differ when buffers are evicted.
AMDGPU_GENERIC = """\
pos:\t0
flags:\t02100002
mnt_id:\t26
drm-driver:\tamdgpu
drm-client-id:\t7
drm-pdev:\t0000:c3:00.0
pasid:\t32771
drm-total-cpu:\t0
drm-shared-cpu:\t0
drm-resident-cpu:\t0
drm-total-gtt:\t4 MiB
drm-resident-gtt:\t4 MiB
drm-total-vram:\t2 GiB
drm-shared-vram:\t0
drm-resident-vram:\t1536 MiB
"""

# The documentation's generic shape: bytes without a unit, numbered regions (as xe's).
GENERIC_NUMBERED = """\
drm-driver: xe
drm-client-id: 3
drm-pdev: 0000:03:00.0
drm-engine-capacity-ccs: 4
drm-total-system: 1048576
drm-total-vram0: 4096 KiB
drm-total-vram1: 8388608
drm-resident-vram1: 1048576
"""


def test_fdinfo_amdgpus_legacy_keys_in_kib() -> None:
    assert amd.parse_fdinfo(AMDGPU_LEGACY) == DrmClient("0000:c3:00.0", 42, 25 * MiB)


def test_fdinfo_resident_is_preferred_to_total() -> None:
    assert amd.parse_fdinfo(AMDGPU_GENERIC) == DrmClient("0000:c3:00.0", 7, 1536 * MiB)
    # Both legacy and generic (6.10..6.12 printed both): one figure, not their sum.
    both = AMDGPU_GENERIC + "drm-memory-vram:\t1572864 KiB\n"
    assert amd.parse_fdinfo(both) == DrmClient("0000:c3:00.0", 7, 1536 * MiB)


def test_fdinfo_regions_are_summed_each_by_its_best_figure() -> None:
    # vram0 has a total only, vram1 a resident figure that wins over its total.
    assert amd.parse_fdinfo(GENERIC_NUMBERED) == DrmClient("0000:03:00.0", 3, 4 * MiB + MiB)


@pytest.mark.parametrize("value", ["12 kB", "-1", "1.5 MiB", "\u0661\u0662", "1 KiB extra",
                                   "9" * 25, "99999999999999999999 GiB"])
def test_fdinfo_odd_sizes_are_no_figure(value: str) -> None:
    client = amd.parse_fdinfo(f"drm-driver:\tamdgpu\ndrm-client-id:\t1\ndrm-resident-vram:\t{value}\n")
    assert client == DrmClient("", 1, None)


def test_fdinfo_no_driver_is_no_client_and_odd_ids_are_none() -> None:
    assert amd.parse_fdinfo("pos:\t0\nflags:\t02\n") is None
    assert amd.parse_fdinfo("") is None
    client = amd.parse_fdinfo("drm-driver:\tamdgpu\ndrm-client-id:\t\u0663\ndrm-pdev:\t0000:c3:00.0\n")
    assert client == DrmClient("0000:c3:00.0", None, None)


def _fake_proc(root: Path, pid: int, fds: dict[int, str | None]) -> str:
    """/proc/<pid>/fdinfo/<n> (None: none, as for an fd just closed)."""
    (root / str(pid) / "fdinfo").mkdir(parents=True)
    for fd, info in fds.items():
        if info is not None:
            (root / str(pid) / "fdinfo" / str(fd)).write_text(info)
    return str(root)


def test_drm_vram_of_the_fds_the_scan_found_each_context_once(tmp_path: Path) -> None:
    other = AMDGPU_LEGACY.replace("drm-client-id:\t42", "drm-client-id:\t43")
    proc = _fake_proc(tmp_path, 4242, {
        3: AMDGPU_LEGACY,
        4: AMDGPU_LEGACY,  # not among the fds found: never read
        5: AMDGPU_LEGACY,  # dup() of 3: the same client
        6: None,  # gone between the scan and the read
        7: other,
        8: "pos:\t0\n",  # a device whose fdinfo names no driver
    })
    assert amd.drm_vram(4242, ["8", "3", "5", "6", "7"], proc) == {"0000:c3:00.0": 50 * MiB}
    assert amd.drm_vram(4242, ["7"], proc) == {"0000:c3:00.0": 25 * MiB}
    assert amd.drm_vram(4242, [], proc) == {}
    assert amd.drm_vram(999, ["3"], proc) == {}


def test_drm_vram_skips_clients_without_figure_or_address(tmp_path: Path) -> None:
    def client(pdev: str, client_id: int | None, vram: int | None) -> str:
        return ("drm-driver:\tamdgpu\n" + (f"drm-pdev:\t{pdev}\n" if pdev else "")
                + (f"drm-client-id:\t{client_id}\n" if client_id is not None else "")
                + (f"drm-resident-vram:\t{vram}\n" if vram is not None else ""))
    proc = _fake_proc(tmp_path, 7, {
        1: client("0000:c3:00.0", 1, 5), 2: client("", 2, 7), 3: client("0000:c3:00.0", 3, None),
        4: client("0000:c4:00.0", None, 9), 5: client("0000:c4:00.0", None, 9)})
    assert amd.drm_vram(7, ["1", "2", "3", "4", "5"], proc) == {"0000:c3:00.0": 5, "0000:c4:00.0": 18}
