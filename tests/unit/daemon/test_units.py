"""Unit sweeps and watch mode without a bus (daemon/units.py): records, the escaped-leftover
rule, one sweep a stop.

The watcher against the real systemd (Subscribe, JobRemoved, PropertiesChanged, units being
unloaded after their stop, Restart=) is covered by tests/e2e/test_e2e.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpuguardd.config import Config
from gpuguardd.daemon.runner import SweepRunner
from gpuguardd.daemon.units import UnitSweeps
from gpuguardd.engine import engine as engine_module
from gpuguardd.engine.engine import Engine, Prepared
from gpuguardd.engine.holders import find_holders
from gpuguardd.records.enums import Outcome, RequesterKind
from gpuguardd.records.models import Holder, ScanResult, Scope, SweepRequest
from gpuguardd.records.report import Report
from gpuguardd.systemd.rules import UnitState
from tests.unit.helpers import NVML, CountingNvml, SweepCounter, holder


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
        self.engine = SimpleNamespace(config=SimpleNamespace(dry_run=False), prepare=self.prepare, pin=self.pin)
        inventory = SimpleNamespace(fresh_scan=self.scan, snapshot=NVML)
        self.watch = UnitSweeps(self, inventory, None, ["sglang-*"], "")  # type: ignore[arg-type]
        self.watch.systemd = FakeSystemd(states)
        self.holders = holders

    async def scan(self) -> ScanResult:
        return ScanResult(holders=self.holders, nvml=NVML)

    def prepare(self, request: SweepRequest) -> Prepared:
        return Prepared(0, NVML, Scope(unit=request.unit), [])

    def pin(self, prepared: Prepared) -> ScanResult:
        return ScanResult(holders=self.holders, nvml=NVML)

    async def io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

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
    h.watch.observe([holder(9, unit, [0])])
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
    h.watch.observe([holder(9, "sglang-a.service", [0])])
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


def test_unit_records_that_cannot_be_kept_are_said_once_not_every_poll(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The records are written at each inventory change (every poll); a runtime directory that
    is gone must cost one warning, not one every 2 s, and a change of the records tries again."""
    watch = UnitSweeps(None, None, None, ["sglang-*"], str(tmp_path / "gone" / "units.json"))  # type: ignore[arg-type]
    held = [holder(10, "sglang-a.service", [0])]
    with caplog.at_level("WARNING"):
        for _ in range(5):
            watch.observe(held)
        assert len([r for r in caplog.records if "cannot keep" in r.message]) == 1
        (tmp_path / "gone").mkdir()
        watch.observe([*held, holder(11, "sglang-a.service", [1])])
    assert (tmp_path / "gone" / "units.json").exists()


def test_a_unit_sweep_walks_proc_once_for_its_leftovers_and_itself(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit's escaped leftovers are looked for in the sweep's own first scan: one GPU
    reading and one /proc walk from the stop to the first signal, not a scan for the leftovers
    and another for the sweep."""
    nvml = CountingNvml()
    engine = Engine(Config(runtime_directory=str(tmp_path / "run"), sysfs_path=str(tmp_path / "sys"),
                           device_paths=(str(tmp_path / "dev" / "nvidia*"),)),
                    nvml=nvml, use_pidfd=False)  # type: ignore[arg-type]
    walks: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        walks.append(len(nvml.reads))
        return find_holders(*args, **kwargs)
    monkeypatch.setattr(engine_module, "find_holders", counted)
    events = SweepCounter(nvml)

    async def no_second_scan() -> ScanResult:
        raise AssertionError("the leftovers were looked for in a scan of their own")

    async def sweep(request: SweepRequest) -> Report | None:
        with ThreadPoolExecutor(1) as sweeps, ThreadPoolExecutor(1) as io:
            runner = SweepRunner(engine, sweeps, io, None, events, None)  # type: ignore[arg-type]
            units = UnitSweeps(runner, SimpleNamespace(fresh_scan=no_second_scan), None,  # type: ignore[arg-type]
                               ["sglang-*"], "")
            units.systemd = FakeSystemd({})
            return await units.sweep_unit(request)

    unit = "sglang-a.service"
    report = asyncio.run(sweep(SweepRequest(unit=unit, requested_by=f"hook:{unit}", requester_kind=RequesterKind.HOOK,
                                            dry_run=True, audited=False)))
    assert report is not None and report.outcome == Outcome.DRY_RUN
    assert events.reads_at_start == 1 and walks == [1], (nvml.reads, walks)
