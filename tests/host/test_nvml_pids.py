"""NVML's PIDs are untrusted input: garbage from a driver/pynvml struct mismatch, pids of another
PID namespace, pids of processes that hold no GPU here. None of them may crash a scan or make a
local process a target on NVML's word alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpuguardd.engine.slurm import summary
from gpuguardd.records.report import Report
from tests.conftest import HOLDER, GiB, GpuHost
from tests.fakenvml import build_library
from tests.helpers import cli_json
from tests.host.test_gpu_attribution import cuda

GARBAGE = (0, 4294967295, 2**22 + 1)  # no pid: 0, -1 as unsigned, past any pid_max


def test_garbage_pids_are_warnings_never_a_crash(gpu_host: GpuHost) -> None:
    host = gpu_host
    worker = cuda(host, 0, 2 * GiB)
    for pid in GARBAGE:
        host.state.add_proc(0, pid, 0, raw=True)
    host.publish()
    code, holders, stderr = cli_json(host, "holders")
    assert code == 0, stderr
    assert {h["pid"]: h["nvml_gpus"] for h in holders}[worker.pid] == [0]
    assert not {h["pid"] for h in holders} & set(GARBAGE)
    for pid in GARBAGE:
        assert f"NVML listed pid {pid}, which is no process id" in stderr, stderr
    code, report, stderr = cli_json(host, "sweep", "--gpu", "0")
    assert code == 0, stderr
    assert [t["pid"] for t in report["terminated"]] == [worker.pid]
    assert any("NVML listed pid 4294967295" in w for w in report["warnings"]), report["warnings"]


def test_driver_535_early_stride_names_the_right_processes(gpu_host: GpuHost,
                                                           fake_nvml_libdir: Path) -> None:
    """Drivers 535.43-535.86 write 32-byte _v3 entries; read as pynvml reads them (24 bytes),
    the second and third tenants come back as pids 0 and 4294967295 and fall out of NVML's
    view, and a --gpu 0 sweep would spare them (or, before, crash in pidfd_open)."""
    host = gpu_host
    host.libdir = build_library(fake_nvml_libdir, "r535")
    host.state.driver_version = "535.54.03"
    tenants = [cuda(host, 0, (i + 1) * GiB) for i in range(3)]
    other = cuda(host, 1, GiB)
    code, holders, stderr = cli_json(host, "holders")
    assert code == 0, stderr
    by_pid = {h["pid"]: h for h in holders}
    assert [by_pid[t.pid]["nvml_gpus"] for t in tenants] == [[0], [0], [0]]
    assert [by_pid[t.pid]["gpu_memory"] for t in tenants] == [GiB, 2 * GiB, 3 * GiB]
    assert "NVML listed pid" not in stderr
    code, report, stderr = cli_json(host, "sweep", "--gpu", "0")
    assert code == 0, stderr
    assert sorted(t["pid"] for t in report["terminated"]) == sorted(t.pid for t in tenants)
    assert other.alive()


def test_nvml_pid_of_a_process_holding_no_device_is_never_a_target(gpu_host: GpuHost) -> None:
    """What NVML's pid of another PID namespace, or a pid reused since, looks like here."""
    host = gpu_host
    bystander = host.spawn()  # holds no device at all
    host.state.add_proc(0, bystander.pid, 4 * GiB)
    host.publish()
    code, report, stderr = cli_json(host, "sweep", "--gpu", "0")
    assert report["terminated"] == [], report
    assert bystander.alive()
    spared = {s["pid"]: s["why"] for s in report["spared"]}
    assert "holds no NVIDIA device here" in spared[bystander.pid]
    assert any(f"NVML lists pid {bystander.pid}" in w for w in report["warnings"]), report
    assert code == 0, stderr


# Runs as PID 1 of a new PID namespace (unshare --pid --fork --mount-proc): a daemon in a
# container. NVML (the fake, like a real driver) names the host's pid H; here, pid H is made to
# be a process of our own that uses GPU 1 only.
INSIDE = r"""
import json, os, subprocess, sys
host_pid, holder, dev, config = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(host_pid - 1))
local = subprocess.Popen([sys.executable, holder, "--hold", dev + "/nvidia1", "--hold",
                          dev + "/nvidiactl", "--hold", dev + "/nvidia-uvm"],
                         stdout=subprocess.PIPE, text=True)
local.stdout.readline()


def ctl(*args):
    done = subprocess.run([sys.executable, "-m", "gpuguardd.cli.main", *args, "--json", "--local",
                           "--config", config], capture_output=True, text=True)
    return [done.returncode, json.loads(done.stdout) if done.stdout else None, done.stderr]


out = {"local_pid": local.pid, "status": ctl("status"), "holders": ctl("holders"),
       "sweep": ctl("sweep", "--gpu", "0")}
out["alive"] = local.poll() is None
local.kill()
local.wait()
print(json.dumps(out))
"""


def test_daemon_in_another_pid_namespace_never_trusts_nvml_pids(gpu_host: GpuHost) -> None:
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is required")
    host = gpu_host
    tenant = cuda(host, 0, 4 * GiB)  # the host's process NVML lists on GPU 0, as pid H
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", INSIDE,
         str(tenant.pid), str(HOLDER), str(host.dev), str(host.config_path)],
        env=host.env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    assert out["local_pid"] == tenant.pid, "could not give the local process NVML's pid"
    _code, status, _stderr = out["status"]
    assert status["nvml_available"] is True
    assert "PID namespace" in status["nvml_error"], status
    _code, holders, _stderr = out["holders"]
    local = {h["pid"]: h for h in holders}[tenant.pid]
    assert local["nvml_gpus"] == [] and local["gpus"] == [1] and local["gpus_from"] == "nodes"
    assert local["gpu_memory"] == 0
    _code, report, _stderr = out["sweep"]
    assert report["terminated"] == [], report
    assert out["alive"], "the local process was ended on the word of another namespace's pid"
    assert any("PID namespace" in w for w in report["warnings"]), report["warnings"]
    assert tenant.alive()


# PID 1 of a new PID namespace again, now driven line by line from the host side, which alone
# can see both pids of a process (NSpid) and so give the fake NVML what a real driver lists:
# the host's pid. "holder": a local CUDA-like process on GPU 0 (holds only GPU 0's node);
# "bystander PID": a process at that local pid holding nothing; "sweep": gpuguardctl sweep
# --gpu 0. Each answer is one JSON line.
DRIVER = r"""
import json, subprocess, sys, threading, time
holder, dev, config = sys.argv[1], sys.argv[2], sys.argv[3]
children = []


def start(*argv):
    child = subprocess.Popen([sys.executable, holder, *argv], stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    # Reaped the moment it dies, as PID 1 should: a zombie still counts as alive for NVML.
    threading.Thread(target=child.wait, daemon=True).start()
    children.append(child)
    return child.pid


for line in sys.stdin:
    command, *args = line.split()
    if command == "holder":
        answer = {"pid": start("--hold", dev + "/nvidia0", "--hold", dev + "/nvidiactl",
                               "--hold", dev + "/nvidia-uvm")}
    elif command == "bystander":
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(int(args[0]) - 1))
        answer = {"pid": start()}
    else:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "gpuguardd.cli.main", "sweep", "--gpu", "0",
                               "--json", "--local", "--config", config],
                              capture_output=True, text=True)
        answer = {"code": done.returncode, "stderr": done.stderr,
                  "report": json.loads(done.stdout) if done.stdout else None,
                  "seconds": time.monotonic() - started}
    print(json.dumps(answer), flush=True)
for child in children:
    child.kill()
"""


class Namespace:
    """The driver above, and what the host knows of the processes it starts."""

    def __init__(self, host: GpuHost) -> None:
        if shutil.which("unshare") is None:
            pytest.fail("unshare (util-linux) is required")
        self.popen = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", DRIVER,
             str(HOLDER), str(host.dev), str(host.config_path)],
            env=host.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, *words: object) -> dict[str, Any]:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write(" ".join(map(str, words)) + "\n")
        self.popen.stdin.flush()
        line = self.popen.stdout.readline()
        assert line, "the namespace's driver died"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def holder(self) -> tuple[int, int]:
        """A new local holder: (its pid in the namespace, its pid on the host)."""
        local = int(self.ask("holder")["pid"])
        for child in psutil.Process(self.popen.pid).children(recursive=True):
            with open(f"/proc/{child.pid}/status", encoding="ascii") as status:
                nspid = next(line.split()[1:] for line in status if line.startswith("NSpid:"))
            if len(nspid) > 1 and int(nspid[-1]) == local:
                return local, child.pid
        raise AssertionError(f"no host pid for the namespace's pid {local}")

    def sweep(self) -> tuple[dict[str, Any], float]:
        answer = self.ask("sweep")
        report = answer["report"]
        assert report is not None, answer["stderr"]
        return report, float(answer["seconds"])

    def close(self) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.close()
        self.popen.wait(timeout=30)


def test_sweep_in_another_pid_namespace_never_claims_freed_on_foreign_pids(
        gpu_host: GpuHost) -> None:
    """NVML names processes by host pids, which a daemon in a container cannot
    read: its own ended target's entry, and another tenant's. An empty list with the memory
    back is proof and reads `freed`; a list still naming someone is evidence of use that says
    neither `freed` (by mistaking a foreign pid for a local process) nor `memory-not-released`
    (after waiting VerifyTimeoutSec for another tenant): `unverified`, once the list settles."""
    host = gpu_host
    host.write_config("[Sweep]\nVerifyTimeoutSec=20\n")
    namespace = Namespace(host)
    try:
        # Only the sweep's own target listed, by its host pid; its entry lingers 0.5 s.
        local, host_pid = namespace.holder()
        host.state.add_proc(0, local, 4 * GiB, host_pid=host_pid, release_delay_ms=500)
        host.publish()
        report, seconds = namespace.sweep()
        assert [t["pid"] for t in report["terminated"]] == [local], report
        assert report["outcome"] == "freed" and report["verified"] is True, report
        assert report["gpus"][0]["memory_used_after"] == 0
        assert any("PID namespace" in w for w in report["warnings"]), report["warnings"]

        # Another tenant of GPU 0, on the host: its pid names no process here.
        tenant = os.getpid()
        host.state.procs.clear()
        host.state.add_proc(0, tenant, 8 * GiB, raw=True)
        local, host_pid = namespace.holder()
        host.state.add_proc(0, local, 4 * GiB, host_pid=host_pid)
        host.publish()
        report, seconds = namespace.sweep()
        assert [t["pid"] for t in report["terminated"]] == [local], report
        assert report["outcome"] == "unverified" and report["verified"] is False, report
        assert report["gpus"][0]["released"] is False
        assert report["gpus"][0]["memory_used_after"] == 8 * GiB
        assert report["leaks"] == []
        assert any("GPU 0: memory not verified: NVML still lists 1 process(es) by host PIDs"
                   in w for w in report["warnings"]), report["warnings"]
        assert seconds < 12, f"waited {seconds:.1f} s for another tenant's entry to go"
        # What a Slurm epilog's drain reason says about it.
        assert "unverified: GPU 0: memory not verified: NVML still lists" in summary("7", Report.from_dict(report))

        # The tenant's host pid is, by chance, a local process's pid here.
        bystander = int(namespace.ask("bystander", tenant)["pid"])
        assert bystander == tenant, "could not give a local process the tenant's pid"
        local, host_pid = namespace.holder()
        host.state.procs = [p for p in host.state.procs if p.raw]
        host.state.add_proc(0, local, 4 * GiB, host_pid=host_pid)
        host.publish()
        report, seconds = namespace.sweep()
        assert [t["pid"] for t in report["terminated"]] == [local], report
        assert report["outcome"] == "unverified", report
    finally:
        namespace.close()
