"""The /proc pass on several threads (engine/holders.py scan_raw) gives the one-thread answer,
and owns every pidfd it opens, also when a chunk fails; holder details read from /proc
directly say what psutil said. Speed is bench/bench_scan.py's business, never asserted here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpuguardd.engine import holders, procfs
from gpuguardd.engine.devices import DeviceMap, build_device_map
from tests.conftest import GpuHost


def _open_fds() -> set[str]:
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


def test_threads_give_the_one_thread_answer_and_close_every_pidfd(
        gpu_host: GpuHost, monkeypatch: pytest.MonkeyPatch) -> None:
    pids = _hold_some(gpu_host)
    device_map = build_device_map((f"{gpu_host.dev}/nvidia*", f"{gpu_host.root}/mappable/nvidia*"),
                                  allow_majors=(120, 1))
    before = _open_fds()
    # The whole of /proc, in chunks small enough that every thread gets many. Processes of
    # other tests come and go meanwhile: only ours are compared.
    monkeypatch.setattr(holders, "SCAN_CHUNK", 3)
    answers = []
    for threads in (1, 2, 4):
        found, _ = holders.scan_raw(device_map, use_pidfd=True, threads=threads)
        assert all(raw.pidfd is not None for raw in found.values())
        answers.append({pid: entry for pid, entry in _answer(found).items() if pid in pids})
        for raw in found.values():
            raw.close()
    assert set(answers[0]) == pids
    assert answers[0] == answers[1] == answers[2]
    # Given pids, one a chunk: every chunk's answer must be in the result.
    monkeypatch.setattr(holders, "SCAN_CHUNK", 1)
    given = sorted(pids | {os.getpid(), 1})
    for threads in (1, 3):
        found, unreadable = holders.scan_raw(device_map, pids=given, use_pidfd=True, threads=threads)
        assert _answer(found) == answers[0] and unreadable == []
        for raw in found.values():
            raw.close()
    assert _open_fds() == before


def test_a_failing_chunk_leaks_no_pidfd(gpu_host: GpuHost, monkeypatch: pytest.MonkeyPatch) -> None:
    pids = sorted(_hold_some(gpu_host))
    device_map = build_device_map((f"{gpu_host.dev}/nvidia*",), allow_majors=(120,))
    monkeypatch.setattr(holders, "SCAN_CHUNK", 1)
    real_scan_maps = holders._scan_maps
    broken = pids[len(pids) // 2]

    def scan_maps(pid: int, device_map: DeviceMap, raw: holders.RawHolding) -> None:
        if pid == broken:
            raise RuntimeError("a bug in one chunk")
        real_scan_maps(pid, device_map, raw)

    monkeypatch.setattr(holders, "_scan_maps", scan_maps)
    before = _open_fds()
    for threads in (1, 4):
        with pytest.raises(RuntimeError, match="a bug in one chunk"):
            holders.scan_raw(device_map, pids=pids, use_pidfd=True, threads=threads)
        assert _open_fds() == before, f"pidfds left open with {threads} thread(s)"


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
