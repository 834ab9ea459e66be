"""Slow release on real workloads: a process that takes seconds to die after
SIGKILL (SGLang unpinning a large host cache in D state, sglang issue 31746) is waited for
within VerifyTimeoutSec, and memory that stays held after the process left NVML's lists
(sglang issue 31871) is waited for too, and reported when it never comes back."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from gpuguardd.engine import procfs
from tests.conftest import GiB, GpuHost, MiB
from tests.host.test_sweep import sweep_json


def freeze(cgroup: Path, pid: int) -> None:
    """Into the v1 freezer: it sleeps uninterruptibly and SIGKILL waits until it is thawed, as
    a process stuck in the driver's teardown does."""
    (cgroup / "cgroup.procs").write_text(str(pid))
    (cgroup / "freezer.state").write_text("FROZEN")
    deadline = time.monotonic() + 5
    while procfs.read_stat(pid).state != "D":  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def sigkill_pending(pid: int) -> bool:
    """SIGKILL (signal 9, bit 8) waits in the frozen process's pending sets."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = [line.split()[1] for line in status.splitlines()
             if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(int(mask, 16) & (1 << 8) for mask in masks)


def thaw_after_sigkill(cgroup: Path, pid: int, seconds: float) -> threading.Event:
    """Thaw `seconds` after the sweep's SIGKILL reached the frozen process, whatever the
    machine's load made of the time before it: the process then dies `seconds` into its
    SIGKILL, like a driver teardown that takes that long. Set the event to give up."""
    cancel = threading.Event()

    def run() -> None:
        while not sigkill_pending(pid):
            if cancel.wait(0.01):
                return
        if not cancel.wait(seconds):
            (cgroup / "freezer.state").write_text("THAWED")
    threading.Thread(target=run, daemon=True).start()
    return cancel


def test_a_process_slow_to_die_after_sigkill_is_freed_not_a_survivor(
        gpu_host: GpuHost, frozen_cgroup: Path) -> None:
    host = gpu_host
    # It ignores SIGTERM, as a worker stuck in the driver's teardown effectively does: a fatal
    # SIGTERM sent to a frozen process would already decide its exit status (the kernel sets
    # the group exit at send time), and the report rightly records that signal, not SIGKILL.
    # It would also make SIGKILL pending at once, which is what the thaw below waits for.
    slow = host.spawn("--hold", host.node("nvidia0"), "--hold", host.node("nvidia-uvm"),
                      "--ignore-term", nvml=(0, 4 * GiB), release_delay_ms=300)
    freeze(frozen_cgroup, slow.pid)
    host.write_config("[Sweep]\nKillTimeoutSec=300ms\nVerifyTimeoutSec=8s\n")
    cancel = thaw_after_sigkill(frozen_cgroup, slow.pid, 1.5)
    try:
        code, report, stderr = sweep_json(host, "--gpu", "0", "--grace", "200ms")
    finally:
        cancel.set()
    assert code == 0, stderr
    assert report["outcome"] == "freed"
    assert report["survived"] == []
    [ended] = report["terminated"]
    assert ended["pid"] == slow.pid and ended["signal"] == "SIGKILL"
    # It went 1.5 s after SIGKILL, long after KillTimeoutSec (0.3 s), and the sweep did not sit
    # out the whole VerifyTimeoutSec once it and its memory were gone.
    assert ended["exited_after_ms"] >= 200 + 1500
    assert report["duration_ms"] < 7000
    assert report["gpus"][0]["released"] is True
    assert slow.popen.wait(5) < 0


def test_a_process_that_does_not_die_within_verify_timeout_is_a_survivor(
        gpu_host: GpuHost, frozen_cgroup: Path) -> None:
    host = gpu_host
    stuck = host.spawn("--hold", host.node("nvidia-uvm"), nvml=(0, GiB))
    freeze(frozen_cgroup, stuck.pid)
    host.write_config("[Sweep]\nKillTimeoutSec=300ms\nVerifyTimeoutSec=1s\n")
    code, report, _ = sweep_json(host, "--gpu", "0", "--grace", "200ms")
    assert code == 3
    assert report["outcome"] == "survivors"
    [survivor] = report["survived"]
    assert survivor["pid"] == stuck.pid and survivor["state"] == "D"
    assert survivor["why"].startswith("uninterruptible (D state)")
    assert survivor["why"].endswith("(1.3 s after SIGKILL)")
    assert report["terminated"] == []
    assert report["duration_ms"] >= 1500  # grace + KillTimeoutSec + VerifyTimeoutSec
    (frozen_cgroup / "freezer.state").write_text("THAWED")
    assert stuck.popen.wait(5) < 0


def sweep_lingering(host: GpuHost, release_ms: int, verify: str) -> tuple[int, int, dict[str, Any]]:
    """Sweep GPU 1 with a holder whose 6 GiB stay held `release_ms` after it exits, though
    NVML stops listing it at once: (its pid, exit status, report)."""
    proc = host.spawn("--hold", host.node("nvidia1"), "--hold", host.node("nvidia-uvm"))
    host.state.add_proc(1, proc.pid, 6 * GiB, release_delay_ms=release_ms, listed_ms=0)
    host.publish()
    host.write_config(f"[Sweep]\nVerifyTimeoutSec={verify}\n")
    code, report, stderr = sweep_json(host, "--gpu", "1")
    assert [t["pid"] for t in report["terminated"]] == [proc.pid], stderr
    return proc.pid, code, report


def test_memory_held_after_the_process_left_nvmls_lists_is_waited_for(gpu_host: GpuHost) -> None:
    _, code, report = sweep_lingering(gpu_host, 1500, "6s")
    assert code == 0
    assert report["outcome"] == "freed" and report["leaks"] == []
    assert report["gpus"][0]["memory_used_after"] <= 64 * MiB
    assert report["duration_ms"] >= 1400, "freed before the driver let the memory go"


def test_memory_that_outlasts_verify_timeout_is_reported_as_a_leak(gpu_host: GpuHost) -> None:
    host = gpu_host
    _, code, report = sweep_lingering(host, 30_000, "500ms")
    assert code == 4
    assert report["outcome"] == "memory-not-released"
    assert report["leaks"] == [{"gpu": 1, "uuid": host.state.gpus[1].uuid, "bytes": 6 * GiB,
                                "kind": "no-process"}]
