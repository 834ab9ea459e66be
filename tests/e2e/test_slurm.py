"""The Slurm epilog against the real Slurm: Debian 12's slurmctld, slurmd and munge as a
one-node cluster inside the session's throwaway systemd, the node's two fake GPUs as gres,
gpuguard's shipped epilog (/usr/share/gpuguard/slurm/epilog.d/50-gpuguard) as Epilog= with a
glob. slurmctld and slurmd run as transient units (their Debian units are masked at boot:
harness.BOOT_MASKED) on 127.0.0.1 in the container's own network namespace.

Jobs are tests/e2e/slurm_job.py, run by a user of their own, in real job cgroups:
proctrack/cgroup and task/cgroup. How, on these hosts (cgroup v1 "hybrid": v1 controllers plus
an empty cgroup2 at /sys/fs/cgroup/unified), checked with Debian 12's Slurm 22.05.8:

* cgroup/v2 cannot work here. The kernel lists every mounted hierarchy in /proc/<pid>/cgroup,
  the host's v1 controllers included, so slurmd stops with `fatal: Hybrid mode is not
  supported. Mounted cgroups are: 9:name=systemd:/... 6:freezer:/ ... 0::/system.slice/...`
  both in the machine as booted and in one booted with SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1
  (pure cgroup2 at /sys/fs/cgroup); CgroupMountpoint=/sys/fs/cgroup/unified changes nothing.
  So slurmstepd.scope (made through systemd's D-Bus) is not exercised here. On a host with
  cgroup2 only, the machine is cgroup2 too, and the fixture configures cgroup/v2 (slurmd with
  Delegate=yes): jobs in system.slice/slurmstepd.scope/job_<id>.
* cgroup/v1 works once the freezer (all proctrack/cgroup needs) is writable: nspawn mounts the
  v1 controllers read-only (`common_cgroup_instantiate: unable to create cgroup
  '/sys/fs/cgroup/freezer/slurm_vm' : Read-only file system`, then `slurmd initialization
  failed`); a plain `mount -o remount,rw` is refused (EBUSY), a bind remount
  (`remount,bind,rw`) of the machine's own mount works. Each machine's freezer root is a
  cgroup of its own (harness.CGROUP_ROOTS), so the job cgroups are the machine's. Debian's
  Slurm is built for several slurmds a host: its v1 job cgroups are
  `/slurm_<node>/uid_<uid>/job_<id>/step_<step>`, not `/slurm/uid_...` (gpuguard reads both).
  ConstrainCores/RAMSpace/Devices stay off: those controllers stay read-only.

With proctrack/cgroup a worker that only leaves the job's process tree is still in its cgroup,
and Slurm ends it; the escaped worker here also leaves the cgroup (the test moves it, as a
root launcher or a container runtime would). A worker that cannot be ended is one the test
freezes from the host (a v1 freezer cgroup of the host's, which takes it out of the job's
freezer cgroup too): it sleeps uninterruptibly and ignores SIGKILL, as a rank stuck in the
driver does. Slurm's tools resolve even 127.0.0.1 with AI_ADDRCONFIG, which needs an IPv4
address other than 127.0.0.1 in the namespace: 10.254.0.1/32 goes on the container's lo.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguardd.engine.slurm import job_of_cgroups
from tests.conftest import v1_freezer
from tests.e2e.harness import FAKE_NVML_STATE, REPO, Installed, wait_for

SLURM_CONF = """\
ClusterName=gpuguard
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/var/lib/gg-slurm/ctld
SlurmdSpoolDir=/var/lib/gg-slurm/d
SlurmctldPidFile=/run/gg-slurm/slurmctld.pid
SlurmdPidFile=/run/gg-slurm/slurmd.pid
SlurmctldLogFile=/var/log/gg-slurm/slurmctld.log
SlurmdLogFile=/var/log/gg-slurm/slurmd.log
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
KillWait=2
PrologEpilogTimeout=120
Epilog=/etc/slurm/epilog.d/*
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=30
{node} NodeAddr=127.0.0.1 Gres=gpu:2 State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
# OverSubscribe: three jobs at once on a node that may have two CPUs (cores are shared, gres
# never are).
CGROUP_CONF = """\
CgroupPlugin=cgroup/{version}
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
"""
FREEZER = "/sys/fs/cgroup/freezer"

GRES_CONF = "NodeName={host} Name=gpu File=/dev/nvidia[0-1]\n"
USER = "ggslurm"
JOB = REPO / "tests" / "e2e" / "slurm_job.py"


@pytest.fixture(scope="module")
def slurm(guard: Installed) -> Iterator[Installed]:
    for tool in ("slurmctld", "slurmd", "munged"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is required (make deps installs slurmctld, slurmd, munge)")
    m = guard.machine
    host = m.run(["hostname", "-s"]).stdout.strip()
    # What slurmd finds on this machine (CPUs, sockets, memory), so the node is valid as is.
    node = m.run(["slurmd", "-C"]).stdout.splitlines()[0]
    node = re.sub(r"\s*RealMemory=\d+", " RealMemory=500", node)
    m.write("/etc/slurm/slurm.conf", SLURM_CONF.format(host=host, node=node))
    m.write("/etc/slurm/gres.conf", GRES_CONF.format(host=host))
    version = cgroup_version(guard)
    m.write("/etc/slurm/cgroup.conf", CGROUP_CONF.format(version=version))
    if version == "v1":
        # The machine's own mount of its freezer root (module docstring).
        m.run(["mount", "-o", "remount,bind,rw", FREEZER])
    # The shipped epilog, where the package puts it, linked into the directory Epilog= globs.
    m.install_shipped("slurm/epilog.d/50-gpuguard", "/usr/share/gpuguard/slurm/epilog.d/50-gpuguard", 0o755)
    m.run("mkdir -p /etc/slurm/epilog.d /var/lib/gg-slurm/ctld /var/lib/gg-slurm/d /run/gg-slurm "
          "/var/log/gg-slurm/jobs && chmod 1777 /var/log/gg-slurm/jobs && "
          "ln -sf /usr/share/gpuguard/slurm/epilog.d/50-gpuguard "
          f"/etc/slurm/epilog.d/50-gpuguard && (id {USER} >/dev/null 2>&1 || useradd -M {USER})")
    m.run("ip addr add 10.254.0.1/32 dev lo 2>/dev/null || true")
    # The jobs' workers (the job's user) register with the fake NVML, as the driver would list
    # them: its state may have been rewritten by an earlier test (Installed.write_gpus, 0644).
    m.run(f"chmod 0666 {FAKE_NVML_STATE} {FAKE_NVML_STATE}.lock")
    m.systemctl("start", "munge.service")
    m.run(["systemd-run", "--collect", "--unit=e2e-slurmctld", "/usr/sbin/slurmctld", "-D", "-i"])
    # Delegate=yes: cgroup/v2 asks systemd for slurmstepd.scope and manages the tree below.
    m.run(["systemd-run", "--collect", "--unit=e2e-slurmd", "-p", "Delegate=yes",
           "/usr/sbin/slurmd", "-D"])
    try:
        wait_for("the node to be idle", lambda: node_state(guard) == "idle" or None, 60, 0.5)
        yield guard
    finally:
        m.run("scancel --full --user " + USER, check=False)
        for unit in ("e2e-slurmd.service", "e2e-slurmctld.service", "munge.service"):
            m.systemctl("stop", unit, check=False)
        # The jobs' pid files too: the next cluster numbers its jobs from 1 again, and would
        # find this one's slurm-1.pids before its own job 1 had even started.
        m.run("rm -rf /etc/slurm/slurm.conf /etc/slurm/gres.conf /etc/slurm/cgroup.conf "
              "/etc/slurm/epilog.d /var/lib/gg-slurm /run/gg-slurm /var/log/gg-slurm "
              "/run/fake-server/slurm-*.pids", check=False)
        m.run("rmdir /sys/fs/cgroup/gg-escaped 2>/dev/null", check=False)
        if version == "v1":
            # What slurmd left of its cgroup tree (slurm_<node>), deepest first; then read-only
            # again, as nspawn made it.
            m.run(f"find {FREEZER} -depth -mindepth 1 -type d -path '{FREEZER}/slurm*' "
                  "-exec rmdir {} +", check=False)
            m.run(["mount", "-o", "remount,bind,ro", FREEZER], check=False)


def cgroup_version(guard: Installed) -> str:
    """v2 where the machine has cgroup2 alone at /sys/fs/cgroup, else v1 (module docstring)."""
    kind = guard.machine.run(["stat", "-fc", "%T", "/sys/fs/cgroup"]).stdout.strip()
    return "v2" if kind == "cgroup2fs" else "v1"


def job_cgroup_pattern(guard: Installed, job: str) -> str:
    """Where real Slurm puts job `job`'s processes, as /proc/<pid>/cgroup shows it inside."""
    uid = guard.machine.run(["id", "-u", USER]).stdout.strip()
    if cgroup_version(guard) == "v2":
        return rf"^0::/system\.slice/slurmstepd\.scope/job_{job}/step_\w+"
    return rf"^\d+:freezer:/slurm_[^/]+/uid_{uid}/job_{job}/step_\w+"


def cgroups_inside(guard: Installed, pid: int) -> str:
    """/proc/<pid>/cgroup as gpuguardd reads it: relative to the machine's cgroup namespace
    (read from the host, every path has the machine's own cgroup in front)."""
    return guard.machine.run(["cat", f"/proc/{pid}/cgroup"]).stdout


def leave_job_cgroup(guard: Installed, pid: int) -> None:
    """Move `pid` out of its job's cgroup (the tracking hierarchy): a worker that escaped."""
    if cgroup_version(guard) == "v2":
        guard.machine.run("mkdir -p /sys/fs/cgroup/gg-escaped && "
                          f"echo {pid} > /sys/fs/cgroup/gg-escaped/cgroup.procs")
    else:
        guard.machine.run(f"echo {pid} > {FREEZER}/cgroup.procs")


def node_state(guard: Installed) -> str:
    done = guard.machine.run(["sinfo", "-h", "-N", "-o", "%T"], check=False)
    return done.stdout.strip()


def node_reason(guard: Installed) -> str:
    return guard.machine.run(["sinfo", "-h", "-N", "-o", "%E"]).stdout.strip()


def submit(guard: Installed, mode: str, gres: bool = True) -> str:
    done = guard.machine.run(["runuser", "-u", USER, "--", "sbatch", "--parsable",
                              *(["--gres=gpu:1"] if gres else []),
                              "-c", "1", "-o", "/var/log/gg-slurm/jobs/%j.out", "-D", "/",
                              "--wrap", f"exec /usr/bin/python3 {JOB} {mode}"])
    return done.stdout.strip().split(";")[0]


def slurm_logs(guard: Installed) -> str:
    return guard.machine.run("tail -n 15 /var/log/gg-slurm/*.log /var/log/gg-slurm/jobs/*; "
                             "squeue; sinfo -N", check=False).stdout


def job_pids(guard: Installed, job: str) -> dict[str, int]:
    try:
        text = wait_for(f"job {job}'s processes", lambda: _read_pids(guard, job), 30, 0.3)
    except Exception as exc:
        raise AssertionError(f"{exc}\n{slurm_logs(guard)}") from None
    return {k: int(v) for k, v in (item.split("=", 1) for item in text.split())}


def _read_pids(guard: Installed, job: str) -> str | None:
    try:
        return guard.machine.read(f"/run/fake-server/slurm-{job}.pids")
    except OSError:
        return None


def job_state(guard: Installed, job: str) -> str:
    return guard.machine.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip()


def test_epilog_ends_the_worker_that_left_its_job_cgroup_and_spares_other_jobs(
        slurm: Installed) -> None:
    """Real job cgroups: the epilog ends the job's worker that left the job's cgroup (its
    user's, on its GPU), and leaves two other jobs of the same user alone: one on the other
    GPU, and one without gres whose worker holds this job's very GPU from its own job cgroup,
    which only the cgroup tells apart (slurm_job.py's neighbour)."""
    guard = slurm
    m = guard.machine
    other = submit(guard, "stay")
    bystander_pids = job_pids(guard, other)
    bystander = bystander_pids["worker"]
    wait_for("the other job to run", lambda: job_state(guard, other) == "RUNNING" or None, 30, 0.3)
    job = submit(guard, "escape-wait")
    worker_pids = job_pids(guard, job)
    worker, gpu = worker_pids["worker"], worker_pids["gpu"]
    assert gpu != bystander_pids["gpu"], "two jobs, two GPUs"
    neighbour_job = submit(guard, f"neighbour {gpu}", gres=False)
    neighbour = job_pids(guard, neighbour_job)["worker"]
    # Each in its job's cgroup, as real Slurm made it, and read so by gpuguard.
    for pid, its_job in ((worker, job), (bystander, other), (neighbour, neighbour_job)):
        cgroups = cgroups_inside(guard, pid)
        assert re.search(job_cgroup_pattern(guard, its_job), cgroups, re.M), cgroups
        assert job_of_cgroups(cgroups) == its_job
    leave_job_cgroup(guard, worker)
    assert job_of_cgroups(cgroups_inside(guard, worker)) == "", cgroups_inside(guard, worker)
    m.run(["touch", f"/run/fake-server/slurm-{job}.go"])  # now the job ends
    wait_for(f"job {job} to end", lambda: job_state(guard, job) == "" or None, 60, 0.5)
    report = wait_for("the epilog's sweep", lambda: next(
        (r for r in guard.history() if r.get("reason") == f"slurm:{job}"), None), 60, 0.5)
    assert report["outcome"] == "freed", report
    assert [t["pid"] for t in report["terminated"]] == [worker]
    assert report["scope"]["slurm_job"] == job
    assert not guard.alive(worker)
    assert guard.alive(bystander) and job_state(guard, other) == "RUNNING"
    assert guard.alive(neighbour) and job_state(guard, neighbour_job) == "RUNNING"
    assert node_state(guard) == "mixed"  # the other jobs still run; nothing drained
    m.run(["scancel", other, neighbour_job])
    wait_for("the node to be idle again", lambda: node_state(guard) == "idle" or None, 60, 0.5)
    assert not guard.alive(bystander) and not guard.alive(neighbour)


def host_pid(guard: Installed, inner: int) -> int:
    """The host's PID of the container's process `inner`."""
    leader = guard.machine.leader
    namespace = os.readlink(f"/proc/{leader}/ns/pid")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "pid") != namespace:
                continue
            nspid = next(line for line in (entry / "status").read_text().splitlines()
                         if line.startswith("NSpid:")).split()
        except (OSError, StopIteration):
            continue
        if nspid[-1] == str(inner):
            return int(entry.name)
    raise AssertionError(f"no host PID for the container's PID {inner}")


@pytest.fixture
def freezer() -> Iterator[Path]:
    with v1_freezer(f"gg-slurm-e2e-{os.getpid()}") as path:
        yield path


def test_a_worker_that_cannot_be_ended_drains_the_node_with_gpuguards_reason(
        slurm: Installed, freezer: Path) -> None:
    guard = slurm
    m = guard.machine
    job = submit(guard, "escape-wait")
    worker = job_pids(guard, job)["worker"]
    (freezer / "cgroup.procs").write_text(str(host_pid(guard, worker)))
    (freezer / "freezer.state").write_text("FROZEN")
    wait_for("the worker to sleep uninterruptibly", lambda: "D (disk sleep)" in
             m.read(f"/proc/{worker}/status") or None, 10, 0.2)
    m.run(["touch", f"/run/fake-server/slurm-{job}.go"])  # now the job ends
    try:
        wait_for("the node to drain", lambda: node_state(guard) in ("drained", "draining") or None, 90, 0.5)
        reason = node_reason(guard)
        assert reason.startswith(f"gpuguard: job {job}: survivors: pid {worker} uninterruptible"), reason
        report = next(r for r in guard.history() if r.get("reason") == f"slurm:{job}")
        assert report["outcome"] == "survivors"
        assert [s["pid"] for s in report["survived"]] == [worker]
        assert "epilog failed status=3" in m.read("/var/log/gg-slurm/slurmd.log")
    finally:
        (freezer / "freezer.state").write_text("THAWED")  # the pending SIGKILL ends it
        wait_for("the worker to go", lambda: not guard.alive(worker), 20, 0.2)
        host = m.run(["hostname", "-s"]).stdout.strip()
        m.run(["scontrol", "update", f"NodeName={host}", "State=RESUME"], check=False)
    wait_for("the node to be idle again", lambda: node_state(guard) == "idle" or None, 60, 0.5)


def test_unkillable_step_program_reports_and_ends_nothing(slurm: Installed) -> None:
    """The shipped report-only UnkillableStepProgram: holders into the journal, no signal."""
    guard = slurm
    m = guard.machine
    m.install_shipped("slurm/unkillable-step", "/usr/share/gpuguard/slurm/unkillable-step", 0o755)
    job = submit(guard, "stay")
    worker = job_pids(guard, job)["worker"]
    wait_for("gpuguardd to see the worker", lambda: any(
        h["pid"] == worker for h in guard.holders()) or None, 20, 0.3)
    try:
        done = m.run(["/usr/share/gpuguard/slurm/unkillable-step"], env={"SLURM_JOB_ID": job})
        assert done.returncode == 0

        def reported() -> str | None:
            text = m.journal("-t", "gpuguard-unkillable-step")
            return text if str(worker) in text else None
        journal = wait_for("the report in the journal", reported, 10, 0.3)
        assert f"job {job} has a step that does not die" in journal
        assert guard.alive(worker) and job_state(guard, job) == "RUNNING"
    finally:
        m.run(["scancel", job])
    wait_for("the node to be idle again", lambda: node_state(guard) == "idle" or None, 60, 0.5)
