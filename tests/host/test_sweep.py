"""Sweeps against real processes: escalation, safety, verification through the fake NVML."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpuguardd.config import Config
from gpuguardd.engine import procfs
from gpuguardd.engine.engine import Engine
from gpuguardd.engine.locks import GpuLocks
from gpuguardd.engine.sweep import Sweep
from gpuguardd.records.models import SweepRequest
from tests.conftest import GiB, GpuHost, MiB, Proc


def sweep_json(host: GpuHost, *args: str) -> tuple[int, dict[str, Any], str]:
    result = host.cli("sweep", "--json", *args)
    assert result.stdout, result.stderr
    return result.returncode, json.loads(result.stdout), result.stderr



def test_sweep_of_one_gpu_ends_its_holders_and_verifies_memory(gpu_host: GpuHost) -> None:
    host = gpu_host
    # Like CUDA processes, each holds every GPU's node; NVML's lists say which GPU it is on.
    on0 = host.spawn("--cuda", str(host.dev), nvml=(0, 4 * GiB), release_delay_ms=200)
    on1 = host.spawn("--cuda", str(host.dev), nvml=(1, 2 * GiB))
    code, report, stderr = sweep_json(host, "--gpu", "0", "--reason", "test")
    assert code == 0, stderr
    assert report["outcome"] == "freed"
    assert report["verified"] is True
    assert [t["pid"] for t in report["terminated"]] == [on0.pid]
    assert report["terminated"][0]["signal"] == "SIGTERM"
    assert not on0.alive() and on1.alive()
    gpu0 = report["gpus"][0]
    assert gpu0["index"] == 0 and gpu0["uuid"] == host.state.gpus[0].uuid
    assert gpu0["memory_used_before"] == 4 * GiB
    assert gpu0["memory_used_after"] <= 64 * MiB
    assert report["reason"] == "test"
    assert f"sent SIGTERM to pid {on0.pid}" in stderr


def test_sigterm_ignored_escalates_to_sigkill(gpu_host: GpuHost) -> None:
    host = gpu_host
    stubborn = host.spawn("--ignore-term", "--hold", host.node("nvidia-uvm"), nvml=(0, GiB))
    code, report, _ = sweep_json(host, "--grace", "300ms")
    assert code == 0
    assert report["terminated"][0]["pid"] == stubborn.pid
    assert report["terminated"][0]["signal"] == "SIGKILL"
    assert report["terminated"][0]["exited_after_ms"] >= 300
    assert stubborn.popen.wait(5) == -signal.SIGKILL


def test_holder_in_its_own_session_is_swept(gpu_host: GpuHost) -> None:
    host = gpu_host
    detached = host.spawn("--setsid", "--hold", host.node("nvidia-uvm"))
    assert os.getsid(detached.pid) == detached.pid
    code, report, _ = sweep_json(host)
    assert report["outcome"] == "unverified" or code == 0
    assert [t["pid"] for t in report["terminated"]] == [detached.pid]


def test_a_process_named_like_persistenced_is_still_swept(gpu_host: GpuHost) -> None:
    host = gpu_host
    impostor = host.spawn("--comm", "nvidia-persiste", "--hold", host.node("nvidia-uvm"), nvml=(0, GiB))
    assert procfs.read_stat(impostor.pid).comm == "nvidia-persiste"  # type: ignore[union-attr]
    code, report, _ = sweep_json(host)
    assert code == 0
    assert [t["pid"] for t in report["terminated"]] == [impostor.pid]


def test_protected_executable_is_spared_by_real_path(gpu_host: GpuHost) -> None:
    host = gpu_host
    bindir = host.root / "usr-bin"
    bindir.mkdir()
    protected_exe = bindir / "nvidia-persistenced"
    shutil.copy2(os.path.realpath(sys.executable), protected_exe)
    # Reached through a symlink: matching is on the resolved /proc/<pid>/exe.
    link = host.root / "persistenced-link"
    link.symlink_to(protected_exe)
    host.write_config(f"ProtectedExecutables={protected_exe}\n".join(["[Sweep]\n", ""]))
    daemon = host.spawn("--hold", host.node("nvidia-uvm"), exe=str(link), nvml=(0, GiB))
    victim = host.spawn("--hold", host.node("nvidia-uvm"), nvml=(0, GiB))
    code, report, _ = sweep_json(host, "--gpu", "0")
    assert [t["pid"] for t in report["terminated"]] == [victim.pid]
    spared = {s["pid"]: s["why"] for s in report["spared"]}
    assert "protected executable" in spared[daemon.pid]
    assert {s["pid"]: s["code"] for s in report["spared"]}[daemon.pid] == "protected-executable"
    assert daemon.alive()
    # Its memory still counts, and the threshold accounts for it: freed, not "not released".
    assert report["outcome"] == "freed", report
    assert code == 0


def test_management_client_is_spared_unless_asked(gpu_host: GpuHost) -> None:
    host = gpu_host
    smi = host.spawn("--hold", host.node("nvidiactl"), "--hold", host.node("nvidia0"))
    _, report, _ = sweep_json(host)
    assert report["terminated"] == []
    assert "management client" in {s["pid"]: s["why"] for s in report["spared"]}[smi.pid]
    assert {s["pid"]: s["code"] for s in report["spared"]}[smi.pid] == "management"
    assert smi.alive()
    _, report, _ = sweep_json(host, "--include-management")
    assert [t["pid"] for t in report["terminated"]] == [smi.pid]


def test_dry_run_signals_nothing(gpu_host: GpuHost) -> None:
    host = gpu_host
    proc = host.spawn("--hold", host.node("nvidia-uvm"), nvml=(0, GiB))
    code, report, _ = sweep_json(host, "--dry-run")
    assert code == 0
    assert report["outcome"] == "dry-run" and report["dry_run"] is True
    assert [t["pid"] for t in report["targets"]] == [proc.pid]
    assert report["terminated"] == []
    assert proc.alive()


def test_unreaped_zombie_is_a_survivor_naming_its_parent(gpu_host: GpuHost) -> None:
    host = gpu_host
    parent = host.spawn("--spawn-zombie")
    assert parent.zombie
    deadline = time.monotonic() + 5
    while procfs.read_stat(parent.zombie).state != "Z":  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    host.state.add_proc(1, parent.zombie, GiB)
    host.publish()
    code, report, _ = sweep_json(host, "--gpu", "1")
    assert code == 3
    assert report["outcome"] == "survivors"
    survivor = report["survived"][0]
    assert survivor["pid"] == parent.zombie
    assert survivor["why"] == f"zombie: parent {parent.pid} has not reaped it"
    assert parent.alive()


def test_uninterruptible_holder_is_reported_not_hidden(gpu_host: GpuHost, frozen_cgroup: Path) -> None:
    """A v1-frozen task sleeps uninterruptibly and ignores SIGKILL until thawed, like a D-state
    process stuck in the driver."""
    host = gpu_host
    stuck = host.spawn("--hold", host.node("nvidia-uvm"), nvml=(0, GiB))
    (frozen_cgroup / "cgroup.procs").write_text(str(stuck.pid))
    (frozen_cgroup / "freezer.state").write_text("FROZEN")
    deadline = time.monotonic() + 5
    while procfs.read_stat(stuck.pid).state != "D":  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    host.write_config("[Sweep]\nKillTimeoutSec=500ms\nVerifyTimeoutSec=200ms\n")
    code, report, _ = sweep_json(host, "--grace", "200ms")
    assert code == 3
    assert report["outcome"] == "survivors"
    assert report["survived"][0]["pid"] == stuck.pid
    assert report["survived"][0]["why"].startswith("uninterruptible (D state)")
    (frozen_cgroup / "freezer.state").write_text("THAWED")
    assert stuck.popen.wait(5) < 0  # the pending signals land once it wakes


def test_memory_that_is_never_released_is_reported(gpu_host: GpuHost) -> None:
    host = gpu_host
    host.state.gpus[0].base_used = 6 * GiB
    host.publish()
    proc = host.spawn("--hold", host.node("nvidia-uvm"), nvml=(0, GiB))
    host.write_config("[Sweep]\nVerifyTimeoutSec=300ms\n")
    code, report, stderr = sweep_json(host, "--gpu", "0")
    assert code == 4, stderr
    assert report["outcome"] == "memory-not-released"
    assert [t["pid"] for t in report["terminated"]] == [proc.pid]
    assert report["leaks"] == [{"gpu": 0, "uuid": host.state.gpus[0].uuid, "bytes": 6 * GiB,
                                "kind": "no-process"}]
    assert report["gpus"][0]["memory_used_after"] == 6 * GiB


def test_without_nvml_a_sweep_never_claims_freed(gpu_host: GpuHost) -> None:
    host = gpu_host
    proc = host.spawn("--hold", host.node("nvidia1"), "--hold", host.node("nvidia-uvm"))
    host.state.init_error = 9
    host.publish()
    code, report, _ = sweep_json(host)
    assert [t["pid"] for t in report["terminated"]] == [proc.pid]
    assert report["outcome"] == "unverified" and code == 6
    assert any("cannot be verified" in w for w in report["warnings"])
    assert "nvml-unavailable" in report["warning_codes"]
    assert len(report["warning_codes"]) == len(report["warnings"])


def test_sweep_scoped_to_a_unit_leaves_the_containers_namesake(gpu_host: GpuHost, systemd_cgroup: Any) -> None:
    host = gpu_host
    on_host = host.spawn("--hold", host.node("nvidia-uvm"))
    in_lxc = host.spawn("--hold", host.node("nvidia-uvm"))
    systemd_cgroup("system.slice/gg-sweep-vllm.service").add(on_host.pid)
    systemd_cgroup("lxc/130/system.slice/gg-sweep-vllm.service").add(in_lxc.pid)
    _, report, _ = sweep_json(host, "--unit", "gg-sweep-vllm")
    assert report["scope"]["unit"] == "gg-sweep-vllm.service"
    assert [t["pid"] for t in report["terminated"]] == [on_host.pid]
    assert in_lxc.alive()
    _, report, _ = sweep_json(host, "--container", "lxc/130")
    assert [t["pid"] for t in report["terminated"]] == [in_lxc.pid]


def test_the_sweeper_never_signals_its_own_ancestors(gpu_host: GpuHost) -> None:
    host = gpu_host
    # A holder that runs the sweep itself, like an ExecStopPost shell that still holds a device.
    script = (f"import os, subprocess, sys; fd = os.open({host.node('nvidia-uvm')!r}, os.O_PATH); "
              f"r = subprocess.run([sys.executable, '-m', 'gpuguardd.cli.main', 'sweep', '--json', '--local', "
              f"'--config', {str(host.config_path)!r}], capture_output=True, text=True); print(r.stdout)")
    result = subprocess.run([sys.executable, "-c", script], env=host.env, capture_output=True,
                            text=True, timeout=60, check=True)
    report = json.loads(result.stdout)
    assert report["terminated"] == []
    assert any(s["why"] == "an ancestor of the sweeping process" and s["code"] == "ancestor"
               for s in report["spared"])


def test_bad_input_gets_one_clear_line_and_exit_2(gpu_host: GpuHost) -> None:
    host = gpu_host
    cases = {
        ("--gpu", "7"): "GPU index 7 out of range",
        ("--gpu", "GPU-deadbeef-0000"): "unknown GPU UUID 'GPU-deadbeef-0000'",
        ("--gpu", "fast"): "invalid GPU 'fast'",
        ("--unit", "bad/unit"): "invalid unit name 'bad/unit.service'",
        ("--container", "no spaces"): "invalid container 'no spaces'",
        ("--grace", "soon"): "invalid time span 'soon'",
        ("--frobnicate",): "unrecognized arguments: --frobnicate",
    }
    for args, message in cases.items():
        result = host.cli("sweep", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_broken_config_is_reported_with_file_line_and_key(gpu_host: GpuHost) -> None:
    host = gpu_host
    host.write_config("[Sweep]\nGraceSec=forever\n")
    result = host.cli("holders")
    assert result.returncode == 2
    line = len(host.config_path.read_text().splitlines())
    assert f"{host.config_path}:{line}: [Sweep] GraceSec: invalid time span 'forever'" in result.stderr


def test_sweeps_of_the_same_gpu_wait_for_each_other(inproc_nvml: GpuHost) -> None:
    host = inproc_nvml
    engine = _engine(host, verify_timeout_sec=2)
    proc = host.spawn("--hold", host.node("nvidia-uvm"), nvml=(0, GiB))
    other = GpuLocks(str(host.root / "run" / "locks"))
    assert other.acquire([0]) is None  # another sweep (say, another process) holds GPU 0
    finished = threading.Event()
    def sweep_gpu0() -> None:
        engine.sweep(SweepRequest(gpus=["0"]))
        finished.set()

    thread = threading.Thread(target=sweep_gpu0)
    thread.start()
    time.sleep(0.5)
    assert not finished.is_set() and proc.alive()
    other.release()
    thread.join(10)
    assert finished.is_set() and not proc.alive()


@pytest.mark.parametrize("use_pidfd", [True, False], ids=["pidfd", "start-time-fallback"])
def test_a_recycled_pid_is_never_signalled(inproc_nvml: GpuHost, use_pidfd: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Scan, let the holder die and its PID be handed to a new process, then sweep the scan."""
    host = inproc_nvml
    victim = host.spawn("--hold", host.node("nvidia-uvm"))
    impostor: list[Proc] = []
    real_terminate = Sweep._terminate

    def recycle_then_terminate(self: Sweep, targets: Any) -> None:
        # Between the scan (handles taken) and the first signal: the holder dies and its PID
        # goes to an unrelated process.
        if not impostor:
            victim.stop()
            impostor.append(spawn_as(host, victim.pid))
        real_terminate(self, targets)

    monkeypatch.setattr(Sweep, "_terminate", recycle_then_terminate)
    report = _engine(host, use_pidfd, verify_timeout_sec=0.2).sweep(SweepRequest())
    assert impostor and impostor[0].pid == victim.pid
    assert impostor[0].alive(), "the recycled PID was signalled"
    assert [t.pid for t in report.terminated] == [victim.pid]
    assert report.terminated[0].signal == ""  # gone before any signal reached it


def _engine(host: GpuHost, use_pidfd: bool | None = None, **settings: Any) -> Engine:
    return Engine(Config(device_paths=(f"{host.dev}/nvidia*",), allow_majors=(120,),
                         runtime_directory=str(host.root / "run"), **settings), use_pidfd=use_pidfd)


def test_a_holder_forked_by_a_dying_one_is_ended_too(inproc_nvml: GpuHost) -> None:
    """A worker that forks on SIGTERM leaves a child holding the device: the sweep finds it
    after the first round (it started since the scan) and ends it."""
    host = inproc_nvml
    worker = host.spawn("--hold", host.node("nvidia-uvm"), "--fork-on-term")
    child = 0
    try:
        report = _engine(host, verify_timeout_sec=2).sweep(SweepRequest())
        child = forked_child(worker)
        assert [t.pid for t in report.terminated] == [worker.pid, child]
        assert report.terminated[1].signal == "SIGTERM" and not report.survived
        stat = procfs.read_stat(child)
        assert stat is None or stat.state == "Z"  # an orphan: init reaps it
    finally:
        child = child or forked_child(worker)
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


def forked_child(worker: Proc) -> int:
    """The PID a --fork-on-term holder printed for its child, 0 if none within 5 s."""
    assert worker.popen.stdout is not None
    ready, _, _ = select.select([worker.popen.stdout], [], [], 5)
    line = worker.popen.stdout.readline().split() if ready else []
    return int(line[1]) if line[:1] == ["child"] else 0


def test_a_holder_started_under_a_recycled_pid_is_found(inproc_nvml: GpuHost,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A process the first scan saw holding nothing exits mid-sweep and a holder starts under
    its PID: the sweep tells the two apart by start time, finds the holder and ends it."""
    host = inproc_nvml
    target = host.spawn("--hold", host.node("nvidia-uvm"))
    bystander = host.spawn()
    newcomer: list[Proc] = []
    real_terminate = Sweep._terminate

    def recycle_after_the_first_round(self: Sweep, targets: Any) -> None:
        real_terminate(self, targets)
        if not newcomer:
            bystander.stop()
            newcomer.append(spawn_as(host, bystander.pid, "--hold", host.node("nvidia-uvm")))

    monkeypatch.setattr(Sweep, "_terminate", recycle_after_the_first_round)
    report = _engine(host, verify_timeout_sec=0.2).sweep(SweepRequest())
    assert newcomer and newcomer[0].pid == bystander.pid
    assert [t.pid for t in report.terminated] == [target.pid, bystander.pid]
    assert not newcomer[0].alive()


def spawn_as(host: GpuHost, pid: int, *args: str) -> Proc:
    """host.spawn(*args) as `pid`, through ns_last_pid (how CRIU restores PIDs)."""
    for _ in range(200):
        with open("/proc/sys/kernel/ns_last_pid", "w") as handle:
            handle.write(str(pid - 1))
        proc = host.spawn(*args)
        if proc.pid == pid:
            return proc
        proc.stop()
    pytest.fail(f"could not get PID {pid} back")

