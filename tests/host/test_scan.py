"""The /proc pass (engine/holders.py scan_raw) pins its holders by pidfds where it reads them,
hands them to describe(), and owns every pidfd it opens, also when it fails; holder details read
from /proc directly say what psutil said. Speed is bench/bench_scan.py's business, never
asserted here."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from gpuguardd.engine import holders, procfs
from gpuguardd.engine.devices import DeviceMap, build_device_map
from gpuguardd.records.models import NvmlSnapshot
from tests.conftest import GpuHost


def _open_fds() -> set[str]:
    """This process's open fds, once garbage that owns some is collected: an earlier test's
    file objects caught in a reference cycle are closed whenever the collector runs."""
    gc.collect()
    return set(os.listdir("/proc/self/fd"))


def _answer(found: dict[int, holders.RawHolding]) -> dict[int, tuple[list[str], list[str]]]:
    return {pid: (sorted(raw.nodes), sorted(raw.how)) for pid, raw in found.items()}


def _hold_some(host: GpuHost) -> set[int]:
    uvm = host.mappable_uvm()
    started = [
        host.spawn("--hold", host.node("nvidia0"), "--hold", host.node("nvidia-uvm")),
        host.spawn("--hold", host.node("nvidia1"), "--hold", host.node("nvidiactl")),
        host.spawn("--mmap", uvm),
        host.spawn("--hold", host.node("nvidia-modeset")),
        host.spawn("--hold", host.node("nvidia1"), "--mmap", uvm),
    ]
    return {proc.pid for proc in started}


def test_the_scan_pins_what_it_reads_and_closes_every_pidfd(gpu_host: GpuHost) -> None:
    pids = _hold_some(gpu_host)
    device_map = build_device_map((f"{gpu_host.dev}/nvidia*", f"{gpu_host.root}/mappable/nvidia*"),
                                  allow_majors=(120, 1))
    before = _open_fds()
    # The whole of /proc. Processes of other tests come and go meanwhile: ours are compared.
    found, _ = holders.scan_raw(device_map, use_pidfd=True)
    assert all(raw.pidfd is not None for pid, raw in found.items() if pid in pids)
    answer = {pid: entry for pid, entry in _answer(found).items() if pid in pids}
    for raw in found.values():
        raw.close()
    assert set(answer) == pids
    # Given pids, one twice: each holder once, and described by the pidfd it was read under.
    given = [*sorted(pids | {os.getpid(), 1}), min(pids)]
    found, unreadable = holders.scan_raw(device_map, pids=given, use_pidfd=True)
    assert _answer(found) == answer and unreadable == []
    for pid in pids:
        described = holders.describe(pid, NvmlSnapshot(available=False), device_map, {}, raw=found[pid])
        assert described is not None and described[0].devices == answer[pid][0]
        described[1].close()
    for raw in found.values():
        raw.close()
    assert _open_fds() == before


def test_a_failing_scan_leaks_no_pidfd(gpu_host: GpuHost, monkeypatch: pytest.MonkeyPatch) -> None:
    pids = sorted(_hold_some(gpu_host))
    device_map = build_device_map((f"{gpu_host.dev}/nvidia*",), allow_majors=(120,))
    real_scan_maps = holders._scan_maps
    broken = pids[-1]  # after the others are pinned

    def scan_maps(pid: int, device_map: DeviceMap, raw: holders.RawHolding) -> None:
        if pid == broken:
            raise RuntimeError("a bug in the scan")
        real_scan_maps(pid, device_map, raw)

    monkeypatch.setattr(holders, "_scan_maps", scan_maps)
    before = _open_fds()
    with pytest.raises(RuntimeError, match="a bug in the scan"):
        holders.scan_raw(device_map, pids=pids, use_pidfd=True)
    assert _open_fds() == before


def test_real_uid_and_exe_as_psutil_reads_them(gpu_host: GpuHost) -> None:
    """A process whose real uid is not its effective one (a setuid program): the real uid."""
    import psutil

    proc = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time\nos.setresuid(65534, 0, 0)\n"
         "print('ready', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert procfs.read_uid(proc.pid) == psutil.Process(proc.pid).uids().real == 65534
        assert procfs.read_exe(proc.pid) == psutil.Process(proc.pid).exe() == os.path.realpath(sys.executable)
    finally:
        proc.kill()
        proc.wait()
    assert procfs.read_uid(proc.pid) is None and procfs.read_exe(proc.pid) is None  # reaped
    assert procfs.read_exe(2) is None  # kthreadd: no executable, as psutil's exe() says ""
    assert procfs.read_uid(os.getpid()) == os.getuid()
