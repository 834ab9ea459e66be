"""engine/fdinfo.py: DRM fdinfo as the kernel prints it (drm-usage-stats.rst, amdgpu_fdinfo.c)."""

from __future__ import annotations

import os
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
    assert fdinfo.parse(AMDGPU_LEGACY) == DrmClient("amdgpu", "0000:c3:00.0", 42, 25 * MiB)


def test_resident_is_preferred_to_total() -> None:
    assert fdinfo.parse(AMDGPU_GENERIC) == DrmClient("amdgpu", "0000:c3:00.0", 7, 1536 * MiB)
    # Both legacy and generic (6.10..6.12 printed both): one figure, not their sum.
    both = AMDGPU_GENERIC + "drm-memory-vram:\t1572864 KiB\n"
    assert fdinfo.parse(both) == DrmClient("amdgpu", "0000:c3:00.0", 7, 1536 * MiB)


def test_regions_are_summed_each_by_its_best_figure() -> None:
    # vram0 has a total only, vram1 a resident figure that wins over its total.
    assert fdinfo.parse(GENERIC_NUMBERED) == DrmClient("xe", "0000:03:00.0", 3, 4 * MiB + MiB)


@pytest.mark.parametrize("value", ["12 kB", "-1", "1.5 MiB", "\u0661\u0662", "1 KiB extra",
                                   "9" * 25, "99999999999999999999 GiB"])
def test_odd_sizes_are_no_figure(value: str) -> None:
    client = fdinfo.parse(f"drm-driver:\tamdgpu\ndrm-client-id:\t1\ndrm-resident-vram:\t{value}\n")
    assert client == DrmClient("amdgpu", "", 1, None)


def test_no_driver_is_no_client_and_odd_ids_are_none() -> None:
    assert fdinfo.parse("pos:\t0\nflags:\t02\n") is None
    assert fdinfo.parse("") is None
    client = fdinfo.parse("drm-driver:\tamdgpu\ndrm-client-id:\t\u0663\ndrm-pdev:\t0000:c3:00.0\n")
    assert client == DrmClient("amdgpu", "0000:c3:00.0", None, None)


def _fake_proc(root: Path, pid: int, fds: dict[int, tuple[str, str | None]]) -> str:
    """/proc/<pid>/fd/<n> -> target and fdinfo/<n> (None: none, as for an fd just closed)."""
    (root / str(pid) / "fd").mkdir(parents=True)
    (root / str(pid) / "fdinfo").mkdir()
    for fd, (target, info) in fds.items():
        os.symlink(target, root / str(pid) / "fd" / str(fd))
        if info is not None:
            (root / str(pid) / "fdinfo" / str(fd)).write_text(info)
    return str(root)


def test_clients_of_a_process_each_context_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As nobody no DRM node can be made: what counts as one is the link's target here.
    monkeypatch.setattr(fdinfo, "_is_drm", lambda path: os.readlink(path).startswith("/dev/dri/"))
    other = AMDGPU_LEGACY.replace("drm-client-id:\t42", "drm-client-id:\t43")
    proc = _fake_proc(tmp_path, 4242, {
        3: ("/dev/dri/renderD128", AMDGPU_LEGACY),
        4: ("socket:[1234]", AMDGPU_LEGACY),  # not a device: never read
        5: ("/dev/dri/renderD128", AMDGPU_LEGACY),  # dup() of 3: the same client
        6: ("/dev/dri/renderD128", None),  # gone between listing and reading
        7: ("/dev/dri/renderD128", other),
        8: ("/dev/dri/card1", "pos:\t0\n"),  # a device whose fdinfo names no driver
        9: ("/home/x/data", AMDGPU_LEGACY),
    })
    clients = fdinfo.drm_clients(4242, proc)
    assert [c.client_id for c in clients] == [42, 43]
    assert fdinfo.vram_by_pdev(clients) == {"0000:c3:00.0": 50 * MiB}
    # The same client seen through two processes (fork, SCM_RIGHTS) counts once.
    assert fdinfo.vram_by_pdev(clients + clients) == {"0000:c3:00.0": 50 * MiB}
    assert fdinfo.drm_clients(999, proc) == []


def test_real_proc_non_drm_fds_are_no_clients(tmp_path: Path) -> None:
    with open(os.devnull, "rb"), open(tmp_path / "f", "wb"):
        assert fdinfo.drm_clients(os.getpid()) == []
    assert not fdinfo._is_drm(os.devnull)


def test_vram_by_pdev_skips_clients_without_figure_or_address() -> None:
    clients = [DrmClient("amdgpu", "0000:c3:00.0", 1, 5), DrmClient("amdgpu", "", 2, 7),
               DrmClient("amdgpu", "0000:c3:00.0", 3, None), DrmClient("amdgpu", "0000:c4:00.0", None, 9),
               DrmClient("amdgpu", "0000:c4:00.0", None, 9)]
    assert fdinfo.vram_by_pdev(clients) == {"0000:c3:00.0": 5, "0000:c4:00.0": 18}


def test_fds_the_scan_found_are_read_without_another_look(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder scan already knows which fds are an AMD GPU's nodes: only theirs are read,
    with no readlink or stat of any fd."""
    monkeypatch.setattr(fdinfo, "_is_drm", lambda path: pytest.fail(f"looked at {path} again"))
    other = AMDGPU_LEGACY.replace("drm-client-id:\t42", "drm-client-id:\t43")
    proc = _fake_proc(tmp_path, 4242, {3: ("/dev/dri/renderD128", AMDGPU_LEGACY),
                                       7: ("/dev/dri/renderD128", other)})
    assert [c.client_id for c in fdinfo.drm_clients(4242, proc, fds=["7"])] == [43]
    assert fdinfo.drm_clients(4242, proc, fds=[]) == []
