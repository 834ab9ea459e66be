"""Every unit sweep (the drop-in's, the watcher's, an admin's, resume.py's) with the unit's
escaped leftovers, and watch mode: what each unit held (kept in the runtime directory, so the
next daemon still knows a stopped unit's escaped workers), stops and starts.

One stop, one sweep: the drop-in runs while the unit is deactivating and the watcher fires
once it is inactive. Both name the unit's InvocationID, and automatic sweeps ("hook:",
"watch:") of the same unit and invocation share one sweep and its report.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import time
from collections.abc import Awaitable, Coroutine, Iterable, Sequence
from typing import Any

from dbus_fast.aio import MessageBus

from gpuguardd.daemon.inventory import Inventory
from gpuguardd.daemon.runner import SweepRunner
from gpuguardd.engine.attribution import normalize_unit_name
from gpuguardd.engine.engine import Prepared
from gpuguardd.records.enums import Outcome, RequesterKind
from gpuguardd.records.models import Holder, SweepRequest
from gpuguardd.records.report import Report
from gpuguardd.safefiles import open_nofollow, write_atomic
from gpuguardd.systemd.adoption import SystemdView, UnitGpuRecords, cuda_visible_gpus, leftovers
from gpuguardd.systemd.client import Systemd, UnitWatcher
from gpuguardd.systemd.rules import WATCH_PREFIX, UnitState, matches

log = logging.getLogger("gpuguard.runner")


# Without an InvocationID (no systemd), automatic sweeps of one unit this close are one stop.
DEDUPE_WINDOW_SEC = 10.0
# Finished automatic sweeps are remembered this long for a late second trigger of the same stop.
REMEMBER_SEC = 300.0
# The requesters whose real sweep of a unit stands for its stop: the stop hook (root's, or a
# polkit-authorised caller's: the service checked) and the unit watch.
AUTOMATIC = frozenset({RequesterKind.HOOK, RequesterKind.HOOK_NONROOT, RequesterKind.WATCH})


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
        # Each stop's automatic sweep, by (unit, InvocationID): running, or done at a time
        # (then remembered for REMEMBER_SEC, for a late second trigger of the same stop).
        self._stops: collections.OrderedDict[tuple[str, str],
                                             tuple[float, asyncio.Future[Report]]] = \
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
        """Note what each unit holds, and keep it on disk when it changed."""
        self.records.observe(holders)
        if not self.records_path:
            return
        data = json.dumps(self.records.dump(), ensure_ascii=True).encode("ascii")
        if data == self._saved:
            return
        # Tried once per change of the records, not at every poll: a runtime directory that is
        # gone (removed by hand, or never made outside systemd) is said once, not every 2 s.
        self._saved = data
        try:
            write_atomic(self.records_path, [data], prefix=".units.", mode=0o600, fsync=False)
        except OSError as exc:
            log.warning("cannot keep the unit records in %s: %s", self.records_path,
                        exc.strerror or exc)

    async def start(self) -> None:
        """Follow systemd's stops and starts."""
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
                # A starting service's CUDA_VISIBLE_DEVICES; a watched unit's holdings now
                # (later ones arrive with the daemon's refreshes).
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

    async def sweep_unit(self, request: SweepRequest, prepared: Prepared | None = None
                         ) -> Report | None:
        """Sweep `request.unit` plus its escaped leftovers; None only when the watcher's sweep
        is skipped because the unit runs again. `prepared`: Engine.prepare's."""
        return await (await self.begin(request, prepared))

    async def begin(self, request: SweepRequest, prepared: Prepared | None = None
                    ) -> Awaitable[Report | None]:
        """Decide what `request` is (new, or the stop's sweep running or done) and make a new
        automatic sweep the stop's one sweep now; the awaitable returned runs or joins it
        (resume.py claims sweeps this way before the bus name is owned)."""
        unit = normalize_unit_name(request.unit)  # already validated by the caller
        # Only a real sweep stands for a stop: a dry run (which anyone may ask for, with any
        # reason) neither joins nor becomes the stop's sweep, or `nobody` could hand the stop
        # hook a report that signalled nothing.
        dry_run = request.is_dry_run(self.runner.engine.config.dry_run)
        state = await self.systemd.state(unit)  # None without systemd
        if request.requester_kind == RequesterKind.WATCH and state is not None and state.running:
            log.info("%s is %s again (Restart=?): not sweeping its new instance", unit,
                     state.active_state)
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
            log.info("%s: this stop was already swept (%s); same report", unit,
                     future.result().id[:8])
            return future
        future = asyncio.get_running_loop().create_future()
        self._stops[key] = (now, future)
        self._stops.move_to_end(key)
        return self._own(key, future, unit, request, state, prepared)

    async def _own(self, key: tuple[str, str], future: asyncio.Future[Report], unit: str,
                   request: SweepRequest, state: UnitState | None,
                   prepared: Prepared | None) -> Report:
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
        if not request.container and self.systemd.available:
            # A resumed sweep (resume.py) keeps what its predecessor had adopted: the same
            # processes, by PID and start time, whatever the records lost with the crash.
            found = await leftovers(self.systemd, self.records, unit, await self.inventory.fresh_scan(),
                                    request.include_management)
            request.adopted = sorted(set(request.adopted) | set(found))
        # The adopted leftovers join the prepared scope in the sweep (Engine.sweep).
        report = await self.runner.run(request, prepared)
        if not report.dry_run and report.outcome in (Outcome.FREED, Outcome.NOTHING) \
                and (state is None or state.stopped or state.active_state == "deactivating"):
            self.records.forget(unit)  # everything the unit left is gone: start afresh
        return report
