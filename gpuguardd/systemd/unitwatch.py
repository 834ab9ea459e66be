"""Watch mode for the daemon: sweep a unit when it stops, knowing which GPUs were its own.

The unit watch, in pieces:
* rules.py      which units are watched, unit object paths, unit states, what counts as a
                stop, the hook:/watch: prefixes (pure);
* adoption.py   what each unit held and the escaped-leftover (adoption) rule (pure);
* unitsweep.py  a unit's sweep with its leftovers, one sweep per stop (no D-Bus);
* client.py     systemd's manager on the bus (`Systemd`, `local_systemd`);
* watcher.py    follows systemd's signals and calls back on stops and starts (`UnitWatcher`);
* here          `UnitWatch` joins them for the daemon's Service: every unit sweep (from the
                drop-in's `gpuguardctl sweep --unit %n`, from the watcher, or from an admin)
                goes through `sweep_unit`. `gpuguardctl sweep --local --unit` takes the same
                path with client.local_systemd.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence

from dbus_fast.aio import MessageBus

from gpuguardd.records.enums import RequesterKind
from gpuguardd.records.models import Holder, NvmlSnapshot, ScanResult, SweepRequest
from gpuguardd.records.report import Report
from gpuguardd.safefiles import open_nofollow, write_atomic
from gpuguardd.systemd.client import Systemd, local_systemd
from gpuguardd.systemd.rules import matches, unit_name_from_path
from gpuguardd.systemd.unitsweep import (
    WATCH_PREFIX,
    UnitGpuRecords,
    UnitState,
    UnitSweeps,
    adoption_candidates,
    cuda_visible_gpus,
)
from gpuguardd.systemd.watcher import UnitWatcher

# The pieces' names, also from here (where they were before the split).
__all__ = ["Systemd", "UnitGpuRecords", "UnitState", "UnitWatch", "UnitWatcher",
           "adoption_candidates", "cuda_visible_gpus", "local_systemd", "matches",
           "unit_name_from_path"]

log = logging.getLogger("gpuguard.unitwatch")

class UnitWatch(UnitSweeps):
    """Records, watcher and one-sweep-per-stop, for the daemon's Service.

    `scan` gives a fresh holder scan (the daemon's shared inventory scan); `run` runs a sweep
    the way every other daemon sweep runs (signals on the bus, history, journal).
    """

    def __init__(self, bus: MessageBus, patterns: Callable[[], Sequence[str]],
                 snapshot: Callable[[], NvmlSnapshot],
                 scan: Callable[[], Awaitable[ScanResult]],
                 run: Callable[[SweepRequest], Awaitable[Report]],
                 dry_run_default: Callable[[], bool] = lambda: False,
                 records_path: str = "") -> None:
        systemd = Systemd(bus)
        super().__init__(systemd, scan, run, dry_run_default)
        self.patterns = patterns
        self.snapshot = snapshot
        self.watcher = UnitWatcher(bus, systemd, patterns(), self._stopped, self._active)
        # What each unit held, kept in the runtime directory across the daemon's restarts:
        # after a crash, the next daemon still knows a stopped unit's escaped workers.
        self.records_path = records_path
        self._saved = b""
        self._load_records()

    def _load_records(self) -> None:
        if not self.records_path:
            return
        try:
            fd = open_nofollow(self.records_path, os.O_RDONLY)
            try:
                text = os.read(fd, 64 * 1024 * 1024)
            finally:
                os.close(fd)
            restored = self.records.restore(json.loads(text))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("unit records in %s not used: %s", self.records_path, exc)
            return
        log.info("%d unit record(s) kept from the previous gpuguardd", restored)

    def _save_records(self) -> None:
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
        try:
            await self.watcher.start()
        except Exception as exc:  # never keep the daemon from serving its API
            log.warning("unit watch off: %s", exc)

    def config_changed(self) -> None:
        self.watcher.set_patterns(self.patterns())

    def observe(self, holders: Iterable[Holder]) -> None:
        self.records.observe(holders)
        self._save_records()

    async def _active(self, state: UnitState) -> None:
        environment = await self.systemd.environment(state.unit)
        gpus = cuda_visible_gpus(environment, self.snapshot())
        if gpus:
            self.records.hint(state.unit, gpus)
        if matches(state.unit, self.patterns()):
            # A watched unit just started: note what it holds already. Later holdings arrive
            # with the daemon's refreshes (NVML's process lists change as CUDA contexts open).
            self.records.observe((await self.scan()).holders)

    async def _stopped(self, state: UnitState) -> None:
        request = SweepRequest(unit=state.unit, requested_by=f"{WATCH_PREFIX}{state.unit}",
                               requester_kind=RequesterKind.WATCH,
                               reason=f"{WATCH_PREFIX}{state.unit} result={state.result or '-'}"
                                      f" state={state.active_state or 'unloaded'}")
        log.info("%s stopped (%s%s): sweeping it", state.unit, state.active_state or "unloaded",
                 f", result {state.result}" if state.result else "")
        await self.sweep_unit(request)
