"""NVML's PIDs are untrusted input: garbage from a driver/pynvml struct mismatch, pids of another
PID namespace, pids of processes that hold no GPU here. None of them may crash a scan or make a
local process a target on NVML's word alone."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HOLDER, GiB, GpuHost
from tests.fakenvml import build_library
from tests.host.test_gpu_attribution import cli_json, cuda

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
