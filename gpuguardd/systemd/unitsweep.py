"""A unit's escaped leftovers, for gpuguardd and `gpuguardctl sweep --local` alike: adoption.py's
rule applied with systemd's answers. Free of D-Bus (systemd is a `SystemdView`); it sweeps
nothing itself."""

from __future__ import annotations

import logging
from typing import Protocol

from gpuguardd.records.models import ScanResult
from gpuguardd.systemd.adoption import (
    UnitGpuRecords,
    adoption_candidates,
    cuda_visible_gpus,
    owner_lets_go,
)
from gpuguardd.systemd.rules import UnitState

log = logging.getLogger("gpuguard.unitwatch")


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


async def leftovers(systemd: SystemdView, records: UnitGpuRecords, unit: str, result: ScanResult,
                    include_management: bool = False) -> list[tuple[int, int]]:
    """(pid, start time) of the holders in `result` that are `unit`'s escaped leftovers.

    What the unit holds in `result` counts too: all a one-shot `gpuguardctl sweep --local` has
    seen of it, and the daemon's record of a unit that started before it did. Without systemd,
    nothing: there every process looks like it belongs to no unit.
    """
    if not systemd.available:
        return []
    records.observe(result.holders)
    record = records.get(unit)
    if record is None or not record.hinted:
        gpus = cuda_visible_gpus(await systemd.environment(unit), result.nvml)
        if gpus:
            records.hint(unit, gpus)
            record = records.get(unit)
    adopted: list[tuple[int, int]] = []
    states: dict[str, UnitState | None] = {}
    for holder, why in adoption_candidates(unit, record, result.holders, include_management):
        owner = holder.unit
        if owner:
            if owner not in states:
                states[owner] = await systemd.state(owner)
            if not owner_lets_go(states[owner]):
                continue  # rule 4: a running unit (or one we cannot ask about) owns it
        log.info("%s: pid %d (%s) is in %s, outside the unit, and %s: swept with it", unit,
                 holder.pid, holder.comm, owner or f"cgroup {holder.cgroup or '?'} of no unit", why)
        adopted.append((holder.pid, holder.start_time))
    return adopted
