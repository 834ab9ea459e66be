"""The Slurm epilog against the real Slurm: Debian 12's slurmctld, slurmd and munge as a
one-node cluster inside the session's throwaway systemd, the node's two fake GPUs as gres,
gpuguard's shipped epilog (/usr/share/gpuguard/slurm/epilog.d/50-gpuguard) as Epilog= with a
glob. slurmctld and slurmd run as transient units (their Debian units are masked at boot:
harness.BOOT_MASKED) on 127.0.0.1 in the container's own network namespace.

Jobs are tests/e2e/slurm_job.py, run by a user of their own. Slurm tracks a job's processes
here with proctrack/linuxproc (the container's cgroup v1 controllers are read-only, so
proctrack/cgroup cannot make job cgroups), so a worker "escapes" the job by leaving its process
tree, as a daemonised rank does; the job-cgroup half of the scope is covered against real
cgroups in tests/test_slurm.py. A worker that cannot be ended is one the test freezes from the
host (cgroup v1 freezer): it sleeps uninterruptibly and ignores SIGKILL, as a rank stuck in
the driver does. Slurm's tools resolve even 127.0.0.1 with AI_ADDRCONFIG, which needs an IPv4
address other than 127.0.0.1 in the namespace: 10.254.0.1/32 goes on the container's lo.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

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
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
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
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

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
    # The shipped epilog, where the package puts it, linked into the directory Epilog= globs.
    m.copy(REPO / "slurm" / "epilog.d" / "50-gpuguard",
           "/usr/share/gpuguard/slurm/epilog.d/50-gpuguard", 0o755)
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
    m.run(["systemd-run", "--collect", "--unit=e2e-slurmd", "/usr/sbin/slurmd", "-D"])
    try:
        wait_for("the node to be idle", lambda: node_state(guard) == "idle" or None, 60, 0.5)
        yield guard
    finally:
        m.run("scancel --full --user " + USER, check=False)
        for unit in ("e2e-slurmd.service", "e2e-slurmctld.service", "munge.service"):
            m.systemctl("stop", unit, check=False)
        m.run("rm -rf /etc/slurm/slurm.conf /etc/slurm/gres.conf "
              "/etc/slurm/epilog.d /var/lib/gg-slurm /run/gg-slurm /var/log/gg-slurm", check=False)


def node_state(guard: Installed) -> str:
    done = guard.machine.run(["sinfo", "-h", "-N", "-o", "%T"], check=False)
    return done.stdout.strip()


def node_reason(guard: Installed) -> str:
    return guard.machine.run(["sinfo", "-h", "-N", "-o", "%E"]).stdout.strip()


def submit(guard: Installed, mode: str) -> str:
    done = guard.machine.run(["runuser", "-u", USER, "--", "sbatch", "--parsable", "--gres=gpu:1",
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


def test_epilog_ends_the_escaped_worker_and_spares_another_job(slurm: Installed) -> None:
    guard = slurm
    other = submit(guard, "stay")
    bystander_pids = job_pids(guard, other)
    bystander = bystander_pids["worker"]
    wait_for("the other job to run", lambda: job_state(guard, other) == "RUNNING" or None, 30, 0.3)
    job = submit(guard, "escape")
    worker_pids = job_pids(guard, job)
    worker = worker_pids["worker"]
    # (Recorded by the worker itself: the epilog may have ended it by the time we look.)
    assert worker_pids["gpu"] != bystander_pids["gpu"], "two jobs, two GPUs"
    # The job ended (its own process exited); its worker did not: Slurm lost track of it.
    wait_for(f"job {job} to end", lambda: job_state(guard, job) == "" or None, 60, 0.5)
    report = wait_for("the epilog's sweep", lambda: next(
        (r for r in guard.history() if r.get("reason") == f"slurm:{job}"), None), 60, 0.5)
    assert report["outcome"] == "freed", report
    assert [t["pid"] for t in report["terminated"]] == [worker]
    assert report["scope"]["slurm_job"] == job
    assert not guard.alive(worker)
    assert guard.alive(bystander) and job_state(guard, other) == "RUNNING"
    assert node_state(guard) == "mixed"  # the other job still runs; nothing drained
    guard.machine.run(["scancel", other])
    wait_for("the node to be idle again", lambda: node_state(guard) == "idle" or None, 60, 0.5)
    assert not guard.alive(bystander)


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
    m.copy(REPO / "slurm" / "unkillable-step", "/usr/share/gpuguard/slurm/unkillable-step", 0o755)
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
