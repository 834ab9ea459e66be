"""Typed records (records/report.py, records/codec.py) and the vocabularies (records/enums.py):
the wire form is exactly the dicts gpuguard has always sent and stored, and whatever a
history or a daemon hands back is read without loss and without an error.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from gpuguardd.bus import marshal
from gpuguardd.cli import output
from gpuguardd.daemon.history import History
from gpuguardd.records.enums import (
    GpusFrom,
    GpuState,
    HolderKind,
    LeakKind,
    Outcome,
    RequesterKind,
    SpareReason,
    SurvivorReason,
    WarningCode,
)
from gpuguardd.records.models import GpuSummary, Holder, MigSummary, Scope
from gpuguardd.records.report import GpuResult, Leak, Report, ReportScope, Spared, Survivor, Target, Terminated
from tests.unit.helpers import HOLDER

# Records no version wrote, as a hand-edited history may hold them (tests/bus/adversarial/
# test_history_shapes.py serves and prints these through the daemon).
ODD: list[Any] = [
    {"id": "a" * 32},
    {"id": "b" * 32, "outcome": "freed", "scope": "GPU 0", "terminated": [7, None, "x"],
     "gpus": [{"index": 0, "memory_used_before": "lots"}], "leaks": [{}], "warnings": "one",
     "omitted_after": 3, "from_a_newer_version": {"x": [1]}},
    {"id": "c" * 32, "dry_run": True, "targets": {"pid": 1}, "scope": {"gpus": 3, "unit": 5},
     "survived": [{"pid": "x"}], "spared": "all", "duration_ms": None, "outcome": "partial"},
    {"id": "d" * 32, "requested_by": ["a", "b"], "gpus": [{"memory_used_after": True}],
     "terminated": [{"pid": 9, "comm": ["x"], "exited_after_ms": {"a": 1}}]},
]


def coded_report() -> Report:
    report = Report(id="e" * 32, outcome=Outcome.UNVERIFIED, requested_by="hook:x.service",
                    requester_kind=RequesterKind.HOOK,
                    spared=[Spared.of(HOLDER, SpareReason.ANCESTOR, "an ancestor of the sweeping process")],
                    survived=[Survivor.of(HOLDER, SurvivorReason.ZOMBIE, "zombie: parent 1 has not reaped it")])
    report.warnings.append("resolving: an uncoded warning")
    report.warn("NVML unavailable: GPU memory cannot be verified", WarningCode.NVML_UNAVAILABLE)
    report.warnings.append("GPU 0: memory not read: the GPU is runtime-suspended")
    report.code_warnings(WarningCode.MEMORY_UNVERIFIED)
    report.warnings.append("a warning added after the codes")
    return report


def test_entries_have_the_released_keys_in_the_released_order() -> None:
    assert list(Target.of(HOLDER).to_dict().items()) == [
        ("pid", 42), ("comm", "python3"), ("unit", "vllm.service"), ("container", ""),
        ("kind", "compute"), ("gpus", [0, 1]), ("gpu_memory", 7), ("exe", "/usr/bin/python3")]
    mig = Holder(pid=43, mig=["MIG-1234abcd-0000"], kind=HolderKind.COMPUTE)
    assert Target.of(mig).to_dict()["mig"] == ["MIG-1234abcd-0000"]
    # The code is additive: after the released keys.
    assert list(Survivor.of(HOLDER, SurvivorReason.UNINTERRUPTIBLE, "stuck").to_dict().items()) == [
        ("pid", 42), ("comm", "python3"), ("unit", "vllm.service"), ("state", "D"), ("why", "stuck"),
        ("code", "uninterruptible")]
    assert Survivor.of(HOLDER, SurvivorReason.EXITED, "gone", state="").to_dict()["state"] == ""
    # The code is additive: after the released keys.
    assert list(Spared.of(HOLDER, SpareReason.PROTECTED_UNIT, "protected").to_dict().items()) == [
        ("pid", 42), ("comm", "python3"), ("unit", "vllm.service"), ("why", "protected"),
        ("code", "protected-unit")]
    ended = Terminated(pid=42, comm="x", unit="", signal="SIGTERM", exited_after_ms=3)
    assert list(ended.to_dict()) == ["pid", "comm", "unit", "signal", "exited_after_ms"]
    # Optional keys appear only when they say something; a zombie's parent may be 0.
    ended.exit_status, ended.zombie_parent = "killed by SIGTERM", 0
    assert list(ended.to_dict())[-2:] == ["exit_status", "zombie_parent"]
    assert ended.to_dict()["zombie_parent"] == 0
    assert list(GpuResult(index=0, mig_uuid="MIG-x").to_dict()) == [
        "index", "uuid", "memory_used_before", "memory_total", "mig_uuid", "memory_used_after",
        "released"]
    assert "mig_uuid" not in GpuResult(index=0).to_dict()
    assert Leak(gpu=1, uuid="GPU-u", bytes=5).to_dict() == {"gpu": 1, "uuid": "GPU-u", "bytes": 5}


def test_scope_and_report_keys() -> None:
    scope = ReportScope.of(Scope(gpus=(0,), unit="a.service"), grace_ms=2000)
    assert scope.to_dict() == {"gpus": [0], "unit": "a.service", "container": "",
                               "include_management": False, "grace_ms": 2000}
    slurm = ReportScope.of(Scope(gpus=(1,), slurm_job="42", slurm_uid=1000,
                                 adopted=((7, 99),), mig=("MIG-a",)), grace_ms=0)
    assert list(slurm.to_dict().items())[4:] == [
        ("mig", ["MIG-a"]), ("adopted_pids", [7]), ("slurm_job", "42"), ("slurm_uid", 1000),
        ("grace_ms", 0)]
    report = Report(id="r", outcome=Outcome.FREED, scope=scope)
    assert list(report.to_dict()) == [
        "id", "started_usec", "duration_ms", "requested_by", "reason", "scope", "dry_run",
        "outcome", "verified", "targets", "terminated", "survived", "spared", "gpus", "leaks",
        "warnings", "error", "requester_kind"]
    assert report.to_dict()["outcome"] == "freed" and type(report.to_dict()["outcome"]) is str


def test_a_report_goes_over_the_bus_and_back_unchanged() -> None:
    report = Report(id="a" * 32, started_usec=1, requested_by="hook:x.service", dry_run=False,
                    scope=ReportScope.of(Scope(gpus=(0,)), grace_ms=10), outcome=Outcome.SURVIVORS,
                    targets=[Target.of(HOLDER)],
                    survived=[Survivor.of(HOLDER, SurvivorReason.UNINTERRUPTIBLE, "D state")],
                    terminated=[Terminated(pid=9, signal="SIGKILL", zombie_parent=1)],
                    gpus=[GpuResult(index=0, memory_used_before=5)], leaks=[Leak(gpu=0)],
                    warnings=["w"])
    typed = marshal.report(report.to_dict())
    assert typed["outcome"].signature == "s" and typed["outcome"].value == "survivors"
    back = Report.from_dict(marshal.unwrap(typed))
    assert back == report and back.to_dict() == report.to_dict() and not back.unread
    assert json.loads(json.dumps(report.to_dict())) == report.to_dict()


@pytest.mark.parametrize("record", ODD)
def test_any_shape_is_read_and_given_back_as_it_came(record: dict[str, Any]) -> None:
    report = Report.from_dict(record)
    assert report.to_dict() == record
    # Nothing unreadable passes for a result: without an outcome it is an error, never freed.
    if record.get("outcome") != "freed":
        assert report.outcome == Outcome.ERROR and "outcome" in report.unread


def test_what_cannot_be_read_is_shown_as_unknown() -> None:
    odd = Report.from_dict(ODD[1])
    assert odd.outcome == Outcome.FREED and "scope" not in odd.unread
    assert odd.gpus[0].memory_used_before == 0 and "memory_used_before" in odd.gpus[0].unread
    assert [t.unread >= {"pid", "comm"} for t in odd.terminated] == [True, True, True]
    assert odd.warnings == ["one"] and "warnings" in odd.unread  # still shown
    assert list(odd.to_dict())[-2:] == ["omitted_after", "from_a_newer_version"]  # kept, last
    out = io.StringIO()
    output.print_report(odd, out)
    text = out.getvalue()
    assert "GPU 0: ? used before" in text and "warning: one" in text
    assert "Outcome: freed in ? ms" in text
    out = io.StringIO()
    output.print_report(Report.from_dict(ODD[2]), out)
    assert "Outcome: ? in ? ms" in out.getvalue()


def test_enums_are_their_values_everywhere() -> None:
    for member in [*Outcome, *GpuState, *HolderKind, *GpusFrom]:
        assert member == member.value and hash(member) == hash(member.value)
        assert str(member) == f"{member}" == f"{member:s}" == member.value
        assert json.dumps(member) == json.dumps(member.value)
    assert {o.value for o in Outcome} == {"freed", "nothing-to-do", "survivors",
                                          "memory-not-released", "dry-run", "error", "unverified",
                                          "interrupted", "reset", "reset-refused", "reset-failed"}
    assert {k.value for k in LeakKind} == {"no-process", "dead-pids", "stuck-in-driver"}
    assert {s.value for s in GpuState} == {"idle", "in-use", "leaked", "lost", "unknown",
                                            "suspended"}
    holder = Holder(pid=1, kind=HolderKind.COMPUTE, gpus_from=GpusFrom.NODES).to_dict()
    assert type(holder["kind"]) is str and holder["kind"] == "compute"
    assert type(holder["gpus_from"]) is str and holder["gpus_from"] == "nodes"
    assert Holder(pid=1).to_dict()["gpus_from"] == ""


def test_a_holder_keeps_its_released_keys_and_comes_back_from_the_bus() -> None:
    holder = Holder(pid=7, comm="vllm", uid=1000, user="alice", gpus=[1], nvml_gpus=[1],
                    node_gpus=[0, 1], gpus_from=GpusFrom.NVML, kind=HolderKind.COMPUTE,
                    how=["fd", "nvml"], mig=["MIG-a"], start_time=123, roles=["uvm"])
    wire = holder.to_dict()
    assert list(wire) == [
        "pid", "comm", "exe", "cmdline", "uid", "user", "unit", "cgroup", "container",
        "devices", "how", "gpus", "nvml_gpus", "node_gpus", "gpus_from", "mig", "gpu_memory",
        "state", "kind", "protected", "protected_why", "ppid"]  # start_time, roles stay here
    back = Holder.from_dict(marshal.unwrap(marshal.holder(wire)))
    assert back.to_dict() == wire and not back.unread
    assert (back.kind, back.gpus_from, back.start_time) == (HolderKind.COMPUTE, GpusFrom.NVML, 0)
    # The last holder of a cut reply says how many more there were; --json keeps it.
    cut = Holder.from_dict({**wire, "omitted_after": 5})
    assert cut.to_dict() == {**wire, "omitted_after": 5}
    out = io.StringIO()
    output.print_holders([back, cut], out)
    assert "(5 more holders not shown" in out.getvalue()


def test_gpu_summaries_keep_their_keys_and_unknown_states_never_pass_for_idle() -> None:
    mig = MigSummary(uuid="MIG-a", gpu_instance_id=1, compute_instance_id=0, holder_count=2,
                     state=GpuState.LEAKED)
    gpu = GpuSummary(index=0, uuid="GPU-a", minor=0, state=GpuState.IN_USE, mig_mode=True,
                     mig_instances=[mig])
    wire = gpu.to_dict()
    assert list(wire) == ["index", "uuid", "name", "pci_bus_id", "minor", "device_path",
                          "memory_total", "memory_used", "holder_count", "state", "error",
                          "mig_mode", "mig_instances", "vendor"]
    # The vendor is always said (NVIDIA's by default): the Gpu objects' Vendor comes from it.
    assert wire["vendor"] == "nvidia"
    assert wire["state"] == "in-use" and wire["mig_instances"][0]["state"] == "leaked"
    assert list(wire["mig_instances"][0]) == [
        "uuid", "gpu_instance_id", "compute_instance_id", "device_path", "memory_total",
        "memory_used", "holder_count", "state"]
    # A GPU of the device nodes alone (no NVML): nothing said of MIG, as before.
    assert "mig_mode" not in GpuSummary(index=1).to_dict()
    assert GpuSummary(index=1, mig_mode=False, mig_instances=[]).to_dict()["mig_instances"] == []
    assert GpuSummary.from_dict(wire) == gpu and GpuSummary.from_dict(wire).to_dict() == wire
    newer = GpuSummary.from_dict({**wire, "state": "degraded"})
    assert newer.state == GpuState.UNKNOWN and newer.to_dict()["state"] == "degraded"


def test_every_shape_read_back_gives_its_wire_form_back() -> None:
    """A dict of this version's shape, one trimmed as replysize trims, and every odd shape:
    read back and written out again, each is what came, key for key."""
    built = Report(id="e" * 32, outcome=Outcome.SURVIVORS, dry_run=True,
                   scope=ReportScope.of(Scope(gpus=(0,), slurm_job="9", slurm_uid=5), grace_ms=1),
                   targets=[Target.of(HOLDER)], survived=[Survivor.of(HOLDER, SurvivorReason.UNINTERRUPTIBLE, "D")],
                   terminated=[Terminated(pid=1, zombie_parent=0), Terminated(pid=2)],
                   gpus=[GpuResult(index=0, mig_uuid="MIG-a")], leaks=[Leak(gpu=0)])
    trimmed = built.to_dict()
    del trimmed["targets"][0]["unit"], trimmed["scope"]["grace_ms"]  # as replysize trims
    holder = HOLDER.to_dict()
    summary = GpuSummary(index=0, state=GpuState.IDLE, mig_mode=True,
                         mig_instances=[MigSummary(uuid="MIG-a")]).to_dict()
    samples: list[tuple[Any, Any]] = [
        (Report, built.to_dict()), (Report, trimmed), *((Report, odd) for odd in ODD),
        (Report, {**built.to_dict(), "outcome": "partial"}), (Report, {"id": "x", "verified": 1}),
        (Holder, holder), (Holder, {**holder, "uid": -1}), (Holder, {**holder, "kind": "x"}),
        (Holder, {**holder, "omitted_after": 2}), (GpuSummary, summary),
        (GpuSummary, {**summary, "mig_mode": None, "state": "weird"})]
    for kind, data in samples:
        back = kind.from_dict(data)
        assert back.to_dict() == data, data
    # A record built here, written out and read back, is equal to itself and fully read.
    for record in (built, HOLDER):
        again = type(record).from_dict(record.to_dict())
        assert again == record and not again.unread and again.to_dict() == record.to_dict()


def test_the_codes_travel_with_the_report_over_the_bus_and_through_the_history(tmp_path: Path) -> None:
    report = coded_report()
    wire = report.to_dict()
    assert list(wire)[-2:] == ["requester_kind", "warning_codes"]
    assert wire["requester_kind"] == "hook"
    assert wire["spared"][0]["code"] == "ancestor"
    assert wire["survived"][0]["code"] == "zombie"
    assert wire["warning_codes"] == ["other", "nvml-unavailable", "memory-unverified"]
    typed = marshal.report(wire)
    assert typed["requester_kind"].signature == "s" and typed["warning_codes"].signature == "as"
    assert typed["spared"].value[0]["code"].value == "ancestor"
    assert typed["survived"].value[0]["code"].value == "zombie"
    for back in (Report.from_dict(marshal.unwrap(typed)), Report.from_dict(json.loads(json.dumps(wire)))):
        assert back == report and not back.unread
        assert back.requester_kind is RequesterKind.HOOK
        assert back.spared[0].code is SpareReason.ANCESTOR
        assert back.survived[0].code is SurvivorReason.ZOMBIE
        assert back.warnings_of({WarningCode.NVML_UNAVAILABLE, WarningCode.MEMORY_UNVERIFIED}) == [
            "NVML unavailable: GPU memory cannot be verified",
            "GPU 0: memory not read: the GPU is runtime-suspended"]
    history = History(str(tmp_path), 10)
    history.load()
    history.append(report)
    again = History(str(tmp_path), 10)
    again.load()
    stored = again.last()
    assert stored is not None and stored.requester_kind is RequesterKind.HOOK
    assert stored.spared[0].code is SpareReason.ANCESTOR and stored.to_dict() == wire
    assert stored.survived[0].code is SurvivorReason.ZOMBIE


def test_records_older_than_the_codes_read_without_them() -> None:
    old = {"id": "a" * 32, "outcome": "freed", "requested_by": "hook:x.service",
           "spared": [{"pid": 1, "comm": "init", "unit": "", "why": "PID 1 (init)"}],
           "survived": [{"pid": 7, "comm": "x", "unit": "", "state": "Z",
                         "why": "zombie: parent 1 has not reaped it"}],
           "warnings": ["NVML unavailable: GPU memory cannot be verified"]}
    report = Report.from_dict(old)
    assert "requester_kind" not in report.unread and "warning_codes" not in report.unread
    assert report.spared[0].code is SpareReason.OTHER and not report.spared[0].unread
    assert report.survived[0].code is SurvivorReason.OTHER and not report.survived[0].unread
    # Nothing is read back from the words.
    assert report.requester_kind is RequesterKind.MANUAL
    assert report.warnings_of({WarningCode.NVML_UNAVAILABLE}) == []
    assert report.to_dict() == old

