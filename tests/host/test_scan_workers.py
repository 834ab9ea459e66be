"""The /proc pass shared with helper processes (engine/holders.py scan_raw, engine/scanhelpers.py,
engine/scanworker.py) gives the one-process answer, its holders pinned by pidfds wherever they
were read, owns every pidfd it opens or receives, also when its share fails, and scans the
chunks a failed helper took itself; holder details read from /proc directly say what psutil
said. Speed is bench/bench_scan.py's business, never asserted here."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuguardd.engine import holders, procfs, scanhelpers
from gpuguardd.engine.devices import DeviceMap, build_device_map
from gpuguardd.records.models import NvmlSnapshot
from tests.conftest import GpuHost


def _open_fds() -> set[str]:
    """This process's open fds, once garbage that owns some is collected: an earlier test's
    file objects caught in a reference cycle are closed whenever the collector runs, and a scan
    that allocates enough (helpers started) made it run between two snapshots."""
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


def _free_pids(count: int) -> list[int]:
    """PIDs no process has (high ones, rarely given out): chunks that are quick to scan."""
    return [pid for pid in range(2**22 - 1, 2**21, -1) if not os.path.exists(f"/proc/{pid}")][:count]


def _slow_first_share(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """This process's first chunk takes a second: a helper takes the chunks after it. Returns
    the trace, "share" for each chunk scanned here."""
    real_scan_share = holders._scan_share
    calls: list[str] = []

    def slow_share(*args: Any, **kwargs: Any) -> Any:
        if not calls:
            time.sleep(1)
        calls.append("share")
        return real_scan_share(*args, **kwargs)

    monkeypatch.setattr(holders, "_scan_share", slow_share)
    return calls


def test_helpers_give_the_one_process_answer_and_close_every_pidfd(
        gpu_host: GpuHost, monkeypatch: pytest.MonkeyPatch) -> None:
    pids = _hold_some(gpu_host)
    device_map = build_device_map((f"{gpu_host.dev}/nvidia*", f"{gpu_host.root}/mappable/nvidia*"),
                                  allow_majors=(120, 1))
    before = _open_fds()
    # The whole of /proc. Processes of other tests come and go meanwhile: ours are compared.
    answers = []
    for workers in (1, 2, 4):
        found, _ = holders.scan_raw(device_map, use_pidfd=True, workers=workers)
        # Pinned where they were read: the helpers' pidfds came over the socket.
        assert all(raw.pidfd is not None for pid, raw in found.items() if pid in pids)
        answers.append({pid: entry for pid, entry in _answer(found).items() if pid in pids})
        for raw in found.values():
            raw.close()
    assert set(answers[0]) == pids
    assert answers[0] == answers[1] == answers[2]
    # Given pids, in every share: each share's answer must be in the result, and what the
    # helpers found is described (by the pidfds they passed) like the rest.
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
    # The holders in a chunk a helper takes: pinned there, the pidfds passed over the socket.
    with monkeypatch.context() as patch:
        _slow_first_share(patch)
        found, _ = holders.scan_raw(device_map, pids=_free_pids(scanhelpers.CHUNK_MIN_PIDS) + sorted(pids),
                                    use_pidfd=True, workers=2)
    assert _answer(found) == answers[0]
    assert all(raw.pidfd is not None for raw in found.values())
    for raw in found.values():
        raw.close()
    assert _open_fds() == before


def test_a_failed_helper_is_replaced_by_this_process(
        gpu_host: GpuHost, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pids = _hold_some(gpu_host)
    device_map = build_device_map((f"{gpu_host.dev}/nvidia*", f"{gpu_host.root}/mappable/nvidia*"),
                                  allow_majors=(120, 1))
    # Chunks of PIDs that do not exist first, the holders last: a helper that takes chunks
    # and dies takes the holders' chunk with it.
    given = _free_pids(4 * scanhelpers.CHUNK_MIN_PIDS) + sorted(pids)
    expected = _answer(holders.scan_raw(device_map, pids=given, workers=1)[0])
    assert set(expected) == pids
    # A helper that dies at once, one that answers no JSON, one that answers other JSON.
    real_popen = subprocess.Popen
    monkeypatch.setattr(scanhelpers, "_helper_warned", False)
    caplog.set_level(logging.DEBUG, logger="gpuguard.engine")

    def scan_with(script: str) -> dict[int, holders.RawHolding]:
        def popen(argv: list[str], *args: Any, **kwargs: Any) -> Any:
            return real_popen([argv[0], "-c", script], *args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(subprocess, "Popen", popen)
            found, _ = holders.scan_raw(device_map, pids=given, workers=3)
        for raw in found.values():
            raw.close()
        return found

    for script in ("import sys; sys.exit(3)", "print('not json')", "print('[[1, 2, 3], 5]')"):
        assert _answer(scan_with(script)) == expected, script
    # One that takes every chunk left while this process reads its first, and dies: the chunks
    # it took are scanned here after it failed.
    calls = _slow_first_share(monkeypatch)
    real_results = scanhelpers.Helper.results

    def results(helper: scanhelpers.Helper) -> Any:
        calls.append("results")
        return real_results(helper)

    monkeypatch.setattr(scanhelpers.Helper, "results", results)
    greedy = ("import json, os, sys\nspec = json.load(sys.stdin)\n"
              "while len(os.read(spec['queue_fd'], 4)) == 4:\n    pass\n")
    assert _answer(scan_with(greedy)) == expected
    assert calls[:1] == ["share"] and "share" in calls[calls.index("results"):], calls
    # Said once as a warning (every big scan would take one process from then on), then quietly.
    failures = [r for r in caplog.records if r.getMessage().startswith("scan helper ")]
    assert [r.levelno for r in failures] == [logging.WARNING] + [logging.DEBUG] * 7, failures
    assert "its share is scanned in this process" in failures[0].getMessage()


def test_a_failing_share_leaks_no_pidfd_and_no_helper(
        gpu_host: GpuHost, monkeypatch: pytest.MonkeyPatch) -> None:
    pids = sorted(_hold_some(gpu_host))
    device_map = build_device_map((f"{gpu_host.dev}/nvidia*",), allow_majors=(120,))
    real_scan_maps = holders._scan_maps
    broken = pids[0]  # in the first chunk, which is this process's before any helper starts

    def scan_maps(pid: int, device_map: DeviceMap, raw: holders.RawHolding) -> None:
        if pid == broken:
            raise RuntimeError("a bug in this process's share")
        real_scan_maps(pid, device_map, raw)

    monkeypatch.setattr(holders, "_scan_maps", scan_maps)
    started: list[Any] = []
    real_start = scanhelpers.Helper.start

    def start_helper(queue: scanhelpers.WorkQueue, match: dict[str, Any], pin: bool) -> Any:
        started.append(real_start(queue, match, pin))
        return started[-1]

    monkeypatch.setattr(scanhelpers.Helper, "start", start_helper)
    before = _open_fds()
    for workers in (1, 5):
        with pytest.raises(RuntimeError, match="a bug in this process's share"):
            holders.scan_raw(device_map, pids=pids, use_pidfd=True, workers=workers)
        assert _open_fds() == before, f"fds left open with {workers} process(es)"
    assert len(started) == 4 and all(helper.proc.returncode is not None for helper in started)


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
        "from gpuguardd.engine import holders, scanhelpers\n"
        "from gpuguardd.engine.devices import build_device_map\n"
        "device_map = build_device_map((sys.argv[2],), allow_majors=(120, 1))\n"
        "queue = scanhelpers.WorkQueue([int(sys.argv[3])])\n"
        "helper = scanhelpers.Helper.start(queue, holders._match_spec(device_map), True)\n"
        "answer = helper.results() if helper else None\n"
        "print('failed' if answer is None else\n"
        "      f'{answer[0]} {len(answer[1])} {answer[1][0].pidfd is not None}')\n")
    done = subprocess.run(["/usr/bin/python3", "-c", script, root, f"{gpu_host.dev}/nvidia*",
                           str(holder.pid)], cwd="/", env={"PATH": os.environ["PATH"]},
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0] 1 True", done.stdout + done.stderr
