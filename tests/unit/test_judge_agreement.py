"""One judge: the five callers of "is this GPU free?" (`check`, `wait --local`, the daemon's
gate, Gpu State, a sweep's verification) give the same answer on the same facts.

A sweep's verification asks about memory only (what it ended must be gone): the cases with a
holder, or a live process NVML lists, are not its question, and it sits those out.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from gpuguardd.cli.check import check
from gpuguardd.cli.wait import local_call
from gpuguardd.config import Config
from gpuguardd.daemon.gate import GateService
from gpuguardd.engine.gate import GateRule
from gpuguardd.engine.gpustate import gpu_summaries
from gpuguardd.engine.sweep import Sweep, SweepSettings, memory_view
from gpuguardd.records.enums import GpuState, HolderKind
from gpuguardd.records.models import GpuInfo, Holder, NvmlSnapshot, ScanResult, Scope

MiB = 1 << 20
GiB = 1 << 30
DEAD = 4_000_000  # above any pid_max: never a process here
LIVE = os.getpid()
CONFIG = Config()


def compute(gpus: list[int], protected: bool = False) -> Holder:
    return Holder(pid=LIVE, comm="python", gpus=gpus, kind=HolderKind.COMPUTE,
                  protected=protected)


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
        service = GateService(lambda: CONFIG, confirm, lambda: None, lambda: [], lambda: 0.0,
                              lambda: None, lambda: 0.0)
        await confirm()
        rule = GateRule(CONFIG.gate_free_below_mib * MiB, CONFIG.gate_tolerance_mib * MiB)
        outcome = await service.wait([0], [], rule, 0.0, 0.05)
        values = service.gpu_values(0)
        return outcome.free, case.available and not values["waiting_on"]
    return asyncio.run(run())


def by_sweep_verify(case: Case) -> bool:
    scan = case.scan()
    settings = SweepSettings(grace_sec=0, kill_timeout_sec=0, verify_timeout_sec=0,
                             released_below_bytes=CONFIG.released_below_mib * MiB, dry_run=False)
    sweep = Sweep(Scope(gpus=(0,)), settings, ([], scan.nvml, [], []),
                  lambda: ([], scan.nvml, [], []), lambda: scan.nvml, "test")
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
