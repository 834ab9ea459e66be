"""Watch mode's facts for the daemon: which GPUs and processes each unit held (kept in the
runtime directory across restarts), and the watched units' stops and the services' starts
as systemd reports them. It tells; it sweeps nothing: daemon/runner.py's UnitSweeps reads
`watcher.events` and acts.

The pieces: rules.py (which units, what counts as a stop; pure), adoption.py (what each unit
held, the escaped-leftover rule and a unit's escaped leftovers, asked of systemd; no D-Bus),
client.py (systemd's manager on the bus: its calls and its signals).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence

from dbus_fast.aio import MessageBus

from gpuguardd.records.models import Holder, NvmlSnapshot
from gpuguardd.safefiles import open_nofollow, write_atomic
from gpuguardd.systemd.adoption import UnitGpuRecords, cuda_visible_gpus
from gpuguardd.systemd.client import Systemd, UnitWatcher
from gpuguardd.systemd.rules import UnitState, matches

log = logging.getLogger("gpuguard.unitwatch")


class UnitWatch:
    """The unit records, their file, systemd and the watcher, for the daemon's Service."""

    def __init__(self, bus: MessageBus, patterns: Sequence[str], records_path: str = "") -> None:
        self.systemd = Systemd(bus)
        self.records = UnitGpuRecords()
        self.watcher = UnitWatcher(bus, self.systemd, patterns)
        # What each unit held, kept in the runtime directory across the daemon's restarts:
        # after a crash, the next daemon still knows a stopped unit's escaped workers.
        self.records_path = records_path
        self._saved = b""
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

    def config_changed(self, patterns: Sequence[str]) -> None:
        self.watcher.patterns = tuple(patterns)

    def observe(self, holders: Iterable[Holder]) -> None:
        self.records.observe(holders)
        self._save_records()

    async def started(self, state: UnitState, nvml: NvmlSnapshot) -> bool:
        """Note a service's CUDA_VISIBLE_DEVICES as it starts; True for a watched unit, whose
        holdings the caller then observes (later ones arrive with the daemon's refreshes)."""
        gpus = cuda_visible_gpus(await self.systemd.environment(state.unit), nvml)
        if gpus:
            self.records.hint(state.unit, gpus)
        return matches(state.unit, self.watcher.patterns)
