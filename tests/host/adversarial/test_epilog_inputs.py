"""The Slurm epilog's environment read strictly, with real processes, and
the root-job decision. SLURM_JOB_UID=\\u0660 was read as uid 0 and the epilog then ended
root's holder on the job's GPU; SLURM_JOB_ID="4711\\n" was refused by the daemon but taken by
`--local`, which ended the job user's escaped holder and exited 0. Each is now a usage error
(exit 2) that names the value, and nothing is signalled; and a root job's epilog ends only its
own cgroup's processes, never root's services on its GPU."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable

import pytest

from gpuguardd.cli.exits import EXIT_OK, EXIT_USAGE
from tests.conftest import CgroupDir, GiB, GpuHost
from tests.host.test_slurm import NOBODY, spawn_as


def epilog_env(host: GpuHost, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuguardd.cli.main", "sweep", "--slurm-epilog",
                           "--local", "--config", str(host.config_path)],
                          env={**host.env, **env}, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize(("env", "named"), [
    ({"SLURM_JOB_ID": "4711", "SLURM_JOB_UID": "\u0660", "SLURM_JOB_GPUS": "0"}, "SLURM_JOB_UID '\u0660'"),
    ({"SLURM_JOB_ID": "4711", "SLURM_JOB_UID": "\U0001d7ce", "SLURM_JOB_GPUS": "0"}, "SLURM_JOB_UID"),
    ({"SLURM_JOB_ID": "4711", "SLURM_JOB_UID": "\u00b2", "SLURM_JOB_GPUS": "0"}, "SLURM_JOB_UID '\u00b2'"),
    ({"SLURM_JOB_ID": "4711", "SLURM_JOB_UID": "65534", "SLURM_JOB_GPUS": "\u00b2"}, "SLURM_JOB_GPUS '\u00b2'"),
    ({"SLURM_JOB_ID": "4711\n", "SLURM_JOB_UID": "65534", "SLURM_JOB_GPUS": "0"}, "SLURM_JOB_ID '4711\\n'"),
], ids=["arabic-zero-uid", "math-zero-uid", "superscript-uid", "superscript-gpus", "job-id-newline"])
def test_loose_epilog_numbers_end_nothing(gpu_host: GpuHost, env: dict[str, str], named: str) -> None:
    host = gpu_host
    roots = spawn_as(host, 0, gpu=0, nvml=(0, 4 * GiB))
    users = spawn_as(host, NOBODY, "--setsid", gpu=0, nvml=(0, 2 * GiB))
    done = epilog_env(host, **env)
    assert done.returncode == EXIT_USAGE, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert named in done.stdout, done.stdout  # the drain reason names the bad value
    assert roots.alive() and users.alive()


def test_a_root_jobs_epilog_spares_root_outside_the_job(
        gpu_host: GpuHost, systemd_cgroup: Callable[[str], CgroupDir]) -> None:
    host = gpu_host
    job = random.randrange(10_000, 10_000_000)
    in_job = spawn_as(host, 0, gpu=0, nvml=(0, 4 * GiB))
    systemd_cgroup(f"slurm/uid_0/job_{job}/step_0").add(in_job.pid)
    service = spawn_as(host, 0, gpu=0, nvml=(0, 2 * GiB))  # root, on the job's GPU, in no job
    done = epilog_env(host, SLURM_JOB_ID=str(job), SLURM_JOB_UID="0", SLURM_JOB_GPUS="0")
    assert done.returncode in (EXIT_OK, 4), done.stdout + done.stderr  # 4: the spared one's memory
    in_job.popen.wait(timeout=30)
    assert service.alive(), done.stderr
