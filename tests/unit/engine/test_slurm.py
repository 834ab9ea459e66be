"""The Slurm epilog's inputs: a job's cgroups (v1, v2, others), its environment, and device
minors as NVML indices (the epilog against real processes in real cgroups:
tests/host/test_slurm.py)."""

from __future__ import annotations

import os

import pytest

from gpuguardd.engine import slurm
from gpuguardd.engine.slurm import epilog_job, gpu_selectors, job_of_cgroups
from gpuguardd.errors import InvalidArgument
from gpuguardd.records.enums import Outcome, Vendor, WarningCode
from gpuguardd.records.models import GpuSummary, Holder
from gpuguardd.records.report import Report


def test_job_of_cgroups_v1_v2_and_others() -> None:
    v1 = ("12:freezer:/slurm/uid_1000/job_42/step_0/task_0\n"
          "11:devices:/slurm/uid_1000/job_42/step_0\n1:name=systemd:/system.slice/slurmd.service\n")
    assert job_of_cgroups(v1) == "42"
    # Debian's Slurm (built for several slurmds a host) prefixes the node's name.
    assert job_of_cgroups("6:freezer:/slurm_node7/uid_1001/job_5/step_batch\n") == "5"
    assert job_of_cgroups("6:freezer:/slurmx/uid_1001/job_5/step_batch\n") == ""
    v2 = "0::/system.slice/slurmstepd.scope/job_7/step_batch/user/task_0\n"
    assert job_of_cgroups(v2) == "7"
    assert job_of_cgroups("0::/system.slice/slurmstepd.scope/system\n") == ""
    assert job_of_cgroups("0::/user.slice/user-1000.slice/session-3.scope\n") == ""
    # A job's id is a whole path component, and only under Slurm's own directories.
    assert job_of_cgroups("0::/system.slice/slurmstepd.scope/job_71x/step_0\n") == ""
    assert job_of_cgroups("0::/system.slice/evil/job_42\n") == ""


def test_epilog_environment() -> None:
    job = epilog_job({"SLURM_JOB_ID": "42", "SLURM_JOB_UID": "1000", "SLURM_JOB_GPUS": "2,0"})
    assert (job.job_id, job.uid, job.minors, job.reason) == ("42", 1000, (2, 0), "slurm:42")
    assert epilog_job({"SLURM_JOB_ID": "1", "SLURM_JOB_UID": "0",
                       "CUDA_VISIBLE_DEVICES": "3"}).minors == (3,)
    assert epilog_job({"SLURM_JOB_ID": "1", "SLURM_JOB_UID": "0",
                       "CUDA_VISIBLE_DEVICES": "NoDevFiles"}).minors == ()
    for env, needle in (({}, "SLURM_JOB_ID is not set"),
                        ({"SLURM_JOB_ID": "4;rm", "SLURM_JOB_UID": "0"}, "'4;rm'"),
                        ({"SLURM_JOB_ID": "4"}, "SLURM_JOB_UID is not set"),
                        ({"SLURM_JOB_ID": "4", "SLURM_JOB_UID": "-1"}, "SLURM_JOB_UID '-1'"),
                        ({"SLURM_JOB_ID": "4", "SLURM_JOB_UID": "0", "SLURM_JOB_GPUS": "0,GPU-1"},
                         "SLURM_JOB_GPUS 'GPU-1'")):
        with pytest.raises(InvalidArgument, match=needle.replace("(", r"\(")):
            epilog_job(env)


def test_device_minors_become_nvml_indices() -> None:
    gpus = [GpuSummary(index=0, minor=3), GpuSummary(index=1, minor=0)]
    assert gpu_selectors([0, 3], gpus) == (["1", "0"], [])
    with pytest.raises(InvalidArgument, match="no GPU has device minor 5"):
        gpu_selectors([5], gpus)
    selectors, warnings = gpu_selectors([2], [])
    assert selectors == ["2"] and "taken to be GPU 2" in warnings[0]


def test_amd_render_minors_and_pci_bus_ids_name_gpus() -> None:
    job = epilog_job({"SLURM_JOB_ID": "7", "SLURM_JOB_UID": "1000", "SLURM_JOB_GPUS": "129,0000:C3:00.0"})
    assert job.minors == (129, "0000:C3:00.0")
    gpus = [GpuSummary(index=0, minor=0), GpuSummary(index=1, minor=128, vendor=Vendor.AMD),
            GpuSummary(index=2, minor=129, vendor=Vendor.AMD)]
    # renderD129 is GPU 2; the PCI bus id goes to the sweep as typed, which resolves it.
    assert gpu_selectors(job.minors, gpus) == (["2", "0000:C3:00.0"], [])
    with pytest.raises(InvalidArgument, match=r"SLURM_JOB_GPUS '0000:c3:00\.8'"):
        epilog_job({"SLURM_JOB_ID": "7", "SLURM_JOB_UID": "0", "SLURM_JOB_GPUS": "0000:c3:00.8"})


def test_a_root_job_reaches_only_its_own_cgroup() -> None:
    """SLURM_JOB_UID=0: rule 2 ("the job user's, in no job cgroup") would reach every root
    service and session on the job's GPUs; for a root job only its cgroup is the job's."""

    from gpuguardd.engine import procfs
    from gpuguardd.engine.slurm import in_job_scope, job_of_cgroups
    outside = Holder(pid=os.getpid(), comm="exporter", uid=0, unit="dcgm-exporter.service")
    assert job_of_cgroups(procfs.read_cgroup(os.getpid()) or "") == ""  # this test runs in no Slurm job
    assert not in_job_scope(outside, "42", 0, lambda: True)
    user = Holder(pid=os.getpid(), comm="worker", uid=1000, unit="session-3.scope")
    assert in_job_scope(user, "42", 1000, lambda: True)


def test_the_epilogs_drain_reason_lists_the_warnings_coded_unverified() -> None:
    report = Report(outcome=Outcome.UNVERIFIED)
    # Words that look like the unverified ones, coded otherwise, are not picked.
    report.warn("[Devices] Paths: memory not verified, memory could not be read")
    report.warn("no NVML: GPU memory cannot be verified", WarningCode.NVML_UNAVAILABLE)
    report.warn("GPU 1: suspended", WarningCode.MEMORY_UNVERIFIED)
    assert slurm.summary("7", report) == (
        "gpuguard: job 7: unverified: no NVML: GPU memory cannot be verified; GPU 1: suspended")
    # Without a coded one: the general words.
    assert slurm.summary("7", Report(outcome=Outcome.UNVERIFIED, warnings=["memory not verified"])) \
        == "gpuguard: job 7: unverified: GPU memory not verified"

