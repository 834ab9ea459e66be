"""Discovery and attribution against real processes holding test device nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gpuguardd.config import Config
from gpuguardd.engine.engine import Engine
from gpuguardd.records.models import Holder, Scope
from tests.conftest import GiB, GpuHost


def engine_for(host: GpuHost, *more_nodes: str) -> Engine:
    """An engine watching the host's nodes, plus the directories of `more_nodes`."""
    patterns = (f"{host.dev}/nvidia*", *(f"{os.path.dirname(n)}/nvidia*" for n in more_nodes))
    # (1, 5): mappable_uvm()'s node has /dev/zero's numbers.
    majors = (120, 1) if more_nodes else (120,)
    return Engine(Config(device_paths=patterns, allow_majors=majors,
                         runtime_directory=str(host.root / "run")))


def holder_by_pid(holders: list[Holder], pid: int) -> Holder:
    matches = [h for h in holders if h.pid == pid]
    assert matches, f"pid {pid} not among holders {[h.pid for h in holders]}"
    return matches[0]


def test_fd_holder_is_found_with_gpu_kind_and_devices(inproc_nvml: GpuHost) -> None:
    host = inproc_nvml
    proc = host.spawn("--hold", host.node("nvidia1"), "--hold", host.node("nvidiactl"),
                      "--hold", host.node("nvidia-uvm"))
    holder = holder_by_pid(engine_for(host).scan().holders, proc.pid)
    assert holder.how == ["fd"]
    assert holder.gpus == [1]
    assert holder.kind == "compute"
    assert holder.devices == sorted([host.node("nvidia1"), host.node("nvidiactl"), host.node("nvidia-uvm")])
    assert holder.exe == os.path.realpath(sys.executable)
    assert holder.user == "root" and holder.uid == 0
    assert holder.state in ("S", "R")
    assert "holder.py" in holder.cmdline


def test_mmap_only_holder_is_found(inproc_nvml: GpuHost) -> None:
    host = inproc_nvml
    uvm = host.mappable_uvm()
    proc = host.spawn("--mmap", uvm)
    maps = Path(f"/proc/{proc.pid}/maps").read_text()
    assert uvm in maps
    assert not any(os.path.realpath(f"/proc/{proc.pid}/fd/{fd}") == uvm
                   for fd in os.listdir(f"/proc/{proc.pid}/fd"))
    holder = holder_by_pid(engine_for(host, uvm).scan().holders, proc.pid)
    assert holder.how == ["mmap"]
    assert holder.kind == "compute"


def test_nvml_listed_process_gets_memory_and_gpu(inproc_nvml: GpuHost) -> None:
    host = inproc_nvml
    proc = host.spawn(nvml=(1, 3 * GiB))
    holder = holder_by_pid(engine_for(host).scan().holders, proc.pid)
    assert holder.how == ["nvml"]
    assert holder.gpus == [1]
    assert holder.gpu_memory == 3 * GiB
    assert holder.kind == "compute"


def test_node_at_another_path_is_matched_by_device_number(inproc_nvml: GpuHost) -> None:
    """A container's /dev is another directory with its own nodes for the same devices."""
    host = inproc_nvml
    container_dev = host.root / "container-dev"
    container_dev.mkdir()
    os.mknod(container_dev / "gpu-a", 0o666 | 0o020000, os.stat(host.node("nvidia0")).st_rdev)
    proc = host.spawn("--hold", str(container_dev / "gpu-a"))
    holder = holder_by_pid(engine_for(host).scan().holders, proc.pid)
    assert holder.devices == [host.node("nvidia0")]
    assert holder.gpus == [0]


def test_control_only_client_is_management(inproc_nvml: GpuHost) -> None:
    host = inproc_nvml
    proc = host.spawn("--hold", host.node("nvidiactl"), "--hold", host.node("nvidia0"))
    holder = holder_by_pid(engine_for(host).scan().holders, proc.pid)
    assert holder.kind == "management"
    assert holder.gpus == [0]


def test_unrelated_processes_are_not_holders(inproc_nvml: GpuHost) -> None:
    host = inproc_nvml
    idle = subprocess.Popen(["sleep", "30"])
    try:
        pids = {h.pid for h in engine_for(host).scan().holders}
        assert idle.pid not in pids
        assert os.getpid() not in pids
    finally:
        idle.kill()
        idle.wait()


def test_processes_exiting_during_scans_never_break_it(inproc_nvml: GpuHost) -> None:
    host = inproc_nvml
    uvm = host.mappable_uvm()
    engine = engine_for(host, uvm)
    # Short-lived holders: the shell opens the node and exits at once, 300 times over.
    churn = subprocess.Popen(
        ["bash", "-c", f"for i in $(seq 300); do (exec 3<>{uvm}; true) & done; wait"])
    scans = 0
    while churn.poll() is None or scans < 3:
        result = engine.scan()
        assert all(h.pid > 0 and h.how for h in result.holders)
        scans += 1
    assert churn.wait() == 0


def test_unit_and_container_attribution(inproc_nvml: GpuHost, systemd_cgroup) -> None:  # type: ignore[no-untyped-def]
    host = inproc_nvml
    unit_cg = systemd_cgroup("system.slice/gg-test-sglang.service")
    lxc_cg = systemd_cgroup("lxc/129/system.slice/gg-test-sglang.service")
    on_host = host.spawn("--hold", host.node("nvidia-uvm"))
    in_lxc = host.spawn("--hold", host.node("nvidia-uvm"))
    unit_cg.add(on_host.pid)
    lxc_cg.add(in_lxc.pid)
    engine = engine_for(host)
    holders = engine.scan().holders
    a = holder_by_pid(holders, on_host.pid)
    b = holder_by_pid(holders, in_lxc.pid)
    assert (a.unit, a.container) == ("gg-test-sglang.service", "")
    assert a.cgroup == "/system.slice/gg-test-sglang.service"
    assert (b.unit, b.container) == ("gg-test-sglang.service", "lxc/129")
    only_host, _ = engine.list_holders(Scope(unit="gg-test-sglang.service"))
    assert [h.pid for h in only_host] == [on_host.pid]
    only_lxc, _ = engine.list_holders(Scope(container="lxc/129"))
    assert [h.pid for h in only_lxc] == [in_lxc.pid]


def test_cli_holders_json_and_table(gpu_host: GpuHost) -> None:
    host = gpu_host
    proc = host.spawn("--hold", host.node("nvidia0"), "--hold", host.node("nvidia-uvm"), nvml=(0, 2 * GiB))
    result = host.cli("holders", "--json")
    assert result.returncode == 0, result.stderr
    holders = json.loads(result.stdout)
    mine = [h for h in holders if h["pid"] == proc.pid]
    assert mine and mine[0]["how"] == ["fd", "nvml"] and mine[0]["gpu_memory"] == 2 * GiB
    table = host.cli("holders")
    assert table.returncode == 0
    header, *rows = table.stdout.splitlines()
    assert header.split()[:3] == ["PID", "USER", "UNIT"]
    row = [r for r in rows if r.split()[0] == str(proc.pid)]
    assert row and "2.0 GiB" in row[0] and "fd,nvml" in row[0]


def test_cli_gpus_shows_memory_and_state(gpu_host: GpuHost) -> None:
    host = gpu_host
    host.state.gpus[1].base_used = 5 * GiB  # memory in use with no process: a leak
    host.publish()
    host.spawn("--hold", host.node("nvidia-uvm"), nvml=(0, GiB))
    result = host.cli("gpus", "--json")
    assert result.returncode == 0, result.stderr
    gpus = {g["index"]: g for g in json.loads(result.stdout)}
    assert gpus[0]["state"] == "in-use" and gpus[0]["memory_used"] == GiB
    # The compute process, and gpuguardctl's own NVML handles (a management holder that, like
    # persistenced, never makes a GPU in-use: GPU 1 still reads leaked below).
    assert gpus[0]["holder_count"] == 2
    assert gpus[1]["state"] == "leaked" and gpus[1]["memory_used"] == 5 * GiB
    assert gpus[0]["uuid"] == host.state.gpus[0].uuid


def test_lost_gpu_is_reported_lost(gpu_host: GpuHost) -> None:
    host = gpu_host
    host.state.gpus[1].lost = True
    host.publish()
    gpus = {g["index"]: g for g in json.loads(host.cli("gpus", "--json").stdout)}
    assert gpus[1]["state"] == "lost"
    assert gpus[0]["state"] == "idle"


def test_without_nvml_holders_are_still_found_by_device_files(gpu_host: GpuHost) -> None:
    host = gpu_host
    proc = host.spawn("--hold", host.node("nvidia1"), "--hold", host.node("nvidia-uvm"))
    env = dict(host.env)
    env.pop("LD_LIBRARY_PATH")  # no libnvidia-ml.so.1 anywhere: the library is missing
    result = subprocess.run([sys.executable, "-m", "gpuguardd.cli.main", "holders", "--json", "--local",
                             "--config", str(host.config_path)], env=env, capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stderr
    mine = [h for h in json.loads(result.stdout) if h["pid"] == proc.pid]
    assert mine and mine[0]["gpus"] == [1] and mine[0]["how"] == ["fd"]
    status = json.loads(subprocess.run(
        [sys.executable, "-m", "gpuguardd.cli.main", "status", "--json", "--local", "--config",
         str(host.config_path)], env=env, capture_output=True, text=True, check=True).stdout)
    assert status["nvml_available"] is False
    assert "Library Not Found" in status["nvml_error"]


def test_driver_not_loaded_is_reported(gpu_host: GpuHost) -> None:
    host = gpu_host
    host.state.init_error = 9
    host.publish()
    status = json.loads(host.cli("status", "--json").stdout)
    assert status["nvml_available"] is False
    assert "Driver Not Loaded" in status["nvml_error"]


def test_non_root_scan_says_what_it_could_not_see(gpu_host: GpuHost) -> None:
    host = gpu_host
    host.spawn("--hold", host.node("nvidia-uvm"))
    # pytest's temporary directories are private to root; the unprivileged user needs a copy
    with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as conf:
        conf.write(host.config_path.read_text())
    os.chmod(conf.name, 0o644)
    try:
        result = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
             "gpuguardd.cli.main", "holders", "--local", "--config", conf.name],
            env=host.env, capture_output=True, text=True, check=False, cwd="/")
    finally:
        os.unlink(conf.name)
    assert result.returncode == 0, result.stderr
    assert "could not read the open files of" in result.stderr
    assert "run as root" in result.stderr
