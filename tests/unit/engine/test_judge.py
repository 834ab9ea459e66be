"""The one judge (gpuguardd/engine/judge.py): a verdict and its reasons from what is known of a
GPU or MIG instance and its holders."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from gpuguardd.cli.check import check
from gpuguardd.cli.wait import local_call
from gpuguardd.config import Config
from gpuguardd.daemon.gate import GateService
from gpuguardd.engine.gate import GateRule
from gpuguardd.engine.gpustate import gpu_summaries
from gpuguardd.engine.judge import Facts, facts_of, facts_of_record, judge, may_be_on
from gpuguardd.engine.sweep import Sweep, memory_view
from gpuguardd.records.enums import GpuState, HolderKind, LeakKind, Why
from gpuguardd.records.models import (
    GpuInfo,
    GpuSummary,
    Holder,
    MigInstance,
    NvmlSnapshot,
    ScanResult,
    Scope,
    SweepRequest,
)
from tests.unit.helpers import DEAD, LIVE

MiB = 1 << 20
GiB = 1 << 30
LINE = 256 * MiB
MIG_A = "MIG-aaaaaaaa-0000-4000-8000-000000000001"
MIG_B = "MIG-bbbbbbbb-0000-4000-8000-000000000002"


def compute(gpus: list[int], mig: list[str] | None = None, protected: bool = False) -> Holder:
    return Holder(pid=LIVE, comm="python", gpus=gpus, kind=HolderKind.COMPUTE, mig=mig or [],
                  protected=protected)


def whys(facts: Facts, free_below: int | None = None) -> list[Why]:
    return [r.why for r in judge(facts, free_below).reasons]


def test_free_is_nothing_held_nothing_listed_and_memory_at_or_below_the_line() -> None:
    verdict = judge(Facts(used=LINE, released_below=LINE))
    assert (verdict.state, verdict.reasons, verdict.released, not verdict.blocking()) == \
        (GpuState.IDLE, (), True, True)
    above = judge(Facts(used=LINE + 1, released_below=LINE))
    assert (above.state, above.leak, whys(Facts(used=LINE + 1, released_below=LINE))) == \
        (GpuState.LEAKED, LeakKind.NO_PROCESS, [Why.LEAKED])


def test_a_compute_holder_that_may_be_on_it_is_in_use_protected_or_not() -> None:
    for holder in (compute([0]), compute([0], protected=True), compute([])):
        verdict = judge(Facts(used=3 * GiB, released_below=LINE, holders=(holder,)))
        assert verdict.state == GpuState.IN_USE and verdict.leak is None and verdict.blocking()
        assert Why.HOLDER in [r.why for r in verdict.reasons]


def test_may_be_on_counts_unknown_gpus_and_instances_never_management() -> None:
    assert may_be_on(compute([]), 3) and may_be_on(compute([0]), None)
    assert may_be_on(compute([0], protected=True), 0)
    assert not may_be_on(compute([1]), 0)
    assert may_be_on(compute([0]), 0, MIG_A)  # instance not told: any of them
    assert may_be_on(compute([0], [MIG_A.upper()]), 0, MIG_A)
    assert not may_be_on(compute([0], [MIG_B]), 0, MIG_A)
    assert not may_be_on(Holder(pid=1, gpus=[0], kind=HolderKind.MANAGEMENT), 0)


def test_leak_kinds_from_what_nvml_lists() -> None:
    gpu = GpuInfo(index=0, memory_total=80 * GiB, memory_used=3 * GiB, processes={DEAD: None})
    assert judge(facts_of(gpu, None, (), LINE, True)).leak == LeakKind.DEAD_PIDS
    # From another PID namespace a missing pid may be alive: in use, never dead-pids.
    foreign = judge(facts_of(gpu, None, (), LINE, False))
    assert (foreign.state, foreign.leak, foreign.has(Why.FOREIGN)) == (GpuState.IN_USE, None, True)
    gpu.processes = {LIVE: 3 * GiB}
    live = judge(facts_of(gpu, None, (), LINE, True))
    # Live memory is another's, not leaked: in use, yet released for a sweep.
    assert (live.state, live.leak, live.released, live.has(Why.PROCESSES)) == \
        (GpuState.IN_USE, None, True, True)
    stuck = judge(facts_of(gpu, None, (), LINE, True, ending={LIVE}, stuck={LIVE}))
    assert (stuck.released, stuck.leak, stuck.has(Why.ENDING)) == (False, LeakKind.STUCK, True)


def test_figures_not_read_are_never_free_unless_allowed() -> None:
    for facts, state in ((Facts(backend_error="no driver"), GpuState.UNKNOWN),
                         (Facts(unreadable=True), GpuState.UNKNOWN),
                         (Facts(listed=False), GpuState.UNKNOWN),
                         (Facts(lost=True), GpuState.LOST)):
        verdict = judge(facts)
        assert (verdict.state, not verdict.blocking(), verdict.released) == (state, False, False)
    assert not judge(Facts(backend_error="x")).blocking(allow_unverified=True)
    assert not judge(Facts(unreadable=True)).blocking(allow_unverified=True)
    assert judge(Facts(lost=True)).blocking(allow_unverified=True)
    # Without NVML a holder still makes it in use (gpus --local: in-use, not unknown).
    assert judge(Facts(backend_error="x", holders=(compute([0]),))).state == GpuState.IN_USE


def test_suspended_is_judged_on_its_last_figures_never_released() -> None:
    verdict = judge(Facts(suspended=True, used=MiB, released_below=LINE))
    assert (verdict.state, not verdict.blocking(), verdict.released, verdict.leak) == \
        (GpuState.SUSPENDED, True, False, None)
    assert judge(Facts(suspended=True, used=GiB, released_below=LINE), LINE).blocking()


def test_the_gates_line_replaces_the_released_line_for_free() -> None:
    facts = Facts(used=300 * MiB, released_below=LINE)
    assert judge(facts).state == GpuState.LEAKED and judge(facts).blocking()
    assert not judge(facts, 512 * MiB).blocking()  # a waiter's higher line lets it pass
    assert whys(Facts(used=LINE, released_below=LINE), LINE) == [Why.MEMORY]  # at or above


def test_a_gpus_own_released_line_overrides_the_configured_one() -> None:
    gpu = GpuInfo(index=0, memory_total=64 * GiB, memory_used=GiB, released_below=2 * GiB)
    assert judge(facts_of(gpu, None, (), LINE, True)).state == GpuState.IDLE
    gpu.released_below = None
    assert judge(facts_of(gpu, None, (), LINE, True)).state == GpuState.LEAKED


def test_a_mig_instance_is_judged_on_its_own_memory_and_tenants() -> None:
    a = MigInstance(uuid=MIG_A, gpu_instance_id=1, compute_instance_id=0, memory_total=GiB,
                    memory_used=MiB)
    gpu = GpuInfo(index=0, memory_total=80 * GiB, memory_used=40 * GiB, mig_mode=True, mig=[a])
    tenant_of_b = compute([0], [MIG_B])
    assert judge(facts_of(gpu, a, [tenant_of_b], LINE, True)).state == GpuState.IDLE
    assert judge(facts_of(gpu, a, [compute([0])], LINE, True)).state == GpuState.IN_USE
    a.error, a.memory_total = "query failed", 0
    assert judge(facts_of(gpu, a, (), LINE, True)).state == GpuState.UNKNOWN


def test_a_published_summary_is_judged_as_the_daemon_judged_it() -> None:
    leaked = GpuSummary(index=0, memory_used=3 * GiB, state=GpuState.LEAKED, leak_kind="dead-pids")
    assert judge(facts_of_record(0, "", leaked, [], None)).state == GpuState.LEAKED
    in_use = GpuSummary(index=0, memory_used=GiB, state=GpuState.IN_USE)
    assert whys(facts_of_record(0, "", in_use, [], None), LINE) == [Why.PROCESSES, Why.MEMORY]
    assert whys(facts_of_record(0, "", None, [], None, sweeping=True)) == \
        [Why.SWEEPING, Why.NOT_LISTED]
    assert whys(facts_of_record(None, "", None, [compute([3])], "gone")) == \
        [Why.HOLDER, Why.NO_BACKEND]


CONFIG = Config()


@dataclass
class Case:
    used: int = 100 * MiB
    processes: dict[int, int | None] = field(default_factory=dict)
    holders: list[Holder] = field(default_factory=list)
    available: bool = True
    lost: bool = False
    unknown: bool = False
    pids_local: bool = True
    memory_only: bool = True  # a sweep's verification's question too

    def scan(self) -> ScanResult:
        gpus = [GpuInfo(index=0, uuid="GPU-0", memory_total=80 * GiB, memory_used=self.used,
                        processes=self.processes, lost=self.lost, unknown=self.unknown,
                        error="hung" if self.unknown else "")]
        snap = NvmlSnapshot(available=self.available, error="" if self.available else "no driver",
                            gpus=gpus if self.available else [], pids_local=self.pids_local)
        return ScanResult(holders=list(self.holders), nvml=snap)


# name: (facts, free?, State where NVML answers)
CASES: dict[str, tuple[Case, bool, GpuState | None]] = {
    "idle": (Case(), True, GpuState.IDLE),
    "leaked, no process": (Case(used=3 * GiB), False, GpuState.LEAKED),
    "leaked, dead pids": (Case(used=3 * GiB, processes={DEAD: 3 * GiB}), False, GpuState.LEAKED),
    "lost": (Case(lost=True), False, GpuState.LOST),
    "unknown": (Case(unknown=True), False, GpuState.UNKNOWN),
    "foreign pids": (Case(used=GiB, processes={DEAD: GiB}, pids_local=False), False,
                     GpuState.IN_USE),
    "no NVML": (Case(available=False), False, None),
    "protected compute holder": (Case(holders=[compute([0], protected=True)], memory_only=False),
                                 False, GpuState.IN_USE),
    "compute holder, GPU not told": (Case(holders=[compute([])], memory_only=False), False,
                                     GpuState.IN_USE),
    "compute holder on another GPU": (Case(holders=[compute([1])], memory_only=False), True,
                                      GpuState.IDLE),
    "live process NVML lists": (Case(used=GiB, processes={LIVE: GiB}, memory_only=False), False,
                                GpuState.IN_USE),
}


def by_state(case: Case) -> GpuState | None:
    found = gpu_summaries(case.scan(), CONFIG.released_below_mib * MiB)
    return found[0].state if found else None


def by_check(case: Case) -> bool:
    scan = case.scan()
    status = {"nvml_available": scan.nvml.available, "nvml_error": scan.nvml.error}
    summaries = gpu_summaries(scan, CONFIG.released_below_mib * MiB)
    return check(status, summaries, scan.holders, ["0"]).ok


def by_wait_local(case: Case) -> bool:
    engine = SimpleNamespace(scan=case.scan, config=CONFIG)
    call = local_call(SimpleNamespace(engine=engine), ["0"], CONFIG.gate_free_below_mib * MiB,
                      0.0, False, CONFIG.gate_tolerance_mib * MiB)
    return bool(call(0.0)["free"])


def by_daemon(case: Case) -> tuple[bool, bool]:
    """(Manager.Wait's answer, WaitingOn empty)."""
    async def run() -> tuple[bool, bool]:
        scan = case.scan()

        async def confirm() -> None:
            service.observe(scan.nvml, gpu_summaries(scan, CONFIG.released_below_mib * MiB),
                            scan.holders)
        inventory = SimpleNamespace(scan=confirm, wake=lambda: None, scan_age=lambda: 0.0, scan_cost=0.0,
                                    request_rescan=lambda: None, engine=SimpleNamespace(config=CONFIG))
        service = GateService(inventory, lambda: [])  # type: ignore[arg-type]
        await confirm()
        rule = GateRule(CONFIG.gate_free_below_mib * MiB, CONFIG.gate_tolerance_mib * MiB)
        outcome = await service.wait([0], [], rule, 0.0, 0.05)
        values = service.gpu_values(0)
        return outcome.free, case.available and not values["waiting_on"]
    return asyncio.run(run())


def by_sweep_verify(case: Case) -> bool:
    scan = case.scan()
    config = Config(grace_sec=0, kill_timeout_sec=0, verify_timeout_sec=0,
                    released_below_mib=CONFIG.released_below_mib)
    sweep = Sweep(Scope(gpus=(0,)), config, ([], scan.nvml, [], []),
                  lambda: ([], scan.nvml, [], []), lambda: scan.nvml, SweepRequest(requested_by="test"))
    sweep._pids_local = scan.nvml.pids_local
    view = memory_view(scan.nvml, 0)
    return view is not None and not sweep._unreadable(view) and sweep._judge(view).released


@pytest.mark.parametrize("name", list(CASES))
def test_the_five_callers_agree(name: str) -> None:
    case, free, state = CASES[name]
    answers = {"check": by_check(case), "wait --local": by_wait_local(case)}
    answers["Wait"], answers["WaitingOn"] = by_daemon(case)
    if case.memory_only:
        answers["sweep verify"] = by_sweep_verify(case)
    assert answers == dict.fromkeys(answers, free), answers
    assert by_state(case) == state
    if state is not None:
        assert (state == GpuState.IDLE) == free  # State agrees with them too


def test_stuck_processes_are_a_kind_of_their_own() -> None:
    def kind(listed: list[int], stuck: list[int]) -> LeakKind | None:
        gpu = GpuInfo(index=0, uuid="GPU-a", memory_total=80 * GiB, memory_used=3 * GiB,
                      processes=dict.fromkeys(listed))
        return judge(facts_of(gpu, None, (), 256 << 20, True, stuck=stuck)).leak
    assert kind([LIVE, DEAD], [LIVE]) == LeakKind.STUCK
    assert kind([DEAD], [LIVE]) == LeakKind.DEAD_PIDS  # LIVE is not listed there

