"""Unit tests of gpuguardd/systemd/client.py."""

from __future__ import annotations

import asyncio

import pytest

from gpuguardd.systemd.client import UnitWatcher
from gpuguardd.systemd.rules import UnitState


class SlowSystemd:
    """systemd whose answer takes a while: the state is the one at the time of asking."""

    def __init__(self, state: UnitState) -> None:
        self.available = True
        self.now = state
        self.answer = asyncio.Event()
        self.asked: list[str] = []

    async def state(self, unit: str) -> UnitState:
        seen = self.now
        self.asked.append(seen.active_state)
        await self.answer.wait()
        return seen


def running_watcher(systemd: SlowSystemd, unit: str) -> UnitWatcher:
    """A watcher of docker-*.scope that has seen `unit` active."""
    watcher = UnitWatcher(None, systemd, ["docker-*.scope"])  # type: ignore[arg-type]
    watcher._last[unit] = "active"
    return watcher


def stops(watcher: UnitWatcher) -> list[UnitState]:
    """The stops the watcher reported."""
    found = []
    while not watcher.events.empty():
        event = watcher.events.get_nowait()
        if event.stopped:
            found.append(event.state)
    return found


def test_watcher_looks_again_at_a_stop_signalled_while_it_read_the_state() -> None:
    """A transient scope's stop: PropertiesChanged (deactivating) starts a look; the stop's
    JobRemoved arrives while that look still waits for systemd's answer ("deactivating"), and
    the scope is unloaded, so no signal comes again. The stop must still be swept."""
    unit = "docker-0123.scope"
    systemd = SlowSystemd(UnitState(unit, "deactivating", invocation_id="i1"))
    watcher = running_watcher(systemd, unit)

    async def scenario() -> None:
        watcher._consider(unit, job_done=False)  # PropertiesChanged: deactivating
        while not systemd.asked:
            await asyncio.sleep(0)
        systemd.now = UnitState(unit, "", invocation_id="i1")  # stopped, then unloaded
        watcher._consider(unit, job_done=True)  # the stop's JobRemoved, mid-look
        systemd.answer.set()
        for _ in range(100):
            await asyncio.sleep(0)

    asyncio.run(scenario())
    assert systemd.asked == ["deactivating", ""]
    assert [s.unit for s in stops(watcher)] == [unit]


def test_watcher_reads_a_burst_of_signals_once() -> None:
    """Signals that arrive before the look reads the state are that look's: no second look."""
    unit = "docker-0123.scope"
    systemd = SlowSystemd(UnitState(unit, "inactive", invocation_id="i1"))
    systemd.answer.set()
    watcher = running_watcher(systemd, unit)

    async def scenario() -> None:
        for job_done in (False, False, True):
            watcher._consider(unit, job_done=job_done)
        for _ in range(100):
            await asyncio.sleep(0)

    asyncio.run(scenario())
    assert systemd.asked == ["inactive"]
    assert [s.unit for s in stops(watcher)] == [unit]



@pytest.mark.parametrize(("previous", "now", "started"), [
    ("", "active", True), ("activating", "active", True), ("inactive", "active", True),
    ("active", "active", False), ("active", "reloading", False), ("", "activating", False),
])
def test_watcher_reports_a_service_that_became_active(previous: str, now: str, started: bool) -> None:
    unit = "other.service"  # not watched: only its start is reported
    systemd = SlowSystemd(UnitState(unit, now, invocation_id="i1"))
    systemd.answer.set()
    watcher = UnitWatcher(None, systemd, ["docker-*.scope"])  # type: ignore[arg-type]
    if previous:
        watcher._last[unit] = previous
    asyncio.run(watcher._look(unit))
    reported = []
    while not watcher.events.empty():
        reported.append(watcher.events.get_nowait())
    assert [(e.state.unit, e.stopped) for e in reported] == ([(unit, False)] if started else [])
