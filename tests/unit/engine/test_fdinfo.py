"""engine/fdinfo.py: DRM fdinfo as the kernel prints it (drm-usage-stats.rst, amdgpu_fdinfo.c)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuguardd.engine import fdinfo
from gpuguardd.engine.fdinfo import DrmClient

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


def test_amdgpus_legacy_keys_in_kib() -> None:
    assert fdinfo.parse(AMDGPU_LEGACY) == DrmClient("0000:c3:00.0", 42, 25 * MiB)


def test_resident_is_preferred_to_total() -> None:
    assert fdinfo.parse(AMDGPU_GENERIC) == DrmClient("0000:c3:00.0", 7, 1536 * MiB)
    # Both legacy and generic (6.10..6.12 printed both): one figure, not their sum.
    both = AMDGPU_GENERIC + "drm-memory-vram:\t1572864 KiB\n"
    assert fdinfo.parse(both) == DrmClient("0000:c3:00.0", 7, 1536 * MiB)


def test_regions_are_summed_each_by_its_best_figure() -> None:
    # vram0 has a total only, vram1 a resident figure that wins over its total.
    assert fdinfo.parse(GENERIC_NUMBERED) == DrmClient("0000:03:00.0", 3, 4 * MiB + MiB)


@pytest.mark.parametrize("value", ["12 kB", "-1", "1.5 MiB", "\u0661\u0662", "1 KiB extra",
                                   "9" * 25, "99999999999999999999 GiB"])
def test_odd_sizes_are_no_figure(value: str) -> None:
    client = fdinfo.parse(f"drm-driver:\tamdgpu\ndrm-client-id:\t1\ndrm-resident-vram:\t{value}\n")
    assert client == DrmClient("", 1, None)


def test_no_driver_is_no_client_and_odd_ids_are_none() -> None:
    assert fdinfo.parse("pos:\t0\nflags:\t02\n") is None
    assert fdinfo.parse("") is None
    client = fdinfo.parse("drm-driver:\tamdgpu\ndrm-client-id:\t\u0663\ndrm-pdev:\t0000:c3:00.0\n")
    assert client == DrmClient("0000:c3:00.0", None, None)


def _fake_proc(root: Path, pid: int, fds: dict[int, str | None]) -> str:
    """/proc/<pid>/fdinfo/<n> (None: none, as for an fd just closed)."""
    (root / str(pid) / "fdinfo").mkdir(parents=True)
    for fd, info in fds.items():
        if info is not None:
            (root / str(pid) / "fdinfo" / str(fd)).write_text(info)
    return str(root)


def test_the_fds_the_scan_found_each_context_once(tmp_path: Path) -> None:
    other = AMDGPU_LEGACY.replace("drm-client-id:\t42", "drm-client-id:\t43")
    proc = _fake_proc(tmp_path, 4242, {
        3: AMDGPU_LEGACY,
        4: AMDGPU_LEGACY,  # not among the fds found: never read
        5: AMDGPU_LEGACY,  # dup() of 3: the same client
        6: None,  # gone between the scan and the read
        7: other,
        8: "pos:\t0\n",  # a device whose fdinfo names no driver
    })
    clients = fdinfo.drm_clients(4242, proc, fds=["8", "3", "5", "6", "7"])
    assert [c.client_id for c in clients] == [42, 43]
    assert fdinfo.vram_by_pdev(clients) == {"0000:c3:00.0": 50 * MiB}
    assert [c.client_id for c in fdinfo.drm_clients(4242, proc, fds=["7"])] == [43]
    assert fdinfo.drm_clients(4242, proc, fds=[]) == []
    assert fdinfo.drm_clients(999, proc, fds=["3"]) == []


def test_vram_by_pdev_skips_clients_without_figure_or_address() -> None:
    clients = [DrmClient("0000:c3:00.0", 1, 5), DrmClient("", 2, 7),
               DrmClient("0000:c3:00.0", 3, None), DrmClient("0000:c4:00.0", None, 9),
               DrmClient("0000:c4:00.0", None, 9)]
    assert fdinfo.vram_by_pdev(clients) == {"0000:c3:00.0": 5, "0000:c4:00.0": 18}
