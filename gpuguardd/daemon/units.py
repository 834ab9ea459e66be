"""Unit sweeps, with the unit's escaped leftovers, and what a starting gpuguardd finishes for
the one before it. What each unit held is kept in the runtime directory for the next daemon.

One stop, one sweep: the drop-in runs while the unit deactivates, the watcher once it is
inactive; both name its InvocationID, and automatic sweeps of one stop share one report.

Resume: a sweep cut short (inflight.py) is recorded `interrupted` and repeated by a successor
naming it in `resumes`, claimed before the bus name is owned so the stop hook's retry
(cli/sweep.py) joins it; only recorded when older than its budget plus RESUME_WINDOW_SEC (its
GPUs may be in new hands) or when its unit runs again. A watched or hooked unit that stopped
while no daemon ran, whose processes still hold GPUs, is swept as `recovered:<unit>`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Coroutine, Iterable, Sequence
from typing import Any, cast

from dbus_fast.aio import MessageBus

from gpuguardd.daemon.inflight import InFlightSweep
from gpuguardd.daemon.inventory import Inventory
from gpuguardd.daemon.runner import SweepRunner, sweep_budget_sec
from gpuguardd.engine.attribution import normalize_unit_name
from gpuguardd.engine.engine import Prepared
from gpuguardd.records.enums import HolderKind, Outcome, RequesterKind
from gpuguardd.records.models import Holder, SweepRequest
from gpuguardd.records.report import Report
from gpuguardd.safefiles import open_nofollow, write_atomic
from gpuguardd.systemd.adoption import SystemdView, UnitGpuRecords, adoption_candidates, cuda_visible_gpus, leftovers
from gpuguardd.systemd.client import Systemd, UnitWatcher
from gpuguardd.systemd.dropins import DROPIN_FILE
from gpuguardd.systemd.rules import RECOVERED_PREFIX, WATCH_PREFIX, UnitState, matches

log = logging.getLogger("gpuguard.runner")


# Without an InvocationID (no systemd), automatic sweeps of one unit this close are one stop.
DEDUPE_WINDOW_SEC = 10.0
# Finished automatic sweeps are remembered this long for a late second trigger of the same stop.
REMEMBER_SEC = 300.0
# The requesters whose real sweep stands for a unit's stop (HOOK_NONROOT: polkit-authorised).
AUTOMATIC = frozenset({RequesterKind.HOOK, RequesterKind.HOOK_NONROOT, RequesterKind.WATCH})
# How long past its budget an interrupted sweep is still repeated (Restart= takes ~1 s).
RESUME_WINDOW_SEC = 60.0
# Sweeps a unit is running again in: its new instance owns the GPUs.
_RUNS_AGAIN = frozenset({"active", "activating", "reloading", "refreshing"})


class UnitSweeps:
    def __init__(self, runner: SweepRunner, inventory: Inventory, bus: MessageBus,
                 patterns: Sequence[str], records_path: str) -> None:
        self.runner = runner
        self.inventory = inventory
        systemd = Systemd(bus)
        self.systemd: SystemdView = systemd
        self.records = UnitGpuRecords()
        self.watcher = UnitWatcher(bus, systemd, patterns)
        self.records_path = records_path
        self._saved = b""
        # Each stop's automatic sweep by (unit, InvocationID), with when it started or finished.
        self._stops: collections.OrderedDict[tuple[str, str], tuple[float, asyncio.Future[Report]]] = \
            collections.OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._load_records()

    def _load_records(self) -> None:
        if not self.records_path:
            return
        try:
            with os.fdopen(open_nofollow(self.records_path, os.O_RDONLY), "rb") as handle:
                restored = self.records.restore(json.loads(handle.read(64 * 1024 * 1024)))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("unit records in %s not used: %s", self.records_path, exc)
            return
        log.info("%d unit record(s) kept from the previous gpuguardd", restored)

    def observe(self, holders: Iterable[Holder]) -> None:
        self.records.observe(holders)
        if not self.records_path:
            return
        data = json.dumps(self.records.dump(), ensure_ascii=True).encode("ascii")
        if data == self._saved:
            return
        # Tried once per change, not every poll: a missing runtime directory is logged once.
        self._saved = data
        try:
            write_atomic(self.records_path, [data], prefix=".units.", mode=0o600, fsync=False)
        except OSError as exc:
            log.warning("cannot keep the unit records in %s: %s", self.records_path, exc.strerror or exc)

    async def start(self) -> None:
        try:
            await self.watcher.start()
        except Exception as exc:  # never keep the daemon from serving its API
            log.warning("unit watch off: %s", exc)
            return
        self._spawn(self._follow())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _follow(self) -> None:
        while True:
            event = await self.watcher.events.get()
            self._spawn(self._on_event(event.state, event.stopped))

    async def _on_event(self, state: UnitState, stopped: bool) -> None:
        try:
            if not stopped:
                # A starting service's CUDA_VISIBLE_DEVICES; a watched unit's holdings now.
                gpus = cuda_visible_gpus(await self.systemd.environment(state.unit), self.inventory.snapshot)
                if gpus:
                    self.records.hint(state.unit, gpus)
                if matches(state.unit, self.watcher.patterns):
                    self.observe((await self.inventory.fresh_scan()).holders)
                return
            log.info("%s stopped (%s%s): sweeping it", state.unit, state.active_state or "unloaded",
                     f", result {state.result}" if state.result else "")
            await self.sweep_unit(SweepRequest(
                unit=state.unit, requested_by=f"{WATCH_PREFIX}{state.unit}",
                requester_kind=RequesterKind.WATCH,
                reason=f"{WATCH_PREFIX}{state.unit} result={state.result or '-'}"
                       f" state={state.active_state or 'unloaded'}"))
        except Exception:
            log.exception("handling %s (%s)", state.unit, state.active_state)

    async def sweep_unit(self, request: SweepRequest, prepared: Prepared | None = None) -> Report | None:
        """None only when the watcher's sweep is skipped because the unit runs again."""
        return await (await self.begin(request, prepared))

    async def begin(self, request: SweepRequest, prepared: Prepared | None = None) -> Awaitable[Report | None]:
        """Make a new automatic sweep the stop's one sweep now; the awaitable returned runs it or
        joins the stop's sweep (claim_unfinished claims this way, before the name is owned)."""
        unit = normalize_unit_name(request.unit)  # already validated by the caller
        # A dry run (anyone's) never joins or becomes a stop's sweep: no empty report for the hook.
        dry_run = request.is_dry_run(self.runner.engine.config.dry_run)
        state = await self.systemd.state(unit)  # None without systemd
        if request.requester_kind == RequesterKind.WATCH and state is not None and state.running:
            log.info("%s is %s again (Restart=?): not sweeping its new instance", unit, state.active_state)
            return asyncio.sleep(0, None)
        if request.requester_kind not in AUTOMATIC or dry_run:
            return self._sweep(unit, request, state, prepared)
        key = (unit, state.invocation_id if state is not None else "")
        now = time.monotonic()
        while self._stops:
            first, (at, done) = next(iter(self._stops.items()))
            if not done.done() or now - at <= REMEMBER_SEC:
                break
            del self._stops[first]
        at, future = self._stops.get(key, (now, None))
        if future is not None and not future.done():
            log.info("%s: joining the sweep already running for this stop", unit)
            return asyncio.shield(future)
        if future is not None and (key[1] or now - at < DEDUPE_WINDOW_SEC):
            log.info("%s: this stop was already swept (%s); same report", unit, future.result().id[:8])
            return future
        future = asyncio.get_running_loop().create_future()
        self._stops[key] = (now, future)
        self._stops.move_to_end(key)
        return self._own(key, future, unit, request, state, prepared)

    async def _own(self, key: tuple[str, str], future: asyncio.Future[Report], unit: str, request: SweepRequest,
                   state: UnitState | None, prepared: Prepared | None) -> Report:
        try:
            report = await self._sweep(unit, request, state, prepared)
        except BaseException as exc:
            self._stops.pop(key, None)
            if isinstance(exc, Exception):
                future.set_exception(exc)
                future.exception()  # retrieved: a lone sweep's failure is its caller's to see
            else:
                future.cancel()
            raise
        future.set_result(report)
        self._stops[key] = (time.monotonic(), future)
        self._stops.move_to_end(key)
        return report

    async def _sweep(self, unit: str, request: SweepRequest, state: UnitState | None,
                     prepared: Prepared | None = None) -> Report:
        try:
            if not request.container and self.systemd.available:
                # The leftovers are found in the sweep's own first scan: one /proc walk for both.
                prepared = prepared or await self.runner.io(self.runner.engine.prepare, request)
                scan = await self.runner.io(self.runner.engine.pin, prepared)
                # A resumed sweep keeps its predecessor's adopted (PID, start time) pairs.
                found = await leftovers(self.systemd, self.records, unit, scan, request.include_management)
                request.adopted = sorted(set(request.adopted) | set(found))
            report = await self.runner.run(request, prepared)
        finally:
            if prepared is not None:
                prepared.release()  # the first scan's pidfds, if no sweep took them over
        if not report.dry_run and report.outcome in (Outcome.FREED, Outcome.NOTHING) \
                and (state is None or state.stopped or state.active_state == "deactivating"):
            self.records.forget(unit)  # everything the unit left is gone: start afresh
        return report

    async def claim_unfinished(self) -> list[Awaitable[Report | None]]:
        """Before the bus name is owned: record what was cut short, claim the sweeps finishing it."""
        found = cast(list[InFlightSweep], await self.runner.io(self.runner.inflight.load))
        known = {str(r.get("id")) for r in self.runner.history.newest(0)} if found else set()
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
        request, inflight = sweep.request, self.runner.inflight
        age = time.time() - sweep.started_usec / 1e6
        limit = sweep_budget_sec(self.runner.engine.config, request) + RESUME_WINDOW_SEC
        why = ""
        if age > limit:
            why = (f"gpuguardd stopped during this sweep and was back only {age:.0f} s after it "
                   f"began (more than {limit:.0f} s): not swept again, its GPUs may be in "
                   "use by others since; sweep again if anything is left")
        elif request.unit:
            state = await self.systemd.state(request.unit)
            if state is not None and state.active_state in _RUNS_AGAIN:
                why = (f"gpuguardd stopped during this sweep; {request.unit} is "
                       f"{state.active_state} again, so its new instance was not swept")
        if why:
            log.warning("sweep %s (%s): %s", sweep.report_id[:8], request.requested_by, why)
            if not known:
                await self.runner.io(self.runner.history.append, sweep.report(why))
            await self.runner.io(inflight.remove, sweep.report_id)
            return None
        successor = dataclasses.replace(request, report_id=uuid.uuid4().hex,
                                        resumes=sweep.report_id, adopted=list(request.adopted))
        log.warning("sweep %s (%s) was cut short when gpuguardd stopped: sweep %s finishes it",
                    sweep.report_id[:8], request.requested_by, successor.report_id[:8])
        if not known:  # known: recorded at a stop that outlasted its budget
            await self.runner.io(self.runner.history.append, sweep.report(
                "gpuguardd stopped (a crash, a kill or a restart) while this sweep "
                f"was running; sweep {successor.report_id} finished it",
                finished_by=successor.report_id))
        # The successor's record first: a crash in between leaves one to finish, never none.
        await self.runner.io(inflight.add, InFlightSweep(successor, time.time_ns() // 1000))
        await self.runner.io(inflight.remove, sweep.report_id)
        if successor.unit:
            return await self.begin(successor)
        return self.runner.run(successor)

    async def finish_unfinished(self, work: list[Awaitable[Report | None]]) -> None:
        """After the name is owned: the claimed sweeps, then the stopped units."""
        for report in await asyncio.gather(*work, return_exceptions=True):
            if isinstance(report, BaseException):
                log.error("a sweep finishing the last gpuguardd's failed: %s", report)
            elif report is not None:
                log.info("sweep %s finished sweep %s: %s", report.id[:8], report.resumes[:8] or "?", report.outcome)
        await self.recover_units()

    async def _hooked(self, unit: str) -> bool:
        return matches(unit, self.runner.engine.config.watch_units) or any(
            path.rsplit("/", 1)[-1] == DROPIN_FILE for path in await self.systemd.dropins(unit))

    async def recover_units(self) -> None:
        if not self.systemd.available:
            return
        result = await self.inventory.fresh_scan()
        self.records.observe(result.holders)
        compute = [h for h in result.holders
                   if h.kind == HolderKind.COMPUTE and not h.protected and not h.container]
        units = {h.unit for h in compute if h.unit} | set(self.records.units())
        for unit in sorted(units):
            left = [h for h in compute if h.unit == unit]
            escaped = adoption_candidates(unit, self.records.get(unit), result.holders)
            if not left and not escaped:
                continue
            state = await self.systemd.state(unit)
            if state is None or not state.stopped or not await self._hooked(unit):
                continue
            log.warning("%s stopped while gpuguardd was not running, and %d of its processes "
                        "still hold GPUs: sweeping it", unit, len(left) + len(escaped))
            reason = f"{RECOVERED_PREFIX}{unit}"
            await self.sweep_unit(SweepRequest(
                unit=unit, reason=f"{reason} state={state.active_state or 'unloaded'}",
                requested_by=reason, requester_kind=RequesterKind.RECOVERED))
