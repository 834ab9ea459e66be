"""The /proc pass shared with helper processes (engine/holders.py scan_raw, engine/scanworker.py)
gives the one-process answer, owns every pidfd it opens, also when its share fails, and scans
a helper's share itself when the helper fails; holder details read from /proc directly say
what psutil said. Speed is bench/bench_scan.py's business, never asserted here."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuguardd.engine import holders, procfs
from gpuguardd.engine.devices import DeviceMap, build_device_map
from gpuguardd.engine.models import NvmlSnapshot
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


def test_helpers_give_the_one_process_answer_and_close_every_pidfd(gpu_host: GpuHost) -> None:
    pids = _hold_some(gpu_host)
    device_map = build_device_map((f"{gpu_host.dev}/nvidia*", f"{gpu_host.root}/mappable/nvidia*"),
                                  allow_majors=(120, 1))
    before = _open_fds()
    # The whole of /proc. Processes of other tests come and go meanwhile: ours are compared.
    answers = []
    for workers in (1, 2, 4):
        found, _ = holders.scan_raw(device_map, use_pidfd=True, workers=workers)
        if workers == 1:
            assert all(raw.pidfd is not None for raw in found.values())
        answers.append({pid: entry for pid, entry in _answer(found).items() if pid in pids})
        for raw in found.values():
            raw.close()
    assert set(answers[0]) == pids
    assert answers[0] == answers[1] == answers[2]
    # Given pids, in every share: each share's answer must be in the result, and what the
    # helpers found is described (pinned, read again) like the rest.
    given = sorted(pids | {os.getpid(), 1})
    for workers in (2, len(given)):
        found, unreadable = holders.scan_raw(device_map, pids=given, use_pidfd=True, workers=workers)
        assert _answer(found) == answers[0] and unreadable == []
        for pid in pids:
            described = holders.describe(pid, NvmlSnapshot(available=False), device_map, {},
                                         raw=found[pid])
            assert described is not None and described[0].devices == answers[0][pid][0]
            described[1].close()
        for raw in found.values():
            raw.close()
    assert _open_fds() == before


def test_a_failed_helper_is_replaced_by_this_process(
        gpu_host: GpuHost, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pids = _hold_some(gpu_host)
    device_map = build_device_map((f"{gpu_host.dev}/nvidia*", f"{gpu_host.root}/mappable/nvidia*"),
                                  allow_majors=(120, 1))
    given = sorted(pids)
    expected = _answer(holders.scan_raw(device_map, pids=given, workers=1)[0])
    assert set(expected) == pids
    # A helper that dies at once, one that answers no JSON, one that answers other JSON.
    real_popen = subprocess.Popen
    monkeypatch.setattr(holders, "_helper_warned", False)
    caplog.set_level(logging.DEBUG, logger="gpuguard.engine")
    for script in ("import sys; sys.exit(3)", "print('not json')", "print('[[1, 2, 3], 5]')"):
        def popen(argv: list[str], *args: Any, script: str = script, **kwargs: Any) -> Any:
            return real_popen([argv[0], "-c", script], *args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(subprocess, "Popen", popen)
            found, _ = holders.scan_raw(device_map, pids=given, workers=3)
        assert _answer(found) == expected, script
    # Said once as a warning (every big scan would take one process from then on), then quietly.
    failures = [r for r in caplog.records if r.getMessage().startswith("scan helper ")]
    assert [r.levelno for r in failures] == [logging.WARNING] + [logging.DEBUG] * 5, failures
    assert "its share is scanned in this process" in failures[0].getMessage()


def test_a_failing_share_leaks_no_pidfd_and_no_helper(
        gpu_host: GpuHost, monkeypatch: pytest.MonkeyPatch) -> None:
    pids = sorted(_hold_some(gpu_host))
    device_map = build_device_map((f"{gpu_host.dev}/nvidia*",), allow_majors=(120,))
    real_scan_maps = holders._scan_maps
    broken = pids[0]  # this process's share is pids[0::workers]

    def scan_maps(pid: int, device_map: DeviceMap, raw: holders.RawHolding) -> None:
        if pid == broken:
            raise RuntimeError("a bug in this process's share")
        real_scan_maps(pid, device_map, raw)

    monkeypatch.setattr(holders, "_scan_maps", scan_maps)
    started: list[Any] = []
    real_start = holders._start_worker

    def start_worker(share: list[int], device_map: DeviceMap) -> Any:
        started.append(real_start(share, device_map))
        return started[-1]

    monkeypatch.setattr(holders, "_start_worker", start_worker)
    before = _open_fds()
    for workers in (1, 5):
        with pytest.raises(RuntimeError, match="a bug in this process's share"):
            holders.scan_raw(device_map, pids=pids, use_pidfd=True, workers=workers)
        assert _open_fds() == before, f"fds left open with {workers} process(es)"
    assert len(started) == 4 and all(proc.returncode is not None for proc in started)


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


def test_a_helper_starts_where_the_package_is_not_on_the_default_path(gpu_host: GpuHost) -> None:
    """`make install` puts gpuguardd in /usr/lib/gpuguard/python, which only the entry point
    adds to sys.path: a helper started with `python -m` from cwd / found no gpuguardd there,
    and every big scan quietly fell back to one process. The installed programs run on the
    system's python3, as here, from the root directory, as under systemd."""
    holder = gpu_host.spawn("--hold", gpu_host.node("nvidia0"))
    root = str(Path(holders.__file__).resolve().parents[2])
    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from gpuguardd.engine import holders\n"
        "from gpuguardd.engine.devices import build_device_map\n"
        "device_map = build_device_map((sys.argv[2],), allow_majors=(120, 1))\n"
        "proc = holders._start_worker([int(sys.argv[3])], device_map)\n"
        "found = holders._worker_results(proc, device_map) if proc else None\n"
        "print('failed' if found is None else len(found))\n")
    done = subprocess.run(["/usr/bin/python3", "-c", script, root, f"{gpu_host.dev}/nvidia*",
                           str(holder.pid)], cwd="/", env={"PATH": os.environ["PATH"]},
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1", done.stdout + done.stderr
