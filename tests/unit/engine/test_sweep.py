"""Facts travel as codes, decided where they are known, never read back from the words:
spared reasons (protection.py, the sweep's plan), survivors' reasons (the sweep, where each
is recorded), requester kinds (the service, the unit watch, resume, the in-flight records)
and the warnings the Slurm epilog acts on."""

from __future__ import annotations

from typing import Any

from gpuguardd.config import Config
from gpuguardd.engine.sweep import MAX_ROUNDS, Sweep
from gpuguardd.records.enums import HolderKind, RequesterKind, SpareReason, SurvivorReason, WarningCode
from gpuguardd.records.models import Holder, NvmlSnapshot, Scope, SweepRequest
from gpuguardd.records.report import Report


class Handle:
    def close(self) -> None:
        pass


def plan(holders: list[Holder], scope: Scope) -> Report:
    config = Config(grace_sec=1, kill_timeout_sec=1, verify_timeout_sec=1, released_below_mib=0, dry_run=True)
    nvml = NvmlSnapshot(available=False)
    pinned: Any = [(h, Handle()) for h in holders]
    sweep = Sweep(scope, config, (pinned, nvml, [], []), lambda: ([], nvml, [], []), lambda: nvml,
                  SweepRequest(requested_by="x", requester_kind=RequesterKind.WATCH))
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



def test_every_survivor_carries_the_code_of_why() -> None:
    """Zombies are survivors without a signal sent (only their parent can release them); a
    new one every round is what keeps appearing: after MAX_ROUNDS the last ones survive as
    that. Each is coded where it is recorded, its words unchanged."""
    config = Config(grace_sec=0.01, kill_timeout_sec=0.01, verify_timeout_sec=0.01, released_below_mib=0)
    nvml = NvmlSnapshot(available=False)
    rounds = iter(range(1, 100))

    def zombie(start: int) -> Holder:
        return Holder(pid=200, exe="/x", kind=HolderKind.COMPUTE, how=["fd"], gpus=[0],
                      node_gpus=[0], state="Z", ppid=7, start_time=start)

    def rescan() -> Any:
        return [(zombie(next(rounds) + 1), Handle())], nvml, [], []

    pinned: Any = [(zombie(1), Handle())]
    report = Sweep(Scope(gpus=(0,)), config, (pinned, nvml, [], []), rescan, lambda: nvml,
                   SweepRequest(requested_by="x")).run()
    codes = [s.code for s in report.survived]
    assert codes == [SurvivorReason.ZOMBIE] * MAX_ROUNDS + [SurvivorReason.REAPPEARED]
    assert report.survived[0].why == "zombie: parent 7 has not reaped it"
    assert report.survived[-1].why.startswith(f"appeared again after {MAX_ROUNDS} rounds")
    assert [s["code"] for s in report.to_dict()["survived"]][-1] == "reappeared"
