"""Watch mode's decisions, without a bus: records, the escaped-leftover rule, one sweep a stop.

The watcher against the real systemd (Subscribe, JobRemoved, PropertiesChanged, units being
unloaded after their stop, Restart=) is covered by tests/e2e/test_e2e.py.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpuguardd.config import Config
from gpuguardd.daemon.runner import SweepRunner, UnitSweeps
from gpuguardd.engine.engine import Engine
from gpuguardd.errors import InvalidArgument
from gpuguardd.records.enums import Outcome, RequesterKind
from gpuguardd.records.models import Holder, NvmlSnapshot, ScanResult, SweepRequest
from gpuguardd.records.report import Report, ReportScope
from gpuguardd.systemd.rules import UnitState
from gpuguardd.systemd.unitwatch import UnitWatch
from tests.unit.helpers import NVML, holder


class FakeSystemd:
    def __init__(self, states: dict[str, UnitState]) -> None:
        self.available = True
        self.states = states
        self.environments: dict[str, list[str]] = {}

    async def state(self, unit: str) -> UnitState | None:
        return self.states.get(unit, UnitState(unit, ""))

    async def environment(self, unit: str) -> list[str]:
        return self.environments.get(unit, [])

    async def dropins(self, unit: str) -> list[str]:
        return []


class Harness:
    """The daemon's UnitSweeps with a fake systemd, a fixed scan, and itself as the runner:
    a sweep that records its requests."""

    def __init__(self, holders: list[Holder], states: dict[str, UnitState]) -> None:
        self.requests: list[SweepRequest] = []
        self.release = asyncio.Event()
        self.engine = SimpleNamespace(config=SimpleNamespace(dry_run=False))
        self.unit_watch = UnitWatch(bus=None, patterns=["sglang-*"])  # type: ignore[arg-type]
        self.unit_watch.systemd = FakeSystemd(states)  # type: ignore[assignment]
        self.watch = UnitSweeps(self, self.unit_watch, self.scan, lambda: NVML)  # type: ignore[arg-type]
        self.holders = holders

    async def scan(self) -> ScanResult:
        return ScanResult(holders=self.holders, nvml=NVML)

    async def run(self, request: SweepRequest, prepared: object = None) -> Report:
        self.requests.append(request)
        await self.release.wait()
        return Report(id=f"r{len(self.requests)}", requested_by=request.requested_by,
                      outcome=Outcome.FREED)


def hook(unit: str) -> SweepRequest:
    return SweepRequest(unit=unit, requested_by=f"hook:{unit}", reason=f"hook:{unit} result=x",
                        requester_kind=RequesterKind.HOOK)


def test_unit_sweep_adopts_only_leftovers_no_running_unit_owns() -> None:
    unit = "sglang-a.service"
    states = {unit: UnitState(unit, "deactivating", invocation_id="i1"),
              "session-3.scope": UnitState("session-3.scope", "active"),
              "old.service": UnitState("old.service", "failed")}
    scan = [holder(10, "", [0]), holder(11, "session-3.scope", [0]),
            holder(12, "old.service", [0]), holder(13, "gone.service", [0])]
    h = Harness(scan, states)
    h.unit_watch.observe([holder(9, unit, [0])])
    h.release.set()
    report = asyncio.run(h.watch.sweep_unit(hook(unit)))
    assert report is not None and report.outcome == "freed"
    # 10: in no unit; 12: its unit failed; 13: systemd does not know its unit; 11: a running
    # session owns it, so it is left alone.
    assert h.requests[0].adopted == [(10, 100), (12, 100), (13, 100)]
    assert h.watch.records.get(unit) is None  # all freed: the next instance starts afresh


def test_nothing_is_adopted_without_systemd() -> None:
    h = Harness([holder(10, "", [0])], {})
    h.watch.systemd.available = False
    h.unit_watch.observe([holder(9, "sglang-a.service", [0])])
    h.release.set()
    asyncio.run(h.watch.sweep_unit(hook("sglang-a.service")))
    assert h.requests[0].adopted == []


def test_hook_and_watch_of_one_stop_share_one_sweep() -> None:
    unit = "sglang-a.service"
    h = Harness([], {unit: UnitState(unit, "deactivating", invocation_id="i1")})

    async def scenario() -> list[Any]:
        first = asyncio.ensure_future(h.watch.sweep_unit(hook(unit)))
        await asyncio.sleep(0.01)
        # The watcher fires while the hook's sweep still runs (the unit is now inactive).
        h.watch.systemd.states[unit] = UnitState(unit, "inactive", invocation_id="i1")  # type: ignore[attr-defined]
        second = asyncio.ensure_future(h.watch.sweep_unit(
            SweepRequest(unit=unit, requested_by=f"watch:{unit}",
                         requester_kind=RequesterKind.WATCH)))
        await asyncio.sleep(0.01)
        h.release.set()
        results = list(await asyncio.gather(first, second))
        # Later, the same stop again (a late JobRemoved): the remembered report.
        results.append(await h.watch.sweep_unit(SweepRequest(unit=unit,
                                                             requested_by=f"watch:{unit}",
                         requester_kind=RequesterKind.WATCH)))
        # A new instance that stops is a new sweep.
        h.watch.systemd.states[unit] = UnitState(unit, "inactive", invocation_id="i2")  # type: ignore[attr-defined]
        results.append(await h.watch.sweep_unit(hook(unit)))
        return results

    reports = asyncio.run(scenario())
    assert [r.id for r in reports] == ["r1", "r1", "r1", "r2"]
    assert len(h.requests) == 2


def test_manual_sweeps_are_never_deduplicated() -> None:
    unit = "sglang-a.service"
    h = Harness([], {unit: UnitState(unit, "inactive", invocation_id="i1")})
    h.release.set()

    async def twice() -> None:
        for _ in range(2):
            await h.watch.sweep_unit(SweepRequest(unit=unit, requested_by="uid 0 (root) :1.5"))
    asyncio.run(twice())
    assert len(h.requests) == 2


def test_watch_does_not_sweep_a_unit_that_runs_again() -> None:
    unit = "sglang-a.service"
    h = Harness([], {unit: UnitState(unit, "activating", invocation_id="i2")})
    h.release.set()
    result = asyncio.run(h.watch.sweep_unit(SweepRequest(unit=unit, requested_by=f"watch:{unit}",
                         requester_kind=RequesterKind.WATCH)))
    assert result is None and h.requests == []
    # The drop-in's hook still sweeps: it runs in ExecStopPost, before the restart.
    assert asyncio.run(h.watch.sweep_unit(hook(unit))) is not None



class CountingNvml:
    """NVML as a list of its full GPU readings (with_processes of each): nothing else asked."""

    def __init__(self) -> None:
        self.reads: list[bool] = []

    def snapshot(self, with_processes: bool = True) -> NvmlSnapshot:
        self.reads.append(with_processes)
        return copy.deepcopy(NVML)


class SweepCounter:
    """SweepEvents; `reads_at_start`: the GPU readings made when the sweep began."""

    def __init__(self, nvml: CountingNvml) -> None:
        self.nvml = nvml
        self.reads_at_start = -1

    def sweep_started(self, report_id: str, scope: ReportScope) -> None:
        self.reads_at_start = len(self.nvml.reads)

    def process_terminated(self, report_id: str, pid: int, comm: str, unit: str,
                           signal_name: str) -> None:
        pass

    def sweep_finished(self, report: Report) -> None:
        pass

    def busy_changed(self, busy: bool) -> None:
        pass


def test_a_sweep_reads_the_gpus_and_resolves_its_scope_once(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The request's check and the sweep share one GPU reading and one scope resolution
    (Service.sweep's order: validate, then run), and a bad request is refused by the check."""
    nvml = CountingNvml()
    engine = Engine(Config(runtime_directory=str(tmp_path / "run"), sysfs_path=str(tmp_path / "sys"),
                           device_paths=(str(tmp_path / "dev" / "nvidia*"),)),
                    nvml=nvml, use_pidfd=False)  # type: ignore[arg-type]
    resolved: list[SweepRequest] = []
    resolve = engine.resolve_request

    def counted(request: SweepRequest, snap: NvmlSnapshot | None = None) -> Any:
        resolved.append(request)
        return resolve(request, snap)
    monkeypatch.setattr(engine, "resolve_request", counted)
    events = SweepCounter(nvml)

    async def sweep(request: SweepRequest) -> Report:
        with ThreadPoolExecutor(1) as sweeps, ThreadPoolExecutor(1) as io:
            runner = SweepRunner(engine, sweeps, io, None, events)  # type: ignore[arg-type]
            prepared: Any = await runner.validate(request)
            return await (runner.run(request, prepared) if prepared is not None
                          else runner.run(request))

    request = SweepRequest(gpus=[NVML.gpus[1].uuid], unit="sglang-a.service", dry_run=True,
                           requested_by="test", audited=False)
    report = asyncio.run(sweep(request))
    assert report.outcome == Outcome.DRY_RUN and report.scope.gpus == [1]
    assert events.reads_at_start == 1 and nvml.reads[0], nvml.reads  # the scan needs the lists
    assert len(resolved) == 1

    with pytest.raises(InvalidArgument, match="unknown GPU UUID"):
        asyncio.run(sweep(SweepRequest(gpus=["GPU-ffff0000-0000-4000-8000-000000000009"],
                                       dry_run=True, audited=False)))
