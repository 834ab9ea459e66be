"""`gpuguardctl sweep --slurm-epilog`: the finished job's processes (still in its cgroup, or
escaped from it but its user's and on its GPUs) are ended, and nothing of another job or user,
against real processes in real cgroups named as Slurm names them and the fake NVML. Slurm
itself runs the epilog in tests/e2e/test_slurm_e2e.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gpuguardd.engine import procfs
from gpuguardd.engine.slurm import summary
from gpuguardd.records.enums import Outcome
from gpuguardd.records.report import Report
from tests.conftest import HOLDER, CgroupDir, GiB, GpuHost, Proc
from tests.shipped import shipped_file

NOBODY = 65534
EPILOG = "slurm/epilog.d/50-gpuguard"


def test_unverified_summary_says_why() -> None:
    # The warnings that say why are picked by their codes (warning_codes), never their words.
    report = {"outcome": "unverified", "warnings": [
        "could not read the open files of 1 process(es) (1): permission denied",
        "NVML Shared Library Not Found: GPU memory cannot be verified"],
        "warning_codes": ["other", "nvml-unavailable"]}
    assert summary("9", Report.from_dict(report)) == ("gpuguard: job 9: unverified: "
                                    "NVML Shared Library Not Found: GPU memory cannot be verified")
    # A report without the codes (a daemon older than them) gets the general words.
    del report["warning_codes"]
    assert summary("9", Report.from_dict(report)) == "gpuguard: job 9: unverified: GPU memory not verified"
    assert summary("9", Report(outcome=Outcome.UNVERIFIED)) == \
        "gpuguard: job 9: unverified: GPU memory not verified"


# -- real processes ---------------------------------------------------------------------------

def spawn_as(host: GpuHost, uid: int, *args: str, gpu: int | None = None,
             nvml: tuple[int, int] | None = None) -> Proc:
    """tests/holder.py as `uid` (what a job's user runs), registered like GpuHost.spawn's.
    The test's device nodes are in root's private tmp_path: the GPU's nodes are opened here
    and inherited, as a job's process inherits what its launcher opened."""
    nodes = [host.node(f"nvidia{gpu}"), host.node("nvidia-uvm")] if gpu is not None else []
    fds = [os.open(node, os.O_PATH) for node in nodes]
    try:
        proc = host.start(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                           # The system's interpreter: a venv's may sit under /root.
                           "/usr/bin/python3", str(HOLDER), *args], pass_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)
    if nvml is not None:
        host.state.add_proc(nvml[0], proc.pid, nvml[1])
        host.publish()
    return proc


def epilog(host: GpuHost, job: int, uid: int, gpus: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**host.env, "SLURM_JOB_ID": str(job), "SLURM_JOB_UID": str(uid), "SLURM_JOB_GPUS": gpus}
    return subprocess.run([sys.executable, "-m", "gpuguardd.cli.main", "sweep", "--slurm-epilog",
                           "--local", "--config", str(host.config_path), *extra],
                          env=env, capture_output=True, text=True, timeout=120, check=False)


def test_epilog_ends_the_jobs_processes_and_nothing_else(
        gpu_host: GpuHost, systemd_cgroup: Callable[[str], CgroupDir]) -> None:
    host = gpu_host
    host.write_config("[Sweep]\nGraceSec=9\n")  # the epilog's own default must win
    job, other = random.sample(range(10_000, 10_000_000), 2)
    in_job = spawn_as(host, 0, gpu=0, nvml=(0, 4 * GiB))  # root, but in the job
    systemd_cgroup(f"slurm/uid_{NOBODY}/job_{job}/step_0").add(in_job.pid)
    escaped = spawn_as(host, NOBODY, "--setsid", gpu=0, nvml=(0, 8 * GiB))
    other_job = spawn_as(host, NOBODY, gpu=0, nvml=(0, 2 * GiB))
    systemd_cgroup(f"slurm/uid_{NOBODY}/job_{other}/step_0").add(other_job.pid)
    other_user = spawn_as(host, 0, gpu=0, nvml=(0, GiB))
    other_gpu = spawn_as(host, NOBODY, gpu=1, nvml=(1, GiB))

    done = epilog(host, job, NOBODY, "0", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert {t["pid"] for t in report["terminated"]} == {in_job.pid, escaped.pid}
    assert report["reason"] == f"slurm:{job}"
    assert report["scope"]["slurm_job"] == str(job) and report["scope"]["slurm_uid"] == NOBODY
    assert report["scope"]["grace_ms"] == 2000, "a short default grace: Slurm waited KillWait"
    for untouched in (other_job, other_user, other_gpu):
        assert untouched.alive()


def test_a_survivor_is_the_drain_decision(gpu_host: GpuHost) -> None:
    host = gpu_host
    job = random.randrange(10_000, 10_000_000)
    parent = spawn_as(host, NOBODY, "--spawn-zombie")  # holds nothing itself
    deadline = time.monotonic() + 5
    while procfs.read_stat(parent.zombie).state != "Z":  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    host.state.add_proc(0, parent.zombie, 6 * GiB)
    host.publish()
    done = epilog(host, job, NOBODY, "0")
    assert done.returncode == 3, done.stdout + done.stderr
    # stdout: the one line the epilog script hands to `scontrol update ... Reason=`.
    assert done.stdout.splitlines() == [
        f"gpuguard: job {job}: survivors: pid {parent.zombie} zombie: parent {parent.pid} has not reaped it"]
    assert f"slurm:{job}" in done.stderr


def test_nothing_left_is_exit_zero_and_silent(gpu_host: GpuHost) -> None:
    done = epilog(gpu_host, random.randrange(10_000, 10_000_000), NOBODY, "1")
    assert (done.returncode, done.stdout) == (0, ""), done.stderr


def test_bad_environment_is_a_usage_error_and_drains(gpu_host: GpuHost) -> None:
    done = epilog(gpu_host, 5, NOBODY, "0,x")
    assert done.returncode == 2
    assert "SLURM_JOB_GPUS" in done.stderr and "'x'" in done.stderr
    assert done.stdout.startswith("gpuguard: job 5: ")


def test_the_deadline_bounds_the_epilog(gpu_host: GpuHost) -> None:
    host = gpu_host
    job = random.randrange(10_000, 10_000_000)
    stubborn = spawn_as(host, NOBODY, "--ignore-term", gpu=0, nvml=(0, GiB))
    started = time.monotonic()
    done = epilog(host, job, NOBODY, "0", "--grace", "30s", "--deadline", "2s")
    assert time.monotonic() - started < 10
    assert done.returncode == 1
    assert done.stdout.strip() == f"gpuguard: job {job}: no result within the 2 s deadline"
    stubborn.stop()


def test_shipped_epilog_script_drains_with_gpuguards_reason(gpu_host: GpuHost, tmp_path: Path) -> None:
    """50-gpuguard as slurmd runs it, with scontrol a recording stand-in (the real one is
    driven in tests/e2e)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    epilog = shipped_file(EPILOG, tmp_path)
    assert epilog.read_text().startswith("#!/bin/sh\n")
    (bindir / "gpuguardctl").write_text(
        "#!/bin/sh\necho 'gpuguard: job 9: survivors: pid 1 (x)'\nexit 3\n")
    (bindir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/scontrol.args\n")
    for tool in bindir.iterdir():
        tool.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "9", "SLURMD_NODENAME": "gpu-node-1",
           "GPUGUARDCTL": str(bindir / "gpuguardctl"), "SCONTROL": str(bindir / "scontrol")}
    done = subprocess.run(["/bin/sh", str(epilog)], env=env, capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 3
    assert (tmp_path / "scontrol.args").read_text().split(" ", 3)[:3] == [
        "update", "NodeName=gpu-node-1", "State=DRAIN"]
    assert "Reason=gpuguard: job 9: survivors: pid 1 (x)" in (tmp_path / "scontrol.args").read_text()
    (bindir / "gpuguardctl").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "scontrol.args").unlink()
    done = subprocess.run(["/bin/sh", str(epilog)], env=env, capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 0 and not (tmp_path / "scontrol.args").exists()
