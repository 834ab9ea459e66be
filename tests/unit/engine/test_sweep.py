"""Facts travel as codes, decided where they are known, never read back from the words:
spared reasons (protection.py, the sweep's plan), requester kinds (the service, the unit
watch, resume, the in-flight records) and the warnings the Slurm epilog acts on."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpuguardd.bus.auth import Caller
from gpuguardd.config import Config
from gpuguardd.daemon.inflight import InFlightSweep, InFlightSweeps
from gpuguardd.daemon.service import requester
from gpuguardd.engine import procfs, slurm
from gpuguardd.engine.protection import mark_protection, protection
from gpuguardd.engine.sweep import Sweep, SweepSettings
from gpuguardd.records.enums import HolderKind, Outcome, RequesterKind, SpareReason, WarningCode
from gpuguardd.records.models import Holder, NvmlSnapshot, Scope, SweepRequest
from gpuguardd.records.report import Report
from gpuguardd.systemd.rules import legacy_requester_kind

ROOT = Caller(sender=":1.42", uid=0, user="root", interactive=False)
ALICE = Caller(sender=":1.43", uid=1000, user="alice", interactive=True)


def test_protection_decides_the_code_with_the_words() -> None:
    config = Config()
    chain = procfs.ancestors(os.getpid())
    assert protection(Holder(pid=1, exe="/sbin/init", state="S"), config, chain) == (
        SpareReason.INIT, "PID 1 (init)")
    kthread = next(p for p in procfs.list_pids() if (s := procfs.read_stat(p)) and s.is_kernel_thread)
    assert protection(Holder(pid=kthread, state="S"), config, chain) == (
        SpareReason.KERNEL_THREAD, "kernel thread")
    assert protection(Holder(pid=os.getpid(), state="S"), config, chain) == (
        SpareReason.SELF, "gpuguard itself")
    if os.getppid() != 1:
        assert protection(Holder(pid=os.getppid(), state="S"), config, chain) == (
            SpareReason.ANCESTOR, "an ancestor of the sweeping process")
    child = subprocess.Popen(["sleep", "30"])
    try:
        exe = os.path.realpath(f"/proc/{child.pid}/exe")
        found = protection(Holder(pid=child.pid, exe=exe, state="S"),
                           Config(protected_executables=(exe,)), [])
        assert found is not None and found[0] is SpareReason.PROTECTED_EXECUTABLE
        assert protection(Holder(pid=child.pid, exe=exe, unit="nvidia-persistenced.service", state="S"),
                          config, []) == (SpareReason.PROTECTED_UNIT,
                                          "protected unit nvidia-persistenced.service")
        unknown = Holder(pid=child.pid, exe="", state="S")
        mark_protection(unknown, config, [])
        assert unknown.protected and unknown.protected_code is SpareReason.EXECUTABLE_UNKNOWN
        assert unknown.protected_why.startswith("executable unknown")
        free = Holder(pid=child.pid, exe=exe, state="S")
        mark_protection(free, config, [])
        assert not free.protected and free.protected_code is None and free.protected_why == ""
        # Not on the holder's wire form: the holder's keys stay as they were.
        assert "protected_code" not in unknown.to_dict()
    finally:
        child.kill()
        child.wait()


class Handle:
    def close(self) -> None:
        pass


def plan(holders: list[Holder], scope: Scope) -> Report:
    settings = SweepSettings(grace_sec=1, kill_timeout_sec=1, verify_timeout_sec=1,
                             released_below_bytes=0, dry_run=True)
    nvml = NvmlSnapshot(available=False)
    pinned: Any = [(h, Handle()) for h in holders]
    sweep = Sweep(scope, settings, (pinned, nvml, [], []), lambda: ([], nvml, [], []), lambda: nvml,
                  requested_by="x", requester_kind=RequesterKind.WATCH)
    return sweep.run()


def test_every_spared_entry_carries_the_code_of_why() -> None:
    protected = Holder(pid=101, exe="/x", kind=HolderKind.COMPUTE, how=["fd"], gpus=[0],
                       nvml_gpus=[0], protected=True, protected_why="protected unit a.service",
                       protected_code=SpareReason.PROTECTED_UNIT)
    management = Holder(pid=102, exe="/x", kind=HolderKind.MANAGEMENT, how=["fd"], gpus=[0],
                        node_gpus=[0])
    elsewhere = Holder(pid=103, exe="/x", kind=HolderKind.COMPUTE, how=["fd"], gpus=[0, 1],
                       node_gpus=[0, 1])
    no_device = Holder(pid=104, exe="/x", kind=HolderKind.COMPUTE, how=["nvml"], gpus=[0],
                       nvml_gpus=[0], state="S")
    mig = Holder(pid=105, exe="/x", kind=HolderKind.COMPUTE, how=["fd"], mig=["MIG-a", "MIG-b"])
    report = plan([protected, management, elsewhere, no_device], Scope(gpus=(0,)))
    assert {s.pid: s.code for s in report.spared} == {
        101: SpareReason.PROTECTED_UNIT, 102: SpareReason.MANAGEMENT, 103: SpareReason.OTHER_GPU,
        104: SpareReason.NO_DEVICE_HERE}
    # The words are today's, unchanged.
    assert {s.pid: s.why.split(" (")[0].split(";")[0] for s in report.spared} == {
        101: "protected unit a.service", 102: "management client",
        103: "also holds GPU 1", 104: "NVML lists it, but it holds no NVIDIA device here"}
    report = plan([mig], Scope(mig=("MIG-a",)))
    assert [(s.pid, s.code, s.why) for s in report.spared] == [
        (105, SpareReason.OTHER_MIG_INSTANCE, "also in MIG instance MIG-b")]
    assert report.to_dict()["spared"][0]["code"] == "other-mig-instance"
    # The sweep's report carries the kind it was asked with.
    assert report.requester_kind is RequesterKind.WATCH
    # Without NVML the sweep warns with a code, and every warning has one.
    assert report.warning_codes == [WarningCode.NVML_UNAVAILABLE]
    assert len(report.warnings) == 1


def test_the_requester_kind_is_decided_with_requested_by() -> None:
    assert requester(ROOT, "hook:train.service result=exit-code") == (
        "hook:train.service", RequesterKind.HOOK)
    assert requester(ALICE, "hook:train.service") == (
        "hook:train.service via uid 1000 (alice) :1.43", RequesterKind.HOOK_NONROOT)
    assert requester(ROOT, "", slurm_job="42") == ("slurm:42", RequesterKind.SLURM)
    assert requester(ALICE, "slurm:42", slurm_job="42") == ("uid 1000 (alice) :1.43",
                                                            RequesterKind.MANUAL)
    assert requester(ROOT, "watch:x.service") == ("uid 0 (root) :1.42", RequesterKind.MANUAL)


def test_an_in_flight_record_keeps_its_kind_and_an_older_one_gets_it_from_its_words(
        tmp_path: Path) -> None:
    report_id = "0123456789abcdef" * 2
    store = InFlightSweeps(str(tmp_path))
    request = SweepRequest(unit="a.service", requested_by="uid 0 (root) :1.5", report_id=report_id,
                           requester_kind=RequesterKind.RECOVERED, dry_run=False)
    assert store.add(InFlightSweep(request, 1))
    (back,) = store.load()
    assert back.request.requester_kind is RequesterKind.RECOVERED
    # A record the version before the kinds wrote (a daemon upgraded mid-sweep).
    path = os.path.join(store.directory, f"{report_id}.json")
    with open(path, encoding="ascii") as f:
        data = json.load(f)
    del data["requester_kind"]
    data["requested_by"] = "hook:a.service"
    with open(path, "w", encoding="ascii") as f:
        json.dump(data, f)
    (old,) = store.load()
    assert old.request.requester_kind is RequesterKind.HOOK


@pytest.mark.parametrize(("requested_by", "kind"), [
    ("hook:a.service", RequesterKind.HOOK), ("watch:a.service", RequesterKind.WATCH),
    ("slurm:42", RequesterKind.SLURM), ("recovered:a.service", RequesterKind.RECOVERED),
    ("hook:a.service via uid 1000 (alice) :1.4", RequesterKind.HOOK_NONROOT),
    ("uid 1000 (alice) :1.4", RequesterKind.MANUAL), ("hook:", RequesterKind.MANUAL),
])
def test_the_legacy_rule_for_records_older_than_the_kinds(requested_by: str, kind: RequesterKind) -> None:
    assert legacy_requester_kind(requested_by) is kind


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
