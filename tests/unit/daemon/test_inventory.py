"""Unit tests of gpuguardd/daemon/inventory.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from gpuguardd.daemon import inventory as inv
from gpuguardd.records.models import Holder, NvmlSnapshot, ScanResult


class FakeEngine:
    """Counts scans; each lists the holders present when it ran."""

    def __init__(self) -> None:
        self.config = type("Config", (), {"released_below_mib": 0})()
        self.pids: list[int] = []
        self.scans = 0

    def scan(self) -> ScanResult:
        self.scans += 1
        return ScanResult(holders=[Holder(pid=p) for p in self.pids],
                          nvml=NvmlSnapshot(available=False, error="fake"))


class Listener:
    def inventory_changed(self, snapshot: NvmlSnapshot, summaries: list[dict[str, Any]]) -> None:
        pass

    def leak_suspected(self, index: int, uuid: str, used: int) -> None:
        pass


Scenario = Callable[[inv.Inventory, FakeEngine, list[float]], Awaitable[None]]


def run_on_a_clock(monkeypatch: pytest.MonkeyPatch, scenario: Scenario) -> None:
    """scenario(inventory, its FakeEngine, now): now[0] is the freshness rule's clock."""
    now = [1000.0]
    monkeypatch.setattr(inv, "clock", lambda: now[0])
    engine = FakeEngine()

    async def run() -> None:
        with ThreadPoolExecutor(1) as executor:
            await scenario(inv.Inventory(engine, executor, Listener()),  # type: ignore[arg-type]
                           engine, now)

    asyncio.run(run())


def test_list_holders_reuses_a_fresh_scan_only(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(inventory: inv.Inventory, engine: FakeEngine, now: list[float]) -> None:
        engine.pids = [10]
        assert [h.pid for h in (await inventory.recent()).holders] == [10]
        assert engine.scans == 1
        engine.pids = [10, 11]  # a holder appears after the scan started
        now[0] += inv.LIST_MAX_AGE_SEC * 0.9
        assert [h.pid for h in (await inventory.recent()).holders] == [10]  # served again
        assert engine.scans == 1
        now[0] += inv.LIST_MAX_AGE_SEC * 0.2  # the scan is now too old: a new one
        assert [h.pid for h in (await inventory.recent()).holders] == [10, 11]
        assert engine.scans == 2
        engine.pids = [10, 11, 12]
        inventory.invalidate()  # a sweep, a reload, NVML's lists changed: at once
        assert [h.pid for h in (await inventory.recent()).holders] == [10, 11, 12]
        assert engine.scans == 3
        # scan() (the unit watch, sweeps) never reuses: it starts after the call.
        await inventory.scan()
        assert engine.scans == 4

    run_on_a_clock(monkeypatch, scenario)


def test_list_holders_refreshes_ahead_so_callers_do_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call served a result about to expire starts the next scan in the background; the call
    after the old result's expiry is served the new one without a scan of its own. The rule of
    what may be served is unchanged: the early call still gets the old, fresh result."""
    async def scenario(inventory: inv.Inventory, engine: FakeEngine, now: list[float]) -> None:
        engine.pids = [10]
        await inventory.recent()
        inventory.scan_cost = 0.05  # lead: 4 x 50 ms = 200 ms
        engine.pids = [10, 11]
        now[0] += inv.LIST_MAX_AGE_SEC - 0.3  # outside the lead: nothing started
        assert [h.pid for h in (await inventory.recent()).holders] == [10]
        await asyncio.sleep(0.05)
        assert engine.scans == 1
        now[0] += 0.15  # 150 ms before expiry: served the old result, next scan started
        assert [h.pid for h in (await inventory.recent()).holders] == [10]
        for _ in range(200):  # the background scan (a thread) ends
            if inventory._running is None:
                break
            await asyncio.sleep(0.01)
        assert engine.scans == 2
        now[0] += 0.2  # the first result has expired; the second is fresh
        engine.pids = [10, 11, 12]
        assert [h.pid for h in (await inventory.recent()).holders] == [10, 11]
        assert engine.scans == 2  # served without waiting for a scan
        # A slow scan (a big host) is not run ahead, back to back: callers wait, as before.
        inventory.scan_cost = inv.REFRESH_MAX_SCAN_SEC * 1.5
        now[0] += inv.LIST_MAX_AGE_SEC - 0.25  # within 4 scan durations of the expiry
        assert [h.pid for h in (await inventory.recent()).holders] == [10, 11]
        await asyncio.sleep(0.05)
        assert engine.scans == 2 and inventory._running is None

    run_on_a_clock(monkeypatch, scenario)


def test_a_scan_older_than_an_invalidation_is_never_served(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    engine = FakeEngine()
    plain_scan = engine.scan

    def slow_scan() -> ScanResult:
        release.wait(10)
        return plain_scan()

    monkeypatch.setattr(engine, "scan", slow_scan)

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as executor:
            inventory = inv.Inventory(engine, executor, Listener())  # type: ignore[arg-type]
            first = asyncio.ensure_future(inventory.scan())
            await asyncio.sleep(0)
            inventory.invalidate()  # while the first scan runs: it may have missed the change
            second = asyncio.ensure_future(inventory.recent())
            await asyncio.sleep(0.05)
            release.set()
            await first
            await second
            assert engine.scans == 2  # recent() waited for a scan started after the event
            assert inventory.last_result is second.result()

    asyncio.run(scenario())


def test_a_scan_queued_when_the_daemon_stops_is_cancelled_not_a_traceback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gpuguardd shuts its executors down while a scan may still run; the scan queued behind it
    cannot start then, and its waiters are cancelled instead of the loop logging a traceback."""
    engine = FakeEngine()
    release = threading.Event()
    plain_scan = engine.scan

    def slow_scan() -> ScanResult:
        release.wait(10)
        return plain_scan()

    monkeypatch.setattr(engine, "scan", slow_scan)
    errors: list[dict[str, Any]] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        executor = ThreadPoolExecutor(1)
        inventory = inv.Inventory(engine, executor, Listener())  # type: ignore[arg-type]
        first = asyncio.ensure_future(inventory.scan())
        await asyncio.sleep(0)
        queued = asyncio.ensure_future(inventory.scan())  # behind the running one
        await asyncio.sleep(0)
        executor.shutdown(wait=False)
        release.set()
        await first
        with pytest.raises(asyncio.CancelledError):
            await queued

    asyncio.run(scenario())
    assert errors == []



def test_republish_tells_the_last_reading_again_without_reading() -> None:
    """A sweep beginning or ending (Busy) is judged on the last reading: no GPU read."""
    seen: list[NvmlSnapshot] = []

    class Told(Listener):
        def inventory_changed(self, snapshot: NvmlSnapshot, summaries: list[dict[str, Any]]) -> None:
            seen.append(snapshot)

    engine = FakeEngine()
    inventory = inv.Inventory(engine, None, Told())  # type: ignore[arg-type]
    inventory.republish()  # FakeEngine has no snapshot(): a read would raise
    assert seen == [inventory.snapshot] and engine.scans == 0
