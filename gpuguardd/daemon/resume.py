"""What a starting gpuguardd finishes for the one before it, which died mid-work.

* A sweep in flight (inflight.py) is recorded as `interrupted`, `finished_by` naming the sweep
  that repeats it (same scope and caller, `resumes` naming it: processes already gone are
  simply not found). A unit's sweep is claimed before the bus name is owned, so the stop hook
  asking again (cli/sweep.py) joins it. Only recorded, not repeated: a record older than its
  budget plus RESUME_WINDOW_SEC (its GPUs may be in new hands), or a unit that runs again.
* A watched or hooked unit that stopped while no daemon watched, whose processes still hold
  GPUs in its cgroup or escaped from it (units.py's records), is swept as `recovered:<unit>`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import cast

from gpuguardd.daemon.history import History
from gpuguardd.daemon.inflight import InFlightSweep, InFlightSweeps
from gpuguardd.daemon.runner import sweep_budget_sec
from gpuguardd.daemon.units import UnitSweeps
from gpuguardd.records.enums import HolderKind, RequesterKind
from gpuguardd.records.models import SweepRequest
from gpuguardd.records.report import Report
from gpuguardd.systemd.adoption import adoption_candidates
from gpuguardd.systemd.dropins import DROPIN_FILE
from gpuguardd.systemd.rules import RECOVERED_PREFIX, matches

log = logging.getLogger("gpuguard.resume")

# How long after its budget ran out an interrupted sweep is still swept again (Restart=
# brings the daemon back in about a second).
RESUME_WINDOW_SEC = 60.0
# Sweeps a unit is running again in: its new instance owns the GPUs.
_RUNS_AGAIN = frozenset({"active", "activating", "reloading", "refreshing"})


class Resume:
    def __init__(self, inflight: InFlightSweeps, history: History, units: UnitSweeps) -> None:
        self.inflight = inflight
        self.history = history
        self.units = units
        self.runner = units.runner
        self._io = units.runner.io

    async def claim(self) -> list[Awaitable[Report | None]]:
        """Before the bus name is owned: record what was cut short and claim the sweeps that
        finish it, which the awaitables returned run."""
        found = cast(list[InFlightSweep], await self._io(self.inflight.load))
        known = {str(r.get("id")) for r in self.history.newest(0)} if found else set()
        work: list[Awaitable[Report | None]] = []
        for sweep in found:
            try:
                started = await self._claim_one(sweep, sweep.report_id in known)
            except Exception as exc:  # one bad record never keeps the daemon from serving
                log.error("sweep %s cut short by the last gpuguardd: not finished: %s: %s",
                          sweep.report_id[:8], type(exc).__name__, exc)
                continue
            if started is not None:
                work.append(started)
        return work

    async def _claim_one(self, sweep: InFlightSweep, known: bool) -> Awaitable[Report | None] | None:
        request = sweep.request
        age = time.time() - sweep.started_usec / 1e6
        limit = sweep_budget_sec(self.runner.engine.config, request) + RESUME_WINDOW_SEC
        why = ""
        if age > limit:
            why = (f"gpuguardd stopped during this sweep and was back only {age:.0f} s after it "
                   f"began (more than {limit:.0f} s): not swept again, its GPUs may be in "
                   "use by others since; sweep again if anything is left")
        elif request.unit:
            state = await self.units.systemd.state(request.unit)
            if state is not None and state.active_state in _RUNS_AGAIN:
                why = (f"gpuguardd stopped during this sweep; {request.unit} is "
                       f"{state.active_state} again, so its new instance was not swept")
        if why:
            log.warning("sweep %s (%s): %s", sweep.report_id[:8], request.requested_by, why)
            if not known:
                await self._io(self.history.append, sweep.report(why))
            await self._io(self.inflight.remove, sweep.report_id)
            return None
        successor = dataclasses.replace(request, report_id=uuid.uuid4().hex,
                                        resumes=sweep.report_id, adopted=list(request.adopted))
        log.warning("sweep %s (%s) was cut short when gpuguardd stopped: sweep %s finishes it",
                    sweep.report_id[:8], request.requested_by, successor.report_id[:8])
        if not known:
            # (Known: recorded at a stop that outlasted its budget; `resumes` links the two.)
            await self._io(self.history.append, sweep.report(
                "gpuguardd stopped (a crash, a kill or a restart) while this sweep "
                f"was running; sweep {successor.report_id} finished it",
                finished_by=successor.report_id))
        # The successor's record first, then the predecessor's goes: a crash in between
        # leaves one of them to finish, never none.
        await self._io(self.inflight.add, InFlightSweep(successor, time.time_ns() // 1000))
        await self._io(self.inflight.remove, sweep.report_id)
        if successor.unit:
            return await self.units.begin(successor)
        return self.runner.run(successor)

    async def run(self, work: list[Awaitable[Report | None]]) -> None:
        """After the name is owned: the claimed sweeps, then the stopped units."""
        for report in await asyncio.gather(*work, return_exceptions=True):
            if isinstance(report, BaseException):
                log.error("a sweep finishing the last gpuguardd's failed: %s", report)
            elif report is not None:
                log.info("sweep %s finished sweep %s: %s", report.id[:8], report.resumes[:8] or "?",
                         report.outcome)
        await self.recover_units()

    async def _hooked(self, unit: str) -> bool:
        if matches(unit, self.runner.engine.config.watch_units):
            return True
        return any(path.rsplit("/", 1)[-1] == DROPIN_FILE
                   for path in await self.units.systemd.dropins(unit))

    async def recover_units(self) -> None:
        """Sweep the watched or hooked units that stopped while no daemon was there to."""
        if not self.units.systemd.available:
            return
        result = await self.units.inventory.fresh_scan()
        self.units.records.observe(result.holders)
        compute = [h for h in result.holders
                   if h.kind == HolderKind.COMPUTE and not h.protected and not h.container]
        units = {h.unit for h in compute if h.unit} | set(self.units.records.units())
        for unit in sorted(units):
            left = [h for h in compute if h.unit == unit]
            escaped = adoption_candidates(unit, self.units.records.get(unit), result.holders)
            if not left and not escaped:
                continue
            state = await self.units.systemd.state(unit)
            if state is None or not state.stopped or not await self._hooked(unit):
                continue
            log.warning("%s stopped while gpuguardd was not running, and %d of its processes "
                        "still hold GPUs: sweeping it", unit, len(left) + len(escaped))
            reason = f"{RECOVERED_PREFIX}{unit}"
            await self.units.sweep_unit(SweepRequest(
                unit=unit, reason=f"{reason} state={state.active_state or 'unloaded'}",
                requested_by=reason, requester_kind=RequesterKind.RECOVERED))
