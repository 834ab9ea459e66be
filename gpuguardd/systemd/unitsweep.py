"""Unit sweeps, one code path for gpuguardd and `gpuguardctl sweep --local`: a unit's escaped
leftovers are swept with it, and one stop gets one sweep. Free of D-Bus: systemd is reached
through `SystemdView` (client.Systemd on a bus connection, or nothing), scans and sweeps
through the callables the caller gives (the daemon's inventory and runner, or the engine in
the CLI's process).

* `UnitSweeps.sweep_unit` sweeps a unit plus its escaped leftovers and makes sure one stop
  gets one sweep.

What each unit held and the escaped-leftover (adoption) rule, both pure: adoption.py.

One stop, one sweep: the drop-in runs while the unit is deactivating and the watcher fires once
it is inactive. Both name the unit's InvocationID, and automatic sweeps ("hook:", "watch:") of
the same unit and invocation share one sweep and its report. Dry runs never do: they neither
join nor stand for a stop's sweep, whatever their reason says. A unit that systemd is already
starting again (Restart=) is not swept by the watcher: its new instance owns the GPUs.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from gpuguardd.engine.attribution import normalize_unit_name
from gpuguardd.records.enums import Outcome, RequesterKind
from gpuguardd.records.models import ScanResult, SweepRequest
from gpuguardd.records.report import Report
from gpuguardd.systemd.adoption import (
    MAX_PROCESSES_PER_UNIT,
    MAX_UNITS,
    UnitGpuRecord,
    UnitGpuRecords,
    adoption_candidates,
    cuda_visible_gpus,
    owner_lets_go,
)
from gpuguardd.systemd.rules import (
    HOOK_PREFIX,
    RUNNING_STATES,
    STOPPED_STATES,
    WATCH_PREFIX,
    UnitState,
)

# The pieces' names, also from here (where they were before adoption.py and rules.py).
__all__ = ["HOOK_PREFIX", "MAX_PROCESSES_PER_UNIT", "MAX_UNITS", "RUNNING_STATES", "STOPPED_STATES",
           "WATCH_PREFIX", "NoSystemd", "SystemdView", "UnitGpuRecord", "UnitGpuRecords", "UnitState",
           "UnitSweeps", "adoption_candidates", "cuda_visible_gpus"]

log = logging.getLogger("gpuguard.unitwatch")

# Without an InvocationID (no systemd), automatic sweeps of one unit this close are one stop.
DEDUPE_WINDOW_SEC = 10.0
# Finished automatic sweeps are remembered this long for a late second trigger of the same stop.
REMEMBER_SEC = 300.0
# The requesters whose real sweep of a unit stands for its stop (one sweep per stop): the stop
# hook (root's, or a polkit-authorised caller's: the service checked) and the unit watch.
AUTOMATIC = frozenset({RequesterKind.HOOK, RequesterKind.HOOK_NONROOT, RequesterKind.WATCH})
async def _now(value: Report | None) -> Report | None:
    return value


class SystemdView(Protocol):
    """What a unit sweep asks systemd (client.Systemd over the bus)."""

    available: bool

    async def state(self, unit: str) -> UnitState | None: ...

    async def environment(self, unit: str) -> list[str]: ...

    async def dropins(self, unit: str) -> list[str]: ...


class NoSystemd:
    """No systemd to ask (no bus): nothing is adopted, automatic sweeps dedupe by time."""

    available = False

    async def state(self, unit: str) -> UnitState | None:
        return None

    async def environment(self, unit: str) -> list[str]:
        return []

    async def dropins(self, unit: str) -> list[str]:
        return []


class UnitSweeps:
    """Unit sweeps with escaped leftovers and one sweep per stop.

    `scan` gives a fresh holder scan; `run` runs a sweep (the daemon's runner: signals on the
    bus, history, journal; or the engine in-process); `dry_run_default` is [Sweep] DryRun,
    for requests that leave dry_run open.
    """

    def __init__(self, systemd: SystemdView, scan: Callable[[], Awaitable[ScanResult]],
                 run: Callable[[SweepRequest], Awaitable[Report]],
                 dry_run_default: Callable[[], bool] = lambda: False) -> None:
        self.systemd = systemd
        self.scan = scan
        self.run = run
        self.dry_run_default = dry_run_default
        self.records = UnitGpuRecords()
        self._inflight: dict[tuple[str, str], asyncio.Future[Report]] = {}
        self._recent: collections.OrderedDict[tuple[str, str], tuple[float, Report]] = \
            collections.OrderedDict()

    async def sweep_unit(self, request: SweepRequest) -> Report | None:
        """Sweep `request.unit` plus its escaped leftovers; automatic triggers share a sweep.

        Returns None only when the watcher's sweep is skipped because the unit runs again.
        """
        return await (await self.begin(request))

    async def begin(self, request: SweepRequest) -> Awaitable[Report | None]:
        """Decide what `request` is (a new sweep, or the stop's sweep already running or done)
        and, for a new automatic sweep, make it the stop's one sweep now; the awaitable
        returned runs or joins it. The daemon's start (resume.py) claims the sweeps it
        finishes this way before it owns its bus name, so a hook that asks again joins them.
        """
        unit = normalize_unit_name(request.unit)  # already validated by the caller
        # Only a real sweep stands for a stop: a dry run (which anyone may ask for, with any
        # reason) neither joins nor becomes the stop's sweep, or `nobody` could hand the
        # stop hook a report that signalled nothing. A real sweep with a "hook:" reason is
        # root's or a polkit-authorised caller's (the service checked).
        dry_run = request.is_dry_run(self.dry_run_default())
        automatic = request.requester_kind in AUTOMATIC and not dry_run
        state = await self.systemd.state(unit) if self.systemd.available else None
        if request.requester_kind == RequesterKind.WATCH and state is not None and state.running:
            log.info("%s is %s again (Restart=?): not sweeping its new instance", unit,
                     state.active_state)
            return _now(None)
        if not automatic:
            return self._sweep(unit, request, state)
        key = (unit, state.invocation_id if state is not None else "")
        self._expire()
        remembered = self._recent.get(key)
        if remembered is not None and (key[1] or time.monotonic() - remembered[0] < DEDUPE_WINDOW_SEC):
            log.info("%s: this stop was already swept (%s); same report", unit, remembered[1].id[:8])
            return _now(remembered[1])
        running = self._inflight.get(key)
        if running is not None:
            log.info("%s: joining the sweep already running for this stop", unit)
            return asyncio.shield(running)
        future: asyncio.Future[Report] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        return self._own(key, future, unit, request, state)

    async def _own(self, key: tuple[str, str], future: asyncio.Future[Report], unit: str,
                   request: SweepRequest, state: UnitState | None) -> Report:
        try:
            report = await self._sweep(unit, request, state)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a lone sweep's failure is its caller's to see
            raise
        finally:
            self._inflight.pop(key, None)
        future.set_result(report)
        self._recent[key] = (time.monotonic(), report)
        return report

    def _expire(self) -> None:
        now = time.monotonic()
        while self._recent and now - next(iter(self._recent.values()))[0] > REMEMBER_SEC:
            self._recent.popitem(last=False)

    async def _sweep(self, unit: str, request: SweepRequest, state: UnitState | None) -> Report:
        if not request.container and self.systemd.available:
            # A resumed sweep (resume.py) keeps what its predecessor had adopted: the same
            # processes, by PID and start time, whatever the records lost with the crash.
            adopted = set(request.adopted) | set(await self._adopt(unit, request.include_management))
            request.adopted = sorted(adopted)
        report = await self.run(request)
        if not report.dry_run and report.outcome in (Outcome.FREED, Outcome.NOTHING) \
                and (state is None or state.stopped or state.active_state == "deactivating"):
            # Everything the unit left is gone: start afresh with its next instance.
            self.records.forget(unit)
        return report

    async def _adopt(self, unit: str, include_management: bool) -> list[tuple[int, int]]:
        # What the unit still holds now counts too: all a one-shot `gpuguardctl sweep --local`
        # has seen of it, and the daemon's record of a unit that started before it did.
        result = await self.scan()
        self.records.observe(result.holders)
        record = self.records.get(unit)
        if record is None or not record.hinted:
            gpus = cuda_visible_gpus(await self.systemd.environment(unit), result.nvml)
            if gpus:
                self.records.hint(unit, gpus)
                record = self.records.get(unit)
        if record is None:
            return []
        adopted: list[tuple[int, int]] = []
        states: dict[str, UnitState | None] = {}
        for holder, why in adoption_candidates(unit, record, result.holders, include_management):
            owner = holder.unit
            if owner:
                if owner not in states:
                    states[owner] = await self.systemd.state(owner)
                if not owner_lets_go(states[owner]):
                    continue  # rule 4: a running unit (or one we cannot ask about) owns it
            log.info("%s: pid %d (%s) is in %s, outside the unit, and %s: swept with it", unit,
                     holder.pid, holder.comm, owner or f"cgroup {holder.cgroup or '?'} of no unit",
                     why)
            adopted.append((holder.pid, holder.start_time))
        return adopted
